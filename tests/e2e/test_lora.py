"""LoRA fine-tuning through training runs (real gloo processes in the warm pool): from a Hugging
Face folder's weights, on conversations, the debug Llama with adapters on every attention and
feed-forward linear.

- FSDP2, TP2 and PP2 give the losses of one process (1e-4, the layout suites' bar);
- checkpoints hold the adapters and their optimizer state only, and a resume (base from the
  folder again, adapters from the checkpoint) gives the losses of an unbroken run;
- the end-of-run exports agree: our model (the folder's weights plus the checkpoint's adapters),
  ``transformers`` on the merged export, and ``peft`` loading the adapter folder onto the base
  give the same logits (1e-5).
The math against ``peft`` on one process is in tests/unit/lora/test_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_data import chat_model_folder, conversation, write_conversations
from launcher import PP2_1F1B, pooled, tensorboard_scalars, tensorboard_scalars_all_runs

STEPS = 4
LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, PP2_1F1B),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A Hub-like debug Llama folder with a ChatML tokenizer and chat template."""
    return chat_model_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chats")
    return write_conversations(folder / "chat.jsonl", [conversation(i) for i in range(32)])


def _args(base: Path, chats: Path, steps: int = STEPS, *extra: str) -> list[str]:
    return [
        "--model.hf_assets_path",
        str(base),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--lora.enable",
        "--lora.rank",
        "4",
        "--training.dataset_path",
        str(chats),
        "--model.attn_mask_type",
        "block_causal",
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        str(steps),
        "--optimizer.lr",
        "1e-2",  # adapters of a tiny model: a large step, so that they move
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.decay_ratio",
        "0",
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "42",
        "--debug.deterministic",
        *extra,
    ]


@pytest.fixture(scope="module")
def one_process(pools, tmp_path_factory, base, chats) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("lora-one")
    out = pooled(pools, tmp, *_args(base, chats))
    assert "LoRA rank 4, alpha 16 on 30 linear layers (w1, w2, w3, wo, wqkv)" in out.stdout
    losses = tensorboard_scalars(tmp / "out")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.1  # the adapters learn
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_give_one_process_losses(pools, tmp_path, base, chats, one_process, layout):
    ngpu, extra = LAYOUTS[layout]
    pooled(pools, tmp_path, *_args(base, chats, STEPS, *extra), ngpu=ngpu)
    losses = tensorboard_scalars(tmp_path / "out")
    for step in range(1, STEPS + 1):
        assert abs(losses[step] - one_process[step]) <= 1e-4, (step, losses, one_process)


def _dcp_keys(folder: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.mark.slow
def test_checkpoints_hold_adapters_resume_exactly_and_exports_agree(
    pools, tmp_path, base, chats, one_process
):
    half = STEPS // 2
    pooled(pools, tmp_path, *_args(base, chats, half, "--checkpoint.interval", str(half)))
    out = pooled(pools, tmp_path, *_args(base, chats, STEPS, "--checkpoint.last_save_in_hf"))
    assert f"Loaded Hugging Face weights from {base}" in out.stdout  # the base, again
    assert f"(step {half})" in out.stdout
    resumed = tensorboard_scalars_all_runs(tmp_path / "out")
    for step in range(1, STEPS + 1):
        assert abs(resumed[step] - one_process[step]) <= 1e-6, (step, resumed, one_process)

    folder = tmp_path / "out" / "checkpoint"
    keys = _dcp_keys(folder / f"step-{STEPS}")
    model = {k for k in keys if k.startswith("model.")}
    assert len(model) == 2 * 30 and all(k.endswith((".lora_a", ".lora_b")) for k in model)
    optim = {k for k in keys if k.startswith("optimizer.state.")}
    assert optim and all(".lora_a." in k or ".lora_b." in k for k in optim)
    _exports_agree(base, folder, STEPS)


def _exports_agree(base: Path, folder: Path, step: int) -> None:
    """Ours (base weights + the checkpoint's adapters), transformers on the merged export, peft
    on the adapter folder: the same logits."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from peft import PeftModel

    from torchtitan.checkpoint.hf_files import read_folder
    from torchtitan.lora.apply import apply_lora
    from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
    from torchtitan.models.llama.model import Transformer

    config = json.loads((folder / f"step-{step}-peft" / "adapter_config.json").read_text())
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 16
        and config["base_model_name_or_path"] == str(base)
    )
    hf_args = LlamaStateDictAdapter.args_from_hf_config(
        json.loads((base / "config.json").read_text())
    )
    ours = Transformer(hf_args)
    apply_lora(
        ours, rank=4, alpha=16.0, dropout=0.0, target_modules=["wqkv", "wo", "w1", "w2", "w3"]
    )
    expected = {k: v.shape for k, v in ours.state_dict().items() if "lora" not in k}
    ours.load_state_dict(
        LlamaStateDictAdapter(hf_args).from_hf(read_folder(str(base)), expected), strict=False
    )
    adapters = {k: v for k, v in ours.state_dict().items() if "lora" in k}
    dcp.load({"model": adapters}, checkpoint_id=str(folder / f"step-{step}"))
    ours.load_state_dict(adapters, strict=False)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if k.endswith("lora_b"))
    tokens = torch.randint(
        0, hf_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )

    def hf(path: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()

    with torch.no_grad():
        mine = ours.eval()(tokens)
        merged = hf(folder / f"step-{step}-hf")(tokens).logits
        peft = (
            PeftModel.from_pretrained(hf(base), str(folder / f"step-{step}-peft"))
            .eval()(tokens)
            .logits
        )
    assert (merged - mine).abs().max() < 1e-5
    assert (peft - mine).abs().max() < 1e-5
