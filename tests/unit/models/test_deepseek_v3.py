"""The DeepSeek-V3 decoder against ``transformers``' ``DeepseekV3ForCausalLM`` on the same random
weights (tiny configs): dense and MoE layers, q-LoRA or not, YaRN or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs

VOCAB, DIM, LAYERS, EXPERTS, EXPERT_DIM = 64, 32, 3, 8, 8


def _configs(q_lora_rank: int, yarn: bool) -> tuple[DeepseekV3Config, DeepSeekV3ModelArgs]:
    scaling = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    }
    theirs = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=48,
        moe_intermediate_size=EXPERT_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=EXPERTS,
        routed_scaling_factor=2.5,
        kv_lora_rank=12,
        q_lora_rank=q_lora_rank or None,
        qk_rope_head_dim=6,
        v_head_dim=10,
        qk_nope_head_dim=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_scaling=scaling if yarn else None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    ours = DeepSeekV3ModelArgs(
        dim=DIM,
        n_layers=LAYERS,
        n_heads=4,
        hidden_dim=48,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        vocab_size=VOCAB,
        norm_eps=1e-5,
        rope_theta=10000.0,
        rope_factor=8.0 if yarn else 1.0,
        rope_original_seq_len=16,
        rope_mscale=0.707,
        max_seq_len=128,
        moe=MoEArgs(
            num_experts=EXPERTS,
            top_k=3,
            hidden_dim=EXPERT_DIM,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            shared_hidden_dim=EXPERT_DIM,
            num_groups=4,
            topk_groups=2,
            first_dense=1,
            load_balance_coeff=1e-3,
        ),
    )
    return theirs, ours


def _their_weights_as_ours(hf: DeepseekV3ForCausalLM, q_lora_rank: int) -> dict:
    """The test's own name map (the family's adapter will own this)."""
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    out = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    attn = {
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
        **({"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"}),
    }
    if not q_lora_rank:
        attn = {k: v for k, v in attn.items() if k not in ("wq_a", "q_norm", "wq_b")}
        attn["wq"] = "q_proj"
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for ours, theirs in attn.items():
            out[f"layers.{i}.attention.{ours}.weight"] = sd[f"{p}self_attn.{theirs}.weight"]
        mlp = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        if i == 0:
            for ours, theirs in mlp.items():
                out[f"layers.{i}.feed_forward.{ours}.weight"] = sd[f"{p}mlp.{theirs}.weight"]
            continue
        gate_up = sd[p + "mlp.experts.gate_up_proj"]
        out[f"layers.{i}.moe.experts.w1"] = gate_up[:, :EXPERT_DIM]
        out[f"layers.{i}.moe.experts.w3"] = gate_up[:, EXPERT_DIM:]
        out[f"layers.{i}.moe.experts.w2"] = sd[p + "mlp.experts.down_proj"]
        out[f"layers.{i}.moe.router.gate.weight"] = sd[p + "mlp.gate.weight"]
        out[f"layers.{i}.moe.expert_bias"] = sd[p + "mlp.gate.e_score_correction_bias"]
        for ours, theirs in mlp.items():
            out[f"layers.{i}.moe.shared_experts.{ours}.weight"] = sd[
                f"{p}mlp.shared_experts.{theirs}.weight"
            ]
    return out


@pytest.mark.parametrize("q_lora_rank", [0, 16], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_logits_match_transformers(q_lora_rank, yarn):
    their_config, args = _configs(q_lora_rank, yarn)
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(their_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.2 if p.ndim > 1 else 0.3)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    ours = DeepSeekV3Model(args)
    ours.init_weights()
    missing = ours.load_state_dict(_their_weights_as_ours(hf, q_lora_rank), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    tokens = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        want = hf(tokens).logits.float()
        got = ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # greedy continuation, token for token
    prompt = tokens[:1, :8]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False)
        seq = prompt
        for _ in range(12):
            seq = torch.cat([seq, ours(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(seq, theirs)


def _counts(flavor: str) -> tuple[float, float, tuple[float, float]]:
    """(total, active, (embedding, output)) parameters of a flavor's main model (its multi-token
    prediction left out), in billions (meta device)."""
    from torchtitan.models.common.moe import inactive_params
    from torchtitan.models.deepseek_v3.flavors import deepseek_v3_configs

    args = dataclasses.replace(deepseek_v3_configs[flavor], num_mtp_layers=0)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    total = sum(p.numel() for p in model.parameters())
    ends = (model.tok_embeddings.weight.numel() / 1e9, model.output.weight.numel() / 1e9)
    return total / 1e9, (total - inactive_params(model)) / 1e9, ends


def test_671b_with_its_mtp_module_counts_as_published():
    """DeepSeek-V3 README: 685B on the Hub, 671B of the main model and 14B of the MTP module,
    whose checkpoint layer keeps its own copies of the embedding and output head (this model
    shares the main ones: counted once, plus the copies for the published figure)."""
    from torchtitan.models.deepseek_v3.flavors import deepseek_v3_configs

    args = deepseek_v3_configs["671B"]
    assert args.num_mtp_layers == 1
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    total = sum(p.numel() for p in model.parameters())
    copies = model.tok_embeddings.weight.numel() + model.output.weight.numel()
    mtp = sum(p.numel() for p in model.mtp_layers.parameters())
    assert abs((total + copies) / 1e9 - 685) <= 0.01 * 685
    assert abs((mtp + copies) / 1e9 - 14) <= 0.05 * 14  # "14B": two significant digits
    assert abs((total - mtp) / 1e9 - 671) <= 0.01 * 671
    # README_WEIGHTS: the MTP module has "11.5B unique parameters" and "1.5B" activated with the
    # 0.9B output head; both are the depth without its eh_proj (0.10B; with it 11.6 and 1.6)
    from torchtitan.models.common.moe import inactive_params

    (depth,) = model.mtp_layers.values()
    unique = mtp - depth.eh_proj.weight.numel()
    assert round(unique / 1e9, 1) == 11.5
    active = unique - inactive_params(depth) + model.output.weight.numel()
    assert round(active / 1e9, 1) == 1.5


# Published counts, each to the precision it was published with. DeepSeek counts activated
# parameters without the input embedding (a table lookup) and with the output head: README_WEIGHTS
# gives V3's main model 36.6B "including 0.9B for the output Head", which is ours less the 0.93B
# embedding to the digit (36.63), and the same reading gives V2's 21B (20.85; with the embedding
# 21.38) and Kimi K2's 32B (31.69; the "32.6B" quoted for K2's report is from secondary sources
# only). Moonlight's README counts both ends out.
@pytest.mark.parametrize(
    "flavor, total, active, ends_out, digits",
    [
        # Moonlight README: 15.29B total and 2.24B activated, embeddings excluded
        ("16B", 15.29, 2.24, ("embedding", "output"), 2),
        # DeepSeek-V2 README: 236B total, 21B activated
        ("236B", 236, 21, ("embedding",), 0),
        # DeepSeek-V3 README_WEIGHTS: main model 671B total, 36.6B activated (README: 37B)
        ("671B", 671, 36.6, ("embedding",), 1),
        # Kimi K2 README and report abstract: 1 trillion total, 32 billion activated
        ("kimi_k2", 1000, 32, ("embedding",), 0),
    ],
)
def test_published_parameter_counts(flavor, total, active, ends_out, digits):
    got_total, got_active, ends = _counts(flavor)
    embedding, output = ends
    out = (embedding if "embedding" in ends_out else 0) + (output if "output" in ends_out else 0)
    got_active -= out
    if "output" in ends_out:  # Moonlight leaves both ends out of its total as well
        got_total -= out
    if total >= 1000:  # published in trillions
        assert round(got_total / 1000, digits) == total / 1000, (flavor, got_total)
    else:
        assert round(got_total, digits) == total, (flavor, got_total)
    assert round(got_active, digits) == active, (flavor, got_active)


def _trained_like(args: DeepSeekV3ModelArgs) -> DeepSeekV3Model:
    """Our model with norms away from one and a non-zero routing bias, so that every tensor's
    place matters."""
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if "router" in name:
                p.mul_(20)
        for layer in model.layers.values():
            if layer.moe is not None:
                layer.moe.expert_bias.normal_(std=0.1)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [0, 16], ids=["q_proj", "q_lora"])
def test_export_loads_in_transformers_and_round_trips(q_lora_rank, tmp_path):
    """Our export as a folder that ``transformers`` loads itself (same logits), its own save
    read back bit for bit, and config.json round-tripped to the same hyper-parameters."""
    from transformers import AutoModelForCausalLM

    from torchtitan.checkpoint.hf_files import read_folder, write_folder
    from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter

    _, args = _configs(q_lora_rank, yarn=True)
    ours = _trained_like(args)
    adapter = DeepSeekV3StateDictAdapter(args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    assert DeepSeekV3StateDictAdapter.args_from_hf_config(config) == args
    write_folder(str(tmp_path / "ours"), adapter.to_hf(ours.state_dict()), config)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits.float(), rtol=1e-5, atol=1e-5)
    hf.save_pretrained(str(tmp_path / "theirs"))
    expected = {k: v.shape for k, v in ours.state_dict().items()}
    back = adapter.from_hf(read_folder(str(tmp_path / "theirs")), expected)
    mine = ours.state_dict()
    assert sorted(back) == sorted(mine)
    assert all(torch.equal(back[k], mine[k]) for k in mine)


def test_unsupported_configs_are_named():
    from torchtitan.errors import HFFormatError
    from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter

    _, args = _configs(16, yarn=False)
    config = DeepSeekV3StateDictAdapter(args).hf_config(
        dtype=torch.float32, bos_id=None, eos_id=None
    )
    for bad, words in (
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"rope_interleave": False}, "rope_interleave false"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ):
        with pytest.raises(HFFormatError, match=words):
            DeepSeekV3StateDictAdapter.args_from_hf_config({**config, **bad})
    with pytest.raises(HFFormatError, match="not a DeepSeek-V3 config"):
        DeepSeekV3StateDictAdapter.args_from_hf_config(
            {k: v for k, v in config.items() if k != "kv_lora_rank"}
        )


@pytest.mark.parametrize(
    "key, words",
    [
        ("tensor_parallel_degree", "multi-token prediction \\(model.num_mtp_layers: 1\\) has no"),
        ("context_parallel_degree", "multi-token prediction \\(model.num_mtp_layers: 1\\) reads"),
    ],
)
def test_layouts_without_mtp_support_are_refused_in_one_line(key, words):
    from torchtitan.config.parse import parse_args
    from torchtitan.errors import ConfigError
    from torchtitan.train.plan import plan_job

    job = parse_args(
        ["--job.config_file", "train_configs/deepseek_v3_debug.toml", f"--parallelism.{key}", "2"]
    )
    with pytest.raises(ConfigError, match=f"parallelism.{key}: 2, but {words}"):
        plan_job(job, world_size=2)
