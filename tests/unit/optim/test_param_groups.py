"""Parameter groups: which parameters of each family decay, rules with their own learning-rate
multiplier and weight decay, and the one-line errors. Fast, one process (the model on meta, or a
tiny one on CPU for the optimizer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.errors import ConfigError
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer
from torchtitan.models.llama4.flavors import llama4_configs
from torchtitan.models.llama4.model import Llama4Model
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.optim.optimizers import build_optimizer
from torchtitan.optim.param_groups import (
    categories,
    check_and_log,
    clean_name,
    parse_rules,
    plan_groups,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _meta(cls, configs, **overrides):
    args = dataclasses.replace(configs["debugmodel"], vocab_size=256, **overrides)
    with torch.device("meta"):
        return cls(args)


def _kinds(model) -> dict[str | None, set[str]]:
    """``{category: {name with layer numbers as N}}``."""
    out: dict[str | None, set[str]] = {}
    for name, kind in categories(model).items():
        out.setdefault(kind, set()).add(
            ".".join("N" if p.isdigit() else p for p in name.split("."))
        )
    return out


def test_llama3_norms_embeddings_and_output_are_told_apart():
    kinds = _kinds(_meta(Transformer, llama3_configs))
    assert kinds["embeddings"] == {"tok_embeddings.weight"}
    assert kinds["output"] == {"output.weight"}
    assert kinds["norms"] == {
        "layers.N.attention_norm.weight",
        "layers.N.ffn_norm.weight",
        "norm.weight",
    }
    assert kinds[None] == {
        "layers.N.attention.wqkv.weight",
        "layers.N.attention.wo.weight",
        "layers.N.feed_forward.w1.weight",
        "layers.N.feed_forward.w2.weight",
        "layers.N.feed_forward.w3.weight",
    }
    assert "biases" not in kinds


def test_qwen3_qk_norms_are_norms_and_a_tied_output_is_the_embedding():
    kinds = _kinds(_meta(Qwen3Model, qwen3_configs))
    assert {"layers.N.attention.q_norm.weight", "layers.N.attention.k_norm.weight"} <= kinds[
        "norms"
    ]
    assert kinds["embeddings"] == {"tok_embeddings.weight"}  # output.weight is the same tensor
    assert "output" not in kinds


def test_moe_experts_and_router_decay_like_other_matrices():
    kinds = _kinds(_meta(Llama4Model, llama4_configs))
    assert {
        "layers.N.moe.experts.w1",
        "layers.N.moe.experts.w2",
        "layers.N.moe.experts.w3",
        "layers.N.moe.router.gate.weight",
    } <= kinds[None]
    assert kinds["output"] == {"output.weight"}


def test_wrapper_names_are_taken_out():
    assert clean_name("layers.0._orig_mod._checkpoint_wrapped_module.attention.wo.weight") == (
        "layers.0.attention.wo.weight"
    )


def test_default_groups_exempt_norms_and_embeddings_but_not_the_output():
    model = _meta(Transformer, llama3_configs)
    groups, hits = plan_groups(model, 0.1, ["norms", "biases", "embeddings"], [])
    assert [g.label for g in groups] == ["weight decay 0.1", "weight decay 0"]
    decay, no_decay = groups
    assert "output.weight" in decay.names and "tok_embeddings.weight" in no_decay.names
    assert all(n.endswith("norm.weight") for n in no_decay.names if n != "tok_embeddings.weight")
    assert hits == []
    groups, _ = plan_groups(model, 0.1, ["norms", "biases", "embeddings", "output"], [])
    assert "output.weight" in groups[1].names
    groups, _ = plan_groups(model, 0.1, [], [])  # the old behaviour: everything decays
    assert [g.label for g in groups] == ["weight decay 0.1"]


def test_rules_set_lr_multipliers_and_weight_decay_and_count_their_matches():
    model = _meta(Transformer, llama3_configs)
    rules = parse_rules(
        [
            {"match": "layers.*.attention.*", "lr_multiplier": 0.5},
            {"match": "output.weight", "weight_decay": 0.0},
            {"match": "layers.*.attention.wo.weight", "lr_multiplier": 0.5},
        ]
    )
    groups, hits = plan_groups(model, 0.1, ["norms", "biases", "embeddings"], rules)
    n_layers = len(model.layers)
    by_label = {g.label: g for g in groups}
    assert sorted(by_label) == ["weight decay 0", "weight decay 0.1", "weight decay 0.1, lr x0.5"]
    assert groups[0].label == "weight decay 0.1"  # the configured settings lead (its lr is logged)
    assert len(by_label["weight decay 0.1, lr x0.5"].names) == 2 * n_layers  # wqkv and wo
    assert "output.weight" in by_label["weight decay 0"].names
    assert hits == [2 * n_layers, 1, n_layers]  # attention_norm is not under attention.


def test_conflicting_rules_are_one_line_naming_both():
    model = _meta(Transformer, llama3_configs)
    rules = parse_rules(
        [{"match": "layers.*", "lr_multiplier": 2}, {"match": "*.wo.weight", "lr_multiplier": 0.5}]
    )
    with pytest.raises(ConfigError) as e:
        plan_groups(model, 0.1, [], rules)
    assert str(e.value) == (
        "optimizer.param_groups[1] (match '*.wo.weight'): lr_multiplier 0.5 for "
        "layers.0.attention.wo.weight, which optimizer.param_groups[0] (match 'layers.*') gives "
        "lr_multiplier 2; make the globs disjoint or the values equal"
    )


def test_a_rule_that_matches_nothing_is_one_line():
    model = _meta(Transformer, llama3_configs)
    rules = parse_rules([{"match": "layers.*.attn.*", "weight_decay": 0}])
    groups, hits = plan_groups(model, 0.1, [], rules)
    with pytest.raises(ConfigError) as e:
        check_and_log([groups], rules, hits, None, True)
    assert str(e.value) == (
        "optimizer.param_groups[0] (match 'layers.*.attn.*'): matches no parameter of the model; "
        "names look like 'layers.0.attention_norm.weight' (globs: * ? [seq])"
    )


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            [{"match": "x", "lr": 2}],
            "optimizer.param_groups[0]: unknown key(s) lr; valid: match, lr_multiplier, weight_decay",
        ),
        ([{"lr_multiplier": 2}], "optimizer.param_groups[0].match: must be a glob"),
        (
            [{"match": "x"}],
            "optimizer.param_groups[0]: sets neither lr_multiplier nor weight_decay",
        ),
        (
            [{"match": "x", "lr_multiplier": 0}],
            "optimizer.param_groups[0].lr_multiplier: 0 must be a number > 0",
        ),
        (
            [{"match": "x", "weight_decay": -1}],
            "optimizer.param_groups[0].weight_decay: -1 must be a number >= 0",
        ),
        (
            [{"match": "x", "weight_decay": "none"}],
            "optimizer.param_groups[0].weight_decay: 'none' must be",
        ),
        ('[{"match": "x", ', "optimizer.param_groups: not JSON"),
        ({"match": "x"}, "optimizer.param_groups: must be a list of tables"),
    ],
)
def test_bad_rules_are_one_line(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_rules(raw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_rules_from_the_command_line_are_json():
    rules = parse_rules('[{"match": "output.*", "lr_multiplier": 0.25}]')
    assert rules[0].match == "output.*" and rules[0].lr_multiplier == 0.25


def test_the_optimizer_has_the_groups_and_its_state_names_them_per_parameter():
    torch.manual_seed(0)
    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=64, n_layers=2, dim=32, n_heads=2, n_kv_heads=2
    )
    model = Transformer(args)
    model.init_weights()
    cfg = OptimizerConfig(
        lr=1e-3, weight_decay=0.1, param_groups=[{"match": "output.weight", "lr_multiplier": 0.5}]
    )
    opt = build_optimizer([model], cfg)
    groups = opt.optimizers[0].param_groups
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.1), (1e-3, 0.0), (5e-4, 0.1)]
    state = opt.state_dict()
    assert state["param_groups.output.weight.lr"] == 5e-4
    assert state["param_groups.norm.weight.weight_decay"] == 0.0
    assert state["param_groups.layers.0.attention.wo.weight.weight_decay"] == 0.1


def test_a_checkpoint_from_before_the_groups_loads_with_the_configured_settings():
    """Written with every parameter decaying in one group, loaded into the grouped optimizer:
    the moments come from the checkpoint, the weight decay stays the groups'."""
    torch.manual_seed(0)
    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=64, n_layers=1, dim=32, n_heads=2, n_kv_heads=2
    )
    model = Transformer(args)
    model.init_weights()
    old = build_optimizer([model], OptimizerConfig(weight_decay=0.1, weight_decay_exempt=[]))
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    old.step()
    model.zero_grad(set_to_none=True)  # as at start-up: no gradients when a checkpoint loads
    grouped = build_optimizer([model], OptimizerConfig(weight_decay=0.1, beta2=0.99))
    grouped.load_state_dict(old.state_dict())
    settings = [(g["weight_decay"], g["betas"]) for g in grouped.optimizers[0].param_groups]
    assert settings == [(0.1, (0.9, 0.99)), (0.0, (0.9, 0.99))]
    saved = old.state_dict()["state.norm.weight.exp_avg"]
    assert torch.equal(grouped.state_dict()["state.norm.weight.exp_avg"], saved)
