"""Multi-token prediction (DeepSeek-V3's MTP module) against ``transformers``' own MTP layer and
against the report's equations written out here, and its exchange with the published layout."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import MtpModel

from tests.unit.models.test_deepseek_v3 import LAYERS, VOCAB, _configs, _trained_like
from torchtitan.checkpoint.hf_files import read_folder, write_folder
from torchtitan.data.batch import IGNORE_INDEX
from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.mtp import roll_left
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
from torchtitan.train.loss import MTPLoss, cross_entropy_loss, mtp_targets, token_mean

DEPTHS = 2


def _mtp_model(q_lora_rank: int = 16, depths: int = DEPTHS) -> DeepSeekV3Model:
    _, args = _configs(q_lora_rank, yarn=True)
    model = _trained_like(dataclasses.replace(args, num_mtp_layers=depths))
    with torch.no_grad():
        for layer in model.mtp_layers.values():
            layer.block.moe.expert_bias.normal_(std=0.1)
    return model


def _their_mtp_layer(mtp_layer, exported: dict, index: int, expert_dim: int) -> None:
    """Load DeepSeek's published names for layer ``index`` (our export) into ``transformers``'
    ``MtpLayer``: its block as ``mtp_block.*`` with the experts fused as it keeps them."""
    prefix = f"model.layers.{index}."
    own = {k[len(prefix) :]: v for k, v in exported.items() if k.startswith(prefix)}
    state = {"post_norm.weight": own.pop("shared_head.norm.weight")}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
        state[name] = own.pop(name)
    assert set(own.pop(k).shape for k in ("embed_tokens.weight", "shared_head.head.weight"))
    n_experts = mtp_layer.mtp_block.mlp.experts.gate_up_proj.shape[0]
    gate_up, down = [], []
    for e in range(n_experts):
        p = f"mlp.experts.{e}."
        gate_up.append(torch.cat([own.pop(p + "gate_proj.weight"), own.pop(p + "up_proj.weight")]))
        down.append(own.pop(p + "down_proj.weight"))
    state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mtp_block.mlp.experts.down_proj"] = torch.stack(down)
    state |= {f"mtp_block.{k}": v for k, v in own.items()}
    mtp_layer.load_state_dict(state, strict=True)


@pytest.mark.parametrize("q_lora_rank", [0, 16], ids=["q_proj", "q_lora"])
def test_depth_logits_match_transformers_mtp_layers(q_lora_rank, tmp_path):
    """Our export loaded by ``transformers`` (main model) and its ``MtpLayer`` (each depth): the
    main logits and every depth's logits agree, depth k reading the embeddings of the tokens k
    places on and the depth before it (the main model's final-norm state for the first)."""
    ours = _mtp_model(q_lora_rank)
    adapter = DeepSeekV3StateDictAdapter(ours.args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    assert config["num_nextn_predict_layers"] == DEPTHS
    exported = adapter.to_hf(ours.state_dict())
    write_folder(str(tmp_path), exported, config)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    mtp = MtpModel(hf, DEPTHS).eval()
    for k, layer in enumerate(mtp.layers):
        _their_mtp_layer(layer, exported, LAYERS + k, ours.args.moe.hidden_dim)

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    ours.mtp_active = True
    with torch.no_grad():
        pieces = ours(tokens).chunk(1 + DEPTHS)
        out = hf(tokens, output_hidden_states=True)
        torch.testing.assert_close(pieces[0], out.logits.float(), rtol=1e-5, atol=1e-5)
        h = out.hidden_states[-1]  # the final-norm state (transformers ties it)
        emb = hf.model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        rope = hf.model.rotary_emb(h, positions)
        for k, layer in enumerate(mtp.layers, start=1):
            shifted = torch.cat([emb[:, k:], torch.zeros_like(emb[:, :k])], dim=1)
            h = layer(shifted, h, rope, None, positions, None)
            torch.testing.assert_close(pieces[k], hf.lm_head(h).float(), rtol=1e-5, atol=1e-5)
    ours.mtp_active = False  # generation and evaluation: the main head alone
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), pieces[0])


def _reference_objective(model: DeepSeekV3Model, tokens, labels, weight: float):
    """DeepSeek-V3 report, equations 21-25, written out: depth k runs on the first T - k
    positions only (no padding), its cross entropy summed over the valid targets t[i + k + 1]
    and divided by the main loss's token count (the report's 1/T). Returns (main, mtp mean,
    main + weight * mtp mean)."""
    rope = model.rope_cache
    emb = model.tok_embeddings(tokens)
    x = emb
    for layer in model.layers.values():
        x = layer(x, rope, None)
    h = model.norm(x)
    n_valid = (labels != IGNORE_INDEX).sum()
    main = F.cross_entropy(
        model.output(h).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    seq = tokens.shape[1]
    depth_losses = []
    for k, mtp in enumerate(model.mtp_layers.values(), start=1):
        h = h[:, : seq - k]
        joined = torch.cat([mtp.enorm(emb[:, k:]), mtp.hnorm(h)], dim=-1)
        h = mtp.norm(mtp.block(mtp.eh_proj(joined), rope, None))
        logits = model.output(h)
        depth_losses.append(
            F.cross_entropy(
                logits.flatten(0, 1),
                labels[:, k:].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        )
    mtp_mean = sum(depth_losses) / len(depth_losses) / n_valid
    return main / n_valid, mtp_mean, main / n_valid + weight * mtp_mean


def test_loss_and_gradients_match_the_report_equations():
    model = _mtp_model().train()
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
    labels[0, :5] = IGNORE_INDEX  # ignored labels shift which targets each depth keeps
    labels[2, 11] = IGNORE_INDEX
    weight = 0.3

    main, mtp_mean, objective = _reference_objective(model, tokens, labels, weight)
    objective.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    sum_ce = lambda p, y: cross_entropy_loss(p, y, reduction="sum")  # noqa: E731
    loss_fn = MTPLoss(token_mean(sum_ce), DEPTHS, weight, holds_head=True)
    model.mtp_active = True
    n_valid = float((labels != IGNORE_INDEX).sum())
    loss_fn.begin_step()
    loss = loss_fn(model(tokens), mtp_targets(labels, None, DEPTHS), n_valid)
    loss.backward()
    loss_fn.record([loss])
    torch.testing.assert_close(loss, main, rtol=1e-6, atol=1e-6)  # the value: the main loss
    torch.testing.assert_close(loss_fn.metrics(torch.device("cpu"))["mtp/loss"], mtp_mean.item())
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(want)
    assert any(n.startswith("mtp_layers.") for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    # validation (plain labels): the main loss, and no depth loss to record
    with torch.no_grad():
        plain = loss_fn(model(tokens), labels, n_valid)
    assert torch.allclose(plain, main) and not hasattr(plain, "mtp_loss")


def test_targets_move_left_and_stay_inside_documents():
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    x = IGNORE_INDEX
    assert mtp_targets(labels, None, 2).tolist() == [
        [[10, 11, 12, 13, 14, 15], [11, 12, 13, 14, 15, x], [12, 13, 14, 15, x, x]]
    ]
    # position 2 (document 0) would predict 13 and 14 at depths 1 and 2: document 1's tokens
    assert mtp_targets(labels, doc_ids, 2).tolist() == [
        [[10, 11, 12, 13, 14, 15], [11, 12, x, 14, 15, x], [12, x, x, 15, x, x]]
    ]
    assert roll_left(torch.arange(4).view(1, 4), 5).tolist() == [[0, 0, 0, 0]]


def test_export_round_trips_and_a_model_without_depths_skips_them(tmp_path, caplog):
    ours = _mtp_model()
    adapter = DeepSeekV3StateDictAdapter(ours.args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    assert DeepSeekV3StateDictAdapter.args_from_hf_config(config) == ours.args
    exported = adapter.to_hf(ours.state_dict())
    # the published layout: each depth after the main layers, with its copies of the ends
    for k in range(DEPTHS):
        p = f"model.layers.{LAYERS + k}."
        assert torch.equal(exported[p + "embed_tokens.weight"], ours.tok_embeddings.weight)
        assert torch.equal(exported[p + "shared_head.head.weight"], ours.output.weight)
        assert p + "shared_head.norm.weight" in exported and p + "eh_proj.weight" in exported
    write_folder(str(tmp_path), exported, config)
    hf_state = read_folder(str(tmp_path))
    mine = ours.state_dict()
    back = adapter.from_hf(hf_state, {k: v.shape for k, v in mine.items()})
    assert sorted(back) == sorted(mine)
    assert all(torch.equal(back[k], mine[k]) for k in mine)

    plain = DeepSeekV3Model(dataclasses.replace(ours.args, num_mtp_layers=0))
    expected = {k: v.shape for k, v in plain.state_dict().items()}
    with caplog.at_level("INFO"):
        loaded = DeepSeekV3StateDictAdapter(plain.args).from_hf(hf_state, expected)
    assert sorted(loaded) == sorted(expected)
    assert f"Hugging Face layers [{LAYERS}, {LAYERS + 1}] are multi-token-prediction" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 2


def test_flops_and_parameters_count_the_depths():
    with_mtp = _mtp_model(depths=1)
    without = DeepSeekV3Model(dataclasses.replace(with_mtp.args, num_mtp_layers=0))
    a, seq = with_mtp.args, 64
    n1, f1 = get_nparams_and_flops(with_mtp, a, seq)
    n0, f0 = get_nparams_and_flops(without, without.args, seq)
    mtp = with_mtp.mtp_layers["3"]
    mtp_params = sum(p.numel() for p in mtp.parameters())
    assert n1 - n0 == mtp_params
    moe = mtp.block.moe
    inactive = moe.experts.w1.numel() * 3 * (1 - a.moe.top_k / a.moe.num_experts)
    active = mtp_params - inactive
    attention = a.n_heads * a.head_dim * seq
    assert f1 - f0 == pytest.approx(6 * (active + a.dim * a.vocab_size) + 6 * attention)
