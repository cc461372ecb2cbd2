"""LoRA (torchtitan/lora) on one process, against ``peft`` and ``transformers``.

Our model with adapters, the merged export loaded by ``transformers``, and ``peft`` loading our
adapter folder onto the exported base model give the same logits (1e-5), for Llama (its fused
``wqkv`` is three ``peft`` modules, with rotary rows permuted) and Qwen3 (query/key norms,
biases off). The adapters start at zero (the base model's logits), only they train, and a
pattern that matches nothing is one line. The parallel layouts and the checkpoints are in
tests/e2e/test_lora.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_oracle import export, hf_from

from torchtitan.errors import ConfigError
from torchtitan.lora.apply import apply_lora, lora_modules
from torchtitan.lora.export import LoRAExport
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
from torchtitan.models.llama.model import Transformer
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3.model import Qwen3Model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LLAMA = dataclasses.replace(
    llama3_configs["debugmodel"], vocab_size=256, n_layers=2, dim=64, n_heads=4, n_kv_heads=2
)
QWEN3 = dataclasses.replace(qwen3_configs["debugmodel"], vocab_size=256, n_layers=2)
FAMILIES = {
    "llama": (Transformer, LLAMA, LlamaStateDictAdapter, "LlamaForCausalLM"),
    "qwen3": (Qwen3Model, QWEN3, Qwen3StateDictAdapter, "Qwen3ForCausalLM"),
}
SETTINGS = dict(rank=4, alpha=8.0, dropout=0.0)
TARGETS = ["wqkv", "wo", "w1", "w2", "w3"]


def _base(family: str, seed: int = 0) -> torch.nn.Module:
    cls, args, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(args)
    model.init_weights()
    return model.eval()


def _adapted(family: str, trained: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(base, the same weights with adapters)``; ``trained``: random adapters (B not 0)."""
    base = _base(family)
    cls, args, _, _ = FAMILIES[family]
    lora = cls(args)
    apply_lora(lora, target_modules=TARGETS, **SETTINGS)
    lora.load_state_dict(base.state_dict(), strict=False)
    torch.manual_seed(1)
    for m in lora_modules(lora).values():
        m.init_added_parameters()
        if trained:
            torch.nn.init.normal_(m.lora_b, std=0.05)
    return base, lora.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


def test_adapters_start_at_the_base_model():
    base, lora = _adapted("llama", trained=False)
    with torch.no_grad():
        assert torch.equal(base(_tokens()), lora(_tokens()))


def test_only_the_adapters_train():
    _, lora = _adapted("llama")
    lora.train()
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    assert len(trainable) == 2 * 5 * LLAMA.n_layers
    lora(_tokens()).float().pow(2).mean().backward()
    assert all((p.grad is not None) == p.requires_grad for p in lora.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_and_the_merged_export_give_our_logits(tmp_path, family):
    from peft import PeftModel

    _, args, adapter_cls, arch = FAMILIES[family]
    base, lora = _adapted(family)
    tokens = _tokens()
    with torch.no_grad():
        ours = lora(tokens)
    assert (ours - base(tokens)).abs().max() > 1e-3  # the adapters change something
    export(adapter_cls, base, args, tmp_path / "base")
    lx = LoRAExport(**SETTINGS, base_model=str(tmp_path / "base"))
    state = lora.state_dict()
    lx.write_peft(str(tmp_path / "peft"), lx.peft_tensors(state, adapter_cls(args)))
    merged = base.__class__(args)
    merged.load_state_dict(lx.merged(state))
    export(adapter_cls, merged, args, tmp_path / "merged")
    with torch.no_grad():
        theirs_merged = hf_from(tmp_path / "merged", arch)(tokens).logits
        peft_model = PeftModel.from_pretrained(
            hf_from(tmp_path / "base", arch), str(tmp_path / "peft")
        )
        theirs_peft = peft_model.eval()(tokens).logits
    assert (theirs_merged - ours).abs().max() < 1e-5
    assert (theirs_peft - ours).abs().max() < 1e-5
    # peft sees one adapter per transformers module: q, k and v each
    names = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1]
        for n, _ in peft_model.named_parameters()
        if "lora_A" in n
    }
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_patterns_that_match_nothing_are_one_line():
    cls, args, _, _ = FAMILIES["llama"]
    with pytest.raises(
        ConfigError, match=r"^lora.target_modules: \['q_proj'\] match\(es\) no linear layer.*wqkv"
    ):
        apply_lora(cls(args), target_modules=["wqkv", "q_proj"], **SETTINGS)
    model = cls(args)
    summary = apply_lora(model, target_modules=["layers.1.attention.*"], **SETTINGS)
    assert summary.modules == ("layers.1.attention.wqkv", "layers.1.attention.wo")
    assert "LoRA rank 4, alpha 8 on 2 linear layers (wo, wqkv)" in summary.describe(4, 8.0)


def test_a_tied_output_is_refused_and_a_subset_of_layers_exports_only_those(tmp_path):
    from peft import PeftModel

    cls, args, adapter_cls, arch = FAMILIES["llama"]
    tied = dataclasses.replace(args, tie_word_embeddings=True)
    with pytest.raises(
        ConfigError, match=r"^lora.target_modules: output shares its weight with tok_embeddings"
    ):
        apply_lora(cls(tied), target_modules=["output", "wo"], **SETTINGS)
    # adapters on layer 1's attention only: peft adds adapters there and nowhere else
    base = _base("llama")
    lora = cls(args)
    apply_lora(lora, target_modules=["layers.1.attention.*"], **SETTINGS)
    lora.load_state_dict(base.state_dict(), strict=False)
    for m in lora_modules(lora).values():
        m.init_added_parameters()
        torch.nn.init.normal_(m.lora_b, std=0.05)
    export(adapter_cls, base, args, tmp_path / "base")
    lx = LoRAExport(**SETTINGS)
    lx.write_peft(str(tmp_path / "peft"), lx.peft_tensors(lora.state_dict(), adapter_cls(args)))
    peft_model = PeftModel.from_pretrained(hf_from(tmp_path / "base", arch), str(tmp_path / "peft"))
    adapted = {n.split(".lora_A")[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert {a.removeprefix("base_model.model.") for a in adapted} == {
        f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    with torch.no_grad():
        assert (peft_model.eval()(_tokens()).logits - lora.eval()(_tokens())).abs().max() < 1e-5


def test_dropout_applies_to_the_adapters_input_in_training_only():
    from torchtitan.lora.layers import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(16, 8, bias=True, rank=2, alpha=4.0, dropout=0.5)
    for p in (layer.weight, layer.bias, layer.lora_a, layer.lora_b):
        torch.nn.init.normal_(p)
    x = torch.randn(4, 16)
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    full = plain + 2.0 * x @ layer.lora_a.T @ layer.lora_b.T
    layer.eval()
    assert torch.allclose(layer(x), full, atol=1e-5)
    layer.train()
    assert not torch.allclose(layer(x), full, atol=1e-3)
    assert torch.allclose(layer.delta(), 2.0 * layer.lora_b @ layer.lora_a)


def test_a_base_model_holds_the_buffers_and_the_checkpoint_too():
    """The frozen view (what loads from the base) has every entry but the adapters, buffers
    included (an MoE layer's expert biases); the trainable view (what a LoRA checkpoint saves)
    the adapters and the buffers (a resume restores them as they were)."""
    from torchtitan.checkpoint.states import ModelState

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wo = torch.nn.Linear(4, 4, bias=False)
            self.register_buffer("expert_bias", torch.zeros(4))

    model = torch.nn.Module()
    model.block = Block()
    apply_lora(model, target_modules=["wo"], **SETTINGS)
    frozen = ModelState([model], "frozen").state_dict()
    trainable = ModelState([model], "trainable").state_dict()
    assert sorted(frozen) == ["block.expert_bias", "block.wo.weight"]
    assert sorted(trainable) == ["block.expert_bias", "block.wo.lora_a", "block.wo.lora_b"]


def test_loading_a_lora_checkpoint_for_inference_is_one_line(tmp_path):
    """generate.py / lm-eval on a LoRA run's step-N (adapters only): say what to load instead."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.evaluation.inference import load_model

    _, lora = _adapted("llama")
    adapters = {k: v for k, v in lora.state_dict().items() if "lora" in k}
    dcp.save({"model": adapters}, checkpoint_id=str(tmp_path / "step-4"), no_dist=True)
    with pytest.raises(ConfigError, match=r"^--checkpoint: '.*step-4' is a LoRA run's checkpoint"):
        load_model(str(tmp_path / "step-4"), "llama3", "debugmodel")
