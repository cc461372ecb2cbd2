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


def far_from_init(model_cls, args) -> torch.nn.Module:
    """``model_cls(args)`` initialized (seed 0), then moved where its init would hide a mistake:
    norms uniform in [-0.5, 0.5] (zero-centered ones far from 0, plain ones far from 1), routers
    and gates N(0, 1), expert weights N(0, 0.1); in eval mode."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif "router" in name or "shared_gate" in name:
                p.normal_(0, 1)
            elif "experts.w" in name:
                p.normal_(0, 0.1)
    return model.eval()


def round_trip(adapter, model_cls, args, hf_state: dict[str, torch.Tensor]) -> dict:
    """``hf_state`` through ``adapter`` as exactly the parameters of ``model_cls(args)``, and
    back to ``transformers``' names bit for bit; ours, for further checks."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in model_cls(args).state_dict().items()}
    ours = adapter.from_hf(hf_state, expected)
    assert ours.keys() == expected.keys()
    back = adapter.to_hf(ours)
    assert back.keys() == hf_state.keys()
    for k in hf_state:
        assert torch.equal(back[k], hf_state[k]), k
    return ours


def logits_gap(ours: torch.nn.Module, hf: torch.nn.Module, tokens: torch.Tensor) -> float:
    """The largest difference between our logits and ``transformers``' on ``tokens`` (the
    shapes checked equal)."""
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(tokens).logits.float()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return (got - expected).abs().max().item()
