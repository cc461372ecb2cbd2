"""Qwen3.5's language models against ``transformers``' ``Qwen3_5ForCausalLM`` and
``Qwen3_5MoeForCausalLM`` (their PyTorch fallback paths) at tiny random configs, dense and MoE:
logits, greedy tokens, an exact weight round trip through the separate (ungrouped) DeltaNet
projections, the config both ways, an import from a multimodal ``Qwen3_5ForConditionalGeneration``
folder (its text weights; the vision encoder left), and every published size's parameter count
equal to ``transformers``' own text model of that config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_oracle import export, far_from_init, greedy_tokens, hf_from, logits_gap, round_trip

from torchtitan.models.common.moe import inactive_params
from torchtitan.models.qwen3_5.flavors import qwen3_5_configs
from torchtitan.models.qwen3_5.hf_adapter import Qwen3_5StateDictAdapter
from torchtitan.models.qwen3_next.model import Qwen3NextModel, qwen3_next_moe
from torchtitan.models.spec import spec_for_hf_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers.models.qwen3_5")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# 4 layers (linear x3, full); two key heads of three value heads each (r = 3, so a regrouping
# that mixed heads up would show); DeltaNet chunks of 16 over sequences of 40
DENSE = dataclasses.replace(
    qwen3_5_configs["debugmodel"],
    dim=64,
    full_attention_interval=4,
    head_dim=16,
    hidden_dim=96,
    vocab_size=96,
    max_seq_len=64,
    linear_n_key_heads=2,
    linear_n_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_chunk_size=16,
)
MOE = dataclasses.replace(
    DENSE, hidden_dim=32, moe=qwen3_next_moe(num_experts=8, top_k=2, hidden_dim=32, shared_dim=24)
)
CASES = {"dense": (DENSE, "Qwen3_5ForCausalLM"), "moe": (MOE, "Qwen3_5MoeForCausalLM")}


def _tokens(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, DENSE.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_transformers_computes_the_same_logits_and_greedy_tokens(tmp_path, case):
    args, architecture = CASES[case]
    ours = far_from_init(Qwen3NextModel, args)
    export(Qwen3_5StateDictAdapter, ours, args, tmp_path)
    hf = hf_from(tmp_path, architecture)
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    tokens = _tokens()
    assert logits_gap(ours, hf, tokens) < 1e-4
    mine, theirs = greedy_tokens(ours, hf, _tokens(12, seed=2)[:1])
    assert mine == theirs


@pytest.mark.parametrize("case", CASES)
def test_hf_round_trip_is_exact(tmp_path, case):
    """transformers' own save (separate in_proj_qkv/z/b/a, the convolution in its channel order,
    one tensor per expert) -> ours -> transformers' names, bit for bit; and the config both ways,
    also through transformers' config class."""
    args, architecture = CASES[case]
    adapter = Qwen3_5StateDictAdapter(args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    assert Qwen3_5StateDictAdapter.args_from_hf_config(config) == args
    theirs = transformers.AutoConfig.for_model(**config)
    assert Qwen3_5StateDictAdapter.args_from_hf_config(theirs.to_dict()) == args
    torch.manual_seed(5)
    hf = getattr(transformers, architecture)(theirs)
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    assert any(".linear_attn.in_proj_qkv." in k for k in hf_state)
    round_trip(adapter, Qwen3NextModel, args, hf_state)


def test_a_multimodal_folder_gives_its_language_model(tmp_path):
    """The published layout: ``Qwen3_5ForConditionalGeneration`` (a tiny vision encoder next to
    the language model, ``text_config`` in config.json). The folder resolves to this family,
    the text weights load (the vision encoder's are left), and the model computes the logits
    transformers' multimodal model computes on text."""
    text = Qwen3_5StateDictAdapter(DENSE).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(7)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in hf_state)
    assert any(k.startswith("model.language_model.layers.") for k in hf_state)

    folder_config = config.to_dict()
    assert spec_for_hf_config(folder_config, "test").name == "qwen3_5"
    args = Qwen3_5StateDictAdapter.args_from_hf_config(folder_config)
    assert args == DENSE
    expected = {k: v.shape for k, v in Qwen3NextModel(args).state_dict().items()}
    ours = Qwen3NextModel(args)
    ours.load_state_dict(Qwen3_5StateDictAdapter(args).from_hf(hf_state, expected))
    tokens = _tokens()
    with torch.no_grad():
        assert (hf(tokens).logits - ours.eval()(tokens)).abs().max().item() < 1e-4

    # the release's prediction depth, top-level mtp.* (random tensors of the published names
    # and shapes; its block a full-attention layer with the dense feed-forward): loaded with
    # num_mtp_layers 1, and exported under the same names
    full_layer = "model.language_model.layers.3."
    for name, w in list(hf_state.items()):
        if name.startswith(full_layer):
            hf_state["mtp.layers.0." + name.removeprefix(full_layer)] = torch.randn_like(w)
    hf_state["mtp.fc.weight"] = torch.randn(args.dim, 2 * args.dim)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        hf_state[f"mtp.{norm}.weight"] = torch.randn(args.dim)
    depth = dataclasses.replace(args, num_mtp_layers=1)
    expected = {k: v.shape for k, v in Qwen3NextModel(depth).state_dict().items()}
    loaded = Qwen3_5StateDictAdapter(depth).from_hf(hf_state, expected)
    assert loaded.keys() == expected.keys()
    back = Qwen3_5StateDictAdapter(depth).to_hf(loaded)
    mtp = [k for k in hf_state if k.startswith("mtp.")]
    assert "mtp.layers.0.mlp.down_proj.weight" in mtp
    for k in mtp:
        assert torch.equal(back[k], hf_state[k]), k


# the published vision encoders (hidden, feed-forward, depth, heads), the vision_config of each
# config.json as upstream torchtitan's models/qwen3_5/flavors.py transcribes them: counted here
# with transformers' Qwen3_5VisionModel to set the text totals beside the names, which count both
VISION = {"0.8B": (768, 3072, 12, 12), "2B": (1024, 4096, 24, 16), "4B": (1024, 4096, 24, 16)}
VISION_DEFAULT = (1152, 4304, 27, 16)


def _as_printed(count: int, name: str) -> bool:
    """``count`` shown as the name shows it ("0.8", "397"): rounded or cut to its decimals."""
    decimals = len(name.split(".")[1]) if "." in name else 0
    billions = count / 1e9
    cut = int(billions * 10**decimals) / 10**decimals
    return name in {f"{billions:.{decimals}f}", f"{cut:.{decimals}f}"}


def test_the_published_sizes_are_transformers_text_models():
    """Each published size has, on the meta device, exactly the parameters of ``transformers``'
    text model of the same config (ours -> config.json -> their class). The names round: with
    the vision encoder each total is its name at the name's precision (0.8B: 0.853B cut to
    0.8), and so is each MoE size's active count (the text model's: 3.45B, 9.77B, 17.3B)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    rows = []
    for flavor, with_depth in qwen3_5_configs.items():
        if flavor.startswith("debug"):
            continue
        assert with_depth.num_mtp_layers == 1, flavor  # the checkpoints' mtp.*
        args = dataclasses.replace(with_depth, num_mtp_layers=0)  # as transformers builds it
        config = Qwen3_5StateDictAdapter(args).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
        hidden, ffn, depth, heads = VISION.get(flavor, VISION_DEFAULT)
        vision_config = transformers.Qwen3_5VisionConfig(
            hidden_size=hidden,
            intermediate_size=ffn,
            depth=depth,
            num_heads=heads,
            out_hidden_size=args.dim,
        )
        with torch.device("meta"):
            ours = Qwen3NextModel(args)
            theirs = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**config)
            )
            vision = sum(p.numel() for p in Qwen3_5VisionModel(vision_config).parameters())
        total = sum(p.numel() for p in ours.parameters())
        assert total == sum(p.numel() for p in theirs.parameters()), flavor
        rows.append(f"{flavor}: text {total:,}, with vision {total + vision:,}")
        assert _as_printed(total + vision, flavor.split("-")[0].removesuffix("B")), rows[-1]
        if args.moe is not None:
            active = total - inactive_params(ours)
            rows[-1] += f", active {active:,}"
            assert _as_printed(active, flavor.split("-A")[1].removesuffix("B")), rows[-1]
    print("\n".join(rows))
