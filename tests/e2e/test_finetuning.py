"""Chat fine-tuning through training runs (real processes): a Hugging Face folder's weights,
conversations rendered with the folder's chat template and mixed with pretraining text, packed
block-causally, shuffled, checkpointed and resumed exactly. The rendering, the labels and the
packed-equals-unpacked proof are in tests/unit/data/test_chat.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_data import chat_model_folder, conversation, write_conversations
from launcher import pooled, tensorboard_scalars_all_runs


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A Hub-like debug Llama folder whose tokenizer has ChatML tokens and a chat template."""
    return chat_model_folder(tmp_path_factory)


def _args(folder: Path, data: Path, steps: int) -> list[str]:
    mixture = [
        {"path": str(data), "weight": 0.75, "name": "chat"},
        {"dataset": "python_docs", "weight": 0.25},
    ]
    return [
        "--model.hf_assets_path",
        str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.interval",
        "3",
        "--training.datasets",
        json.dumps(mixture),
        "--model.attn_mask_type",
        "block_causal",
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        "4",
        "--training.steps",
        str(steps),
        "--lr_scheduler.warmup_steps",  # within the shorter run: both follow one schedule
        "3",
        "--lr_scheduler.decay_ratio",
        "0",
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "42",
        "--debug.deterministic",
    ]


@pytest.mark.slow
def test_chat_finetuning_from_a_hf_folder_resumes_exactly(pools, tmp_path, chat_model):
    """6 steps in one go, and 3 steps then a resume to 6, give the same losses; both start from
    the folder's weights, and the resumed run from its own checkpoint."""
    data = write_conversations(tmp_path / "chat.jsonl", [conversation(i) for i in range(40)])
    out = pooled(pools, tmp_path / "unbroken", *_args(chat_model, data, 6))
    assert f"Loaded Hugging Face weights from {chat_model}" in out.stdout
    assert "chat: weight 0.75" in out.stdout and "text field 'messages'" in out.stdout
    assert f"Conversations rendered with the chat template {chat_model}" in out.stdout
    unbroken = tensorboard_scalars_all_runs(tmp_path / "unbroken" / "out")
    pooled(pools, tmp_path / "resumed", *_args(chat_model, data, 3))
    out = pooled(pools, tmp_path / "resumed", *_args(chat_model, data, 6))
    assert "Loaded training state from" in out.stdout and "(step 3)" in out.stdout
    resumed = tensorboard_scalars_all_runs(tmp_path / "resumed" / "out")
    assert sorted(resumed) == sorted(unbroken) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(resumed[step] - unbroken[step]) <= 1e-6, (step, resumed[step], unbroken[step])
