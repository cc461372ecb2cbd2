"""Which package may import which (docs/architecture.md): the rule read from the source itself.

Every ``import torchtitan...`` in the library (top level, inside functions, under
``TYPE_CHECKING`` alike) is checked against ``ALLOWED``. Lower packages never import upper ones;
only ``models/<family>/`` imports a family; ``errors`` and ``observability/log`` are leaves every
package may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "torchtitan"

# Leaves: modules that import nothing else of the library's (but another leaf), usable from
# anywhere; ``remote``: object-storage URLs, read by the data and checkpoint packages alike;
# ``devices``: the accelerators' table, read by metrics, the memory estimate and the planner.
LEAVES = {
    "torchtitan.errors",
    "torchtitan.observability.log",
    "torchtitan.remote",
    "torchtitan.devices",
}

# area -> the areas it may import (besides itself and the leaves). An area is a package under
# torchtitan/, with models/ split into its parts.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "models.common": {"distributed.utils"},
    "models.spec": {"models.family"},  # importing the families registers them
    "models.family": {"models.common", "models.spec", "distributed.tensor_parallel"},
    "distributed": {"config", "quantization", "lora", "models.common"},
    "quantization": {"config", "distributed"},
    "lora": {"config", "distributed"},  # LoRA layers, applying them, their exports
    "data": {"config", "observability"},
    "optim": {"config", "distributed"},
    "observability": {"config", "distributed"},
    "resilience": {"config", "distributed"},
    "checkpoint": {"config", "distributed", "models.spec", "models.common", "observability"},
    # downstream tasks and scoring, a trained model loaded for inference
    "evaluation": {"config", "data", "checkpoint", "models.spec"},
    "lm_eval": {"evaluation"},  # lm-eval's model (python -m torchtitan.lm_eval)
    "train": {
        "config",
        "data",
        "distributed",
        "models.common",
        "models.spec",
        "optim",
        "checkpoint",
        "evaluation",
        "observability",
        "resilience",
        "quantization",
        "lora",
    },  # fmt: skip
    # the layout planner: layouts, the cost model, the traced memory estimate (it builds and
    # traces the model as training does); its config written whole (checkpoint.storage)
    "planning": {
        "checkpoint",
        "config",
        "distributed",
        "models.common",
        "models.spec",
        "optim",
        "train",
    },  # fmt: skip
    # torchtitan/preflight.py and plan.py: the commands python -m torchtitan.preflight / .plan
    "entry": {"train", "planning"},
}


def area(module: str) -> str:
    """``torchtitan.models.qwen3.model`` -> ``models.family``; ``torchtitan.train.loss`` ->
    ``train``; a sub-area where the rule names one (``distributed.utils``)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in ("preflight", "plan"):
        return "entry"
    if parts[0] == "models":
        if len(parts) == 1:
            return "models.spec"  # models/__init__.py imports the families to register them
        if parts[1] in ("common", "spec"):
            return f"models.{parts[1]}"
        return "models.family"
    return parts[0]


def allowed(src: str, target: str) -> bool:
    if target in LEAVES or any(target.startswith(leaf + ".") for leaf in LEAVES):
        return True
    to = area(target)
    if to == area(src):
        return True
    rules = ALLOWED[area(src)]
    sub = ".".join(target.split(".")[1:3])  # e.g. distributed.utils
    return to in rules or sub in rules


def module_of(path: Path, base: Path) -> str:
    rel = path.relative_to(base).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every torchtitan import in the file; ``from torchtitan.x import y``
    gives ``torchtitan.x.y`` (y may be a module or a name: both are checked by their area)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "torchtitan":
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "torchtitan"]
            out += [(node.lineno, n) for n in names]
    return out


def violations(library: Path = LIBRARY) -> list[str]:
    """One line per import that breaks the rule, ``file:line: what``."""
    found, base = [], library.parent
    for path in sorted(library.rglob("*.py")):
        src, rel = module_of(path, base), path.relative_to(base)
        for line, target in imports(path):
            if target == "torchtitan.models" or target.startswith("torchtitan.models."):
                family = area(target) == "models.family"
                if family and area(src) not in ("models.family", "models.spec"):
                    found.append(f"{rel}:{line}: imports a family ({target})")
                    continue
            if not allowed(src, target):
                found.append(f"{rel}:{line}: {area(src)} imports {area(target)} ({target})")
    return found


def test_every_import_follows_the_package_rule():
    assert violations() == []


@pytest.mark.parametrize(
    "where, line",
    [
        ("torchtitan/models/common/decoder.py", "from torchtitan.train.loss import IGNORE_INDEX"),
        ("torchtitan/data/loader.py", "from torchtitan.optim import optimizers"),
        ("torchtitan/config/schema.py", "import torchtitan.data.batch"),
        ("torchtitan/distributed/pipeline.py", "from torchtitan.models.llama import model"),
        (
            "torchtitan/checkpoint/manager.py",
            "from torchtitan.models.qwen3.model import Qwen3Model",
        ),
    ],
)
def test_a_lower_package_importing_an_upper_one_is_found(tmp_path, where, line):
    """The rule fails when a lower package imports an upper one (the same reader, on a copy of
    one library file with one import added)."""
    copy = tmp_path / "torchtitan" / where.removeprefix("torchtitan/")
    copy.parent.mkdir(parents=True)
    copy.write_text(line + "\n" + (ROOT / where).read_text())
    found = violations(tmp_path / "torchtitan")
    assert len(found) == 1 and found[0].startswith(f"{where}:1: "), found
