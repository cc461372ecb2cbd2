"""scripts/generate.py's token choice: greedy by default (as before sampling existed), seeded
sampling with temperature, top-k and top-p, and its options (each described in --help, bad
values one line). That greedy matches transformers on a trained checkpoint is checked in
tests/e2e/test_hf_format.py."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
from repo_paths import ROOT, load_script

from torchtitan.errors import ConfigError
from torchtitan.models.spec import get_model_args, get_model_spec

PROMPT = [1, 17, 42, 99, 7]
NEW = 12


@pytest.fixture(scope="module")
def gen():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "scripts"))
        yield load_script("generate")


@pytest.fixture(scope="module")
def net():
    """A tiny random Llama 3 (2 layers of width 64, 300 tokens): broad next-token distributions."""
    args = dataclasses.replace(
        get_model_args("llama3", "debugmodel"),
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=300,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    model = get_model_spec("llama3").cls(args)
    model.init_weights()
    return model.eval()


def argmax_loop(net, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding written out: the reference generate.py's default must keep giving."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(net(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def run(gen, net, sampling=None, eos_id: int = -1) -> list[int]:
    extra = () if sampling is None else (sampling,)
    return gen.generate(net, PROMPT, NEW, eos_id, 64, *extra)


def test_greedy_is_the_default_and_unchanged(gen, net):
    expected = argmax_loop(net, PROMPT, NEW)
    assert run(gen, net) == expected
    assert run(gen, net, gen.Sampling(seed=123)) == expected  # a seed does not change greedy
    # it stops after EOS
    assert run(gen, net, eos_id=expected[3]) == expected[: expected.index(expected[3]) + 1]


def test_seeded_sampling_is_reproducible(gen, net):
    def sample(seed: int) -> list[int]:
        return run(gen, net, gen.Sampling(temperature=1.0, seed=seed))

    first = sample(7)
    assert sample(7) == first
    others = [sample(seed) for seed in (8, 9, 10)]
    assert all(o != first for o in others)  # 12 draws over ~300 tokens: seeds differ
    assert first != argmax_loop(net, PROMPT, NEW)


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_1_and_a_tiny_top_p_are_greedy(gen, net, seed):
    greedy = argmax_loop(net, PROMPT, NEW)
    assert run(gen, net, gen.Sampling(temperature=5.0, top_k=1, seed=seed)) == greedy
    assert run(gen, net, gen.Sampling(temperature=5.0, top_p=1e-9, seed=seed)) == greedy


def _draws(gen, logits: torch.Tensor, n: int = 400, **kw) -> set[int]:
    sampling = gen.Sampling(temperature=1.0, **kw)
    generator = torch.Generator().manual_seed(0)
    return {gen.next_token(logits.clone(), sampling, generator) for _ in range(n)}


def test_top_k_and_top_p_keep_exactly_the_tokens_they_name(gen):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    assert _draws(gen, logits, top_k=5) == set(torch.topk(logits, 5).indices.tolist())
    assert len(_draws(gen, logits)) > 20  # unrestricted: many tokens
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # the fewest most likely tokens whose probabilities reach p: 0.5 + 0.3 >= 0.8
    assert _draws(gen, probs, top_p=0.8) == {0, 1}
    assert _draws(gen, probs, top_p=0.81) == {0, 1, 2}
    assert _draws(gen, probs, top_k=3, top_p=0.99) == {0, 1, 2}


def test_temperature_sharpens_the_distribution(gen):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    generator = torch.Generator().manual_seed(0)
    cold = gen.Sampling(temperature=0.05)
    draws = [gen.next_token(probs.clone(), cold, generator) for _ in range(200)]
    assert draws.count(0) >= 199  # 0.4^20 against 0.3^20: almost always the top token
    assert math.isclose(gen.Sampling().temperature, 0.0)  # greedy is the default


def test_every_option_is_described_in_help(gen):
    parser = gen.build_parser()
    options = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
    assert {a.dest for a in options} >= {"temperature", "top_k", "top_p", "seed", "json"}
    for action in options:
        assert action.help and len(action.help) > 20, action.dest
    text = parser.format_help()
    assert "greedy" in text and "nucleus" in text and "random seed" in text


def _args(gen, *argv: str) -> argparse.Namespace:
    return gen.build_parser().parse_args(["--checkpoint", "c", "--prompt", "p", *argv])


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--temperature", "-1"], "--temperature: -1.0 must be >= 0 (0 = greedy)"),
        (["--temperature", "nan"], "--temperature: nan must be >= 0 (0 = greedy)"),
        (["--temperature", "1", "--top_k", "-2"], "--top_k: -2 must be >= 0 (0 = every token)"),
        (
            ["--temperature", "1", "--top_p", "0"],
            "--top_p: 0.0 must be in (0, 1] (1 = every token)",
        ),
        (["--temperature", "1", "--top_p", "1.5"], "--top_p: 1.5 must be in (0, 1]"),
        (
            ["--top_k", "40"],
            "--top_k: has no effect with --temperature 0 (greedy takes the most "
            "likely token); give --temperature > 0 (e.g. 0.8) to sample",
        ),
        (["--top_p", "0.9"], "--top_p: has no effect with --temperature 0"),
        (["--max_new_tokens", "0"], "--max_new_tokens: 0 must be >= 1"),
        (["--temperature", "1", "--seed", "-1"], "--seed: -1 must be in [0, 2**63)"),
    ],
)
def test_bad_sampling_options_are_one_line(gen, argv, error):
    with pytest.raises(ConfigError) as e:
        gen.sampling_from(_args(gen, *argv))
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_a_random_seed_is_printed_so_that_a_sample_can_be_repeated(gen, capsys):
    sampling = gen.sampling_from(_args(gen, "--temperature", "0.8", "--top_k", "50"))
    assert capsys.readouterr().err == (
        f"sampling with seed {sampling.seed} (--seed {sampling.seed} repeats it)\n"
    )
    assert gen.sampling_from(_args(gen, "--temperature", "0.8", "--seed", "5")).seed == 5
    gen.sampling_from(_args(gen))  # greedy: no seed to print
    assert capsys.readouterr().err == ""
