"""What the family tests share when they hold a model of ours against ``transformers``' own."""

from __future__ import annotations

import torch


def greedy_tokens(ours: torch.nn.Module, hf: torch.nn.Module, prompt: torch.Tensor, new: int = 8):
    """``(ours, theirs)``: ``new`` greedy tokens after ``prompt [1, T]``, ours by re-running the
    model on the growing sequence, theirs by ``generate`` with its key-value cache."""
    seq = prompt
    with torch.no_grad():
        for _ in range(new):
            seq = torch.cat([seq, ours(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        theirs = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
    return seq.tolist(), theirs.tolist()


def export(adapter_cls, model: torch.nn.Module, args, folder) -> None:
    """``model`` (with ``args``) as a Hugging Face folder: the family adapter's float32 weights
    and ``config.json``."""
    from torchtitan.checkpoint.hf_files import write_folder

    adapter = adapter_cls(args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    write_folder(str(folder), adapter.to_hf(model.state_dict()), config)


def hf_from(folder, architecture: str) -> torch.nn.Module:
    """``transformers``' model from ``folder`` in float32 with eager attention, checked to be
    ``architecture``, in eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    assert type(model).__name__ == architecture
    return model.eval()
