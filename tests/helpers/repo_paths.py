"""Where things are in the checkout, for every test tier, and loading its scripts as modules.

The test helpers (this folder) are on the path of every test run (``pythonpath`` in
pyproject.toml): ``from repo_paths import ROOT``. A process a test starts gets them through
``PYTHONPATH`` (``HELPERS``) when it needs them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
ASSETS = ROOT / "tests" / "assets"
TOKENIZER_ASSETS = ASSETS / "tokenizer"
TIKTOKEN_PATH = TOKENIZER_ASSETS / "tiktoken.model"
SENTENCEPIECE_PATH = TOKENIZER_ASSETS / "sentencepiece.model"
UPSTREAM = ASSETS / "upstream_configs"
TOKENIZER = str(TIKTOKEN_PATH)  # the test tokenizer, as a --model.tokenizer_path value
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")


def load_script(name: str, folder: str = "scripts") -> ModuleType:
    """``ROOT/folder/name.py`` imported as a module (not run: its ``main`` is not called)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
