"""Qwen3-Next against ``transformers``' ``Qwen3NextForCausalLM`` (its PyTorch fallback path) at
tiny random configs: logits and greedy tokens (linear and gated softmax layers, sequences longer
than a DeltaNet chunk, norms, gates and the router far from their init), weights round-trip
exactly through the published layout, the config round-trips, packed documents stay apart, and
the published flavor has the model card's size."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_oracle import export, far_from_init, greedy_tokens, hf_from, logits_gap, round_trip

from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.moe import inactive_params
from torchtitan.models.qwen3_next.flavors import qwen3_next_configs
from torchtitan.models.qwen3_next.hf_adapter import Qwen3NextStateDictAdapter
from torchtitan.models.qwen3_next.model import (
    Qwen3NextModel,
    Qwen3NextModelArgs,
    qwen3_next_moe,
)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# 4 layers (linear, linear, linear, full); DeltaNet chunks of 16 over sequences of 40
TINY = Qwen3NextModelArgs(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=96,
    vocab_size=96,
    max_seq_len=64,
    rope_theta=10_000.0,
    linear_n_key_heads=2,
    linear_n_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_chunk_size=16,
    moe=qwen3_next_moe(num_experts=8, top_k=2, hidden_dim=32, shared_dim=24),
)


def _ours(args: Qwen3NextModelArgs = TINY) -> Qwen3NextModel:
    return far_from_init(Qwen3NextModel, args)


def _tokens(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


def test_transformers_computes_the_same_logits(tmp_path):
    ours = _ours()
    export(Qwen3NextStateDictAdapter, ours, TINY, tmp_path)
    hf = hf_from(tmp_path, "Qwen3NextForCausalLM")
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    tokens = _tokens()
    assert logits_gap(ours, hf, tokens) < 1e-4
    for layer in ours.layers.values():  # the routing is exercised
        assert (layer.moe.tokens_per_expert > 0).sum() >= TINY.moe.num_experts // 2


def test_greedy_generation_matches_transformers(tmp_path):
    """Our model re-run on the growing sequence vs transformers' cached greedy decoding (its
    recurrent DeltaNet state and convolution cache)."""
    ours = _ours()
    export(Qwen3NextStateDictAdapter, ours, TINY, tmp_path)
    hf = hf_from(tmp_path, "Qwen3NextForCausalLM")
    prompt = _tokens(12, seed=2)[:1]
    mine, theirs = greedy_tokens(ours, hf, prompt)
    assert mine == theirs


def test_hf_round_trip_is_exact(tmp_path):
    """transformers' own save (gated q_proj, the convolution in its channel order, one tensor
    per expert, the shared expert and its gate) -> ours -> transformers' names, bit for bit."""
    config = Qwen3NextStateDictAdapter(TINY).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    torch.manual_seed(5)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config))
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    round_trip(Qwen3NextStateDictAdapter(TINY), Qwen3NextModel, TINY, hf_state)


def test_config_round_trip():
    """Our config.json -> our args, and through transformers' config class -> our args."""
    config = Qwen3NextStateDictAdapter(TINY).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
    assert Qwen3NextStateDictAdapter.args_from_hf_config(config) == TINY
    theirs = transformers.Qwen3NextConfig(**config).to_dict()
    assert Qwen3NextStateDictAdapter.args_from_hf_config(theirs) == TINY


def test_packed_documents_do_not_see_each_other():
    """block_causal: each document of a packed row gives the logits it gives alone, through the
    linear layers' state resets and convolution stops and the softmax layer's mask."""
    args = dataclasses.replace(TINY, attn_mask_type="block_causal")
    ours = Qwen3NextModel(args)
    ours.load_state_dict(_ours().state_dict())
    ours.eval()
    tokens = _tokens(40)[:1]
    doc_ids = torch.zeros_like(tokens)
    doc_ids[:, 13:] = 1
    doc_ids[:, 30:] = 2
    with torch.no_grad():
        packed = ours(tokens, doc_ids)
        for lo, hi in ((0, 13), (13, 30), (30, 40)):
            alone = ours(tokens[:, lo:hi])
            assert (packed[:, lo:hi] - alone).abs().max() < 1e-5, (lo, hi)


def test_the_published_flavor_has_the_model_cards_size():
    """80B-A3B: "80B total parameters, 3B activated" (the card; section 8 of the design note:
    79,674,391,296 and 3,874,929,408 with the input embedding, 3,563,764,480 without, computed
    here too, on the meta device), without the checkpoint's prediction depth, which adds
    1,650,471,424 (a gated softmax-attention MoE block, its projection and three norms)."""
    with_depth = qwen3_next_configs["80B-A3B"]
    args = dataclasses.replace(with_depth, num_mtp_layers=0)
    with torch.device("meta"):
        model = Qwen3NextModel(args)
        depth = sum(p.numel() for p in Qwen3NextModel(with_depth).mtp_layers.parameters())
    assert depth == 1_650_471_424
    total = sum(p.numel() for p in model.parameters())
    active = total - inactive_params(model)
    assert total == 79_674_391_296
    assert active == 3_874_929_408
    assert active - args.vocab_size * args.dim == 3_563_764_480
    assert abs(total / 80e9 - 1) < 0.01
    params, flops = get_nparams_and_flops(model, args, seq_len=4096)
    assert params == total and flops > 0


def test_flops_count_the_linear_layers_at_a_cost_that_does_not_grow_with_the_sequence():
    """80B-A3B: 36 linear layers at 6 x 32 heads x (2 C dk + C (dk + dv) / 2 + C dv + 3 dk dv)
    = 15,728,640 FLOPs per token each (C 64, dk = dv = 128), and 12 gated softmax layers (13 with
    the prediction depth's block) at ``6 T n_heads head_dim``; doubling the sequence adds only
    the softmax layers' share."""
    args = qwen3_next_configs["80B-A3B"]
    with torch.device("meta"):
        model = Qwen3NextModel(args)
    per_layer = args.mixer_flops(4096)
    assert per_layer.count(15_728_640) == 36
    assert sorted(set(per_layer)) == [15_728_640, 6 * 4096 * 16 * 256]
    _, at_4k = get_nparams_and_flops(model, args, seq_len=4096)
    _, at_8k = get_nparams_and_flops(model, args, seq_len=8192)
    assert at_8k - at_4k == 13 * 6 * 16 * 256 * 4096


def test_the_prediction_depth_round_trips_under_mtp_and_is_left_out_without_it(tmp_path):
    """A folder as the release ships it: transformers' own save plus one depth under ``mtp.``
    (random tensors of the published names and shapes). With ``num_mtp_layers`` 1 every tensor
    comes in and goes back out bit for bit; with 0 the depth is not loaded (as transformers
    does); the depth trains: its block and projection get gradients from the loss on its
    logits."""
    args = dataclasses.replace(TINY, num_mtp_layers=1)
    config = Qwen3NextStateDictAdapter(args).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    assert config["mtp_num_hidden_layers"] == 1
    assert Qwen3NextStateDictAdapter.args_from_hf_config(config) == args
    torch.manual_seed(5)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config))
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    full_layer = "model.layers.3."  # a full-attention layer: the depth's block is named alike
    for name, w in list(hf_state.items()):
        if name.startswith(full_layer):
            hf_state["mtp.layers.0." + name.removeprefix(full_layer)] = torch.randn_like(w)
    dim = args.dim
    hf_state["mtp.fc.weight"] = torch.randn(dim, 2 * dim)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        hf_state[f"mtp.{norm}.weight"] = torch.randn(dim)

    ours = round_trip(Qwen3NextStateDictAdapter(args), Qwen3NextModel, args, hf_state)
    assert torch.equal(ours["mtp_layers.4.eh_proj.weight"], hf_state["mtp.fc.weight"])

    without = {k: v.shape for k, v in Qwen3NextModel(TINY).state_dict().items()}
    assert Qwen3NextStateDictAdapter(TINY).from_hf(hf_state, without).keys() == without.keys()

    model = Qwen3NextModel(args)
    model.load_state_dict(ours)
    model.mtp_active = True
    logits = model(_tokens(20))
    assert logits.shape == (4, 20, TINY.vocab_size)  # the main batch and the depth's, stacked
    logits[2:].sum().backward()
    depth = model.mtp_layers["4"]
    assert depth.eh_proj.weight.grad.abs().sum() > 0
    assert depth.block.attention.wqkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["--parallelism.tensor_parallel_degree", "2", "--model.n_layers", "2"], None),
        (["--parallelism.context_parallel_degree", "8", "--training.seq_len", "32"], "cp"),
    ],
)
def test_preflight_names_what_linear_attention_cannot_split(overrides, key):
    """TP must divide the linear layers' key heads (a custom flavor with 1 key head and TP 2
    would cut a head group apart); CP chunks must hold the convolution's 3 positions of reach."""
    from repo_paths import ROOT

    from torchtitan.config.parse import parse_args
    from torchtitan.errors import ConfigError
    from torchtitan.models import spec as specs
    from torchtitan.train.plan import plan_job

    config = str(ROOT / "train_configs" / "qwen3_next_debug.toml")
    cfg = parse_args(["--job.config_file", config, *overrides])
    world = 2 if key is None else 8
    if key is None:  # a flavor whose linear layers have a single key head
        flavor = dataclasses.replace(
            qwen3_next_configs["debugmodel"], linear_n_key_heads=1, linear_n_value_heads=4
        )
        spec = specs.get_model_spec("qwen3_next")
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(spec.flavors, "debugmodel", flavor)
            with pytest.raises(ConfigError) as e:
                plan_job(cfg, world_size=world)
        assert "parallelism.tensor_parallel_degree: 2 does not divide the model's " in str(e.value)
        assert "linear_n_key_heads (1)" in str(e.value)
    else:
        with pytest.raises(ConfigError) as e:
            plan_job(cfg, world_size=world)
        assert "chunks of 2 positions, shorter than the model's convolution reads back (3)" in (
            str(e.value)
        )


def test_gated_attention_halves_the_heads_output_when_the_gates_are_zero():
    """``GroupedQueryAttention(gated=True)`` on its own forward: with the gate rows of ``wqkv``
    zero every head's output is scaled by sigmoid(0) = 1/2 before ``wo`` (``wo`` has no bias), so
    the result is half the ungated attention's on the same query, key and value rows."""
    from torchtitan.models.common import rope
    from torchtitan.models.common.blocks import GroupedQueryAttention

    torch.manual_seed(0)
    gated = GroupedQueryAttention(32, 4, 2, 8, rope.apply_half_split, gated=True)
    plain = GroupedQueryAttention(32, 4, 2, 8, rope.apply_half_split)
    with torch.no_grad():
        rows = gated.wqkv.weight.view(2, 2 * 2 + 2, 8, 32)  # [groups, 2 r + 2, D, dim]
        rows[:, 1:4:2] = 0  # each query head's gate rows
        plain.wqkv.weight.copy_(torch.cat([rows[:, 0:4:2], rows[:, 4:]], dim=1).flatten(0, 2))
        plain.wo.weight.copy_(gated.wo.weight)
    table = rope.half_split_table(rope.angles(rope.inv_freqs(8, 10_000.0), 16))
    x = torch.randn(2, 10, 32)
    assert torch.allclose(gated(x, table), plain(x, table) / 2, atol=1e-6)
