"""Conversations as training data (torchtitan/data/chat.py), against ``transformers``.

The ids of every conversation equal ``AutoTokenizer.apply_chat_template``'s for the project's
test tokenizers (the tiktoken file's Hugging Face export with ChatML tokens added, and the
tiktoken file itself through that export), with a Qwen3-style template and a Llama-3-style one.
The predicted tokens are exactly the assistant turns: equal to ``transformers``'
``return_assistant_tokens_mask`` where the template marks ``{% generation %}`` blocks, and, for
a template without them, the assistant text, its end-of-turn token and the newline the template
writes after it. The loader packs conversations with those labels, resumes exactly inside one,
and a packed block-causal row gives each conversation's token losses as it alone does.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chat_data import (
    CHATML,
    CHATML_GENERATION,
    LLAMA3_STYLE,
    chatml_folder,
    conversation,
    write_conversations,
)
from loaders import build_loader
from offline_data import use_offline_caches
from repo_paths import SENTENCEPIECE_PATH, TIKTOKEN_PATH

from torchtitan.data.batch import IGNORE_INDEX
from torchtitan.data.chat import ChatEncoder, ChatError, find_chat_template
from torchtitan.data.hf_tokenizer import write_tokenizer_files
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.errors import ConfigError, DataError

KEY = "training.chat_template"


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path_factory, monkeypatch):
    hf_cache = tmp_path_factory.mktemp("hf_datasets_cache")
    use_offline_caches(monkeypatch, hf_cache, tmp_path_factory.mktemp("torchtitan_cache"))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    return chatml_folder(tmp_path_factory.mktemp("chatml"))


def _auto(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _predicted(ids: list[int], runs: list[list[int]]) -> np.ndarray:
    keep = np.ones(len(ids), dtype=bool)
    for a, b in runs:
        keep[a:b] = False
    return keep


CONVERSATIONS = [conversation(i) for i in range(12)]


def test_ids_equal_apply_chat_template_with_a_qwen3_style_template(chatml):
    ours = ChatEncoder(build_tokenizer(str(chatml / "tokenizer.json")), None, KEY)
    theirs = _auto(chatml)
    for conv in CONVERSATIONS:
        ids, _ = ours.encode(conv)
        assert ids == _ids(theirs.apply_chat_template(conv, tokenize=True)), conv


def test_tiktoken_ids_equal_apply_chat_template_on_its_export(tmp_path):
    tik = build_tokenizer(str(TIKTOKEN_PATH))
    write_tokenizer_files(str(tmp_path), tik, 4096)
    theirs, template = _auto(tmp_path), LLAMA3_STYLE.read_text()
    ours = ChatEncoder(tik, str(LLAMA3_STYLE), KEY)
    for conv in CONVERSATIONS:
        plain = [m for m in conv if "reasoning_content" not in m]
        ids, runs = ours.encode(plain)
        assert ids == _ids(theirs.apply_chat_template(plain, tokenize=True, chat_template=template))
        answers = [m["content"].strip() + "<|eot_id|>" for m in plain if m["role"] == "assistant"]
        assert tik.decode([i for i, k in zip(ids, _predicted(ids, runs)) if k]) == "".join(answers)


def test_predicted_tokens_are_the_assistant_turns(chatml):
    """Without generation blocks: each assistant turn's rendering after its prompt."""
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    ours = ChatEncoder(tok, None, KEY)
    for conv in CONVERSATIONS:
        ids, runs = ours.encode(conv)
        keep = _predicted(ids, runs)
        # the runs of predicted tokens, decoded, are the answers as the template writes them
        pieces, cur = [], []
        for i, k in zip(ids, keep):
            if k:
                cur.append(i)
            elif cur:
                pieces.append(tok.decode(cur))
                cur = []
        assert keep[-1]  # a conversation ends with its last answer's newline, predicted
        pieces.append(tok.decode(cur))
        answers = [m for m in conv if m["role"] == "assistant"]
        assert len(pieces) == len(answers)
        for piece, m in zip(pieces, answers):
            assert piece.endswith("<|im_end|>\n")
            assert m["content"].split("</think>")[-1].lstrip("\n") in piece
            if "reasoning_content" in m and m is answers[-1]:
                assert piece.startswith("<think>\n" + m["reasoning_content"])
        assert "<|im_start|>" not in "".join(pieces) and "Q" not in "".join(pieces)


def test_generation_blocks_give_transformers_assistant_mask(tmp_path):
    folder = chatml_folder(tmp_path, CHATML_GENERATION)
    ours = ChatEncoder(build_tokenizer(str(folder / "tokenizer.json")), None, KEY)
    theirs = _auto(folder)
    convs = CONVERSATIONS + [conversation(i, reasoning_in_earlier_turns=True) for i in (4, 5)]
    for conv in convs:
        ids, runs = ours.encode(conv)
        out = theirs.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == list(out["input_ids"])
        assert _predicted(ids, runs).tolist() == [bool(m) for m in out["assistant_masks"]]


SPACED = (
    "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
    "{% else %}Assistant: {% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("generation", [True, False])
def test_a_token_across_a_span_start_is_predicted_as_in_transformers(tmp_path, generation):
    """``'Assistant: '`` then the answer: the answer's first token (``' H'``) starts in the
    prompt's space and overlaps the span, so it is predicted (transformers' overlap rule); the
    same without generation blocks, where the span also starts after the prompt's space."""
    plain = (
        SPACED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        + "{% if add_generation_prompt %}Assistant: {% endif %}"
    )
    template = SPACED if generation else plain
    (tmp_path / "t.jinja").write_text(template)
    folder = chatml_folder(tmp_path / "tok", template=None)
    tok = build_tokenizer(str(folder / "tokenizer.json"))
    ids, runs = ChatEncoder(tok, str(tmp_path / "t.jinja"), KEY).encode(CONV)
    theirs = _auto(folder)
    assert ids == _ids(theirs.apply_chat_template(CONV, tokenize=True, chat_template=template))
    out = theirs.apply_chat_template(
        CONV,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        chat_template=SPACED,
    )
    mask, reference = _predicted(ids, runs).tolist(), [bool(m) for m in out["assistant_masks"]]
    first = mask.index(True)
    assert first == reference.index(True) and tok.decode(ids[first : first + 1]) == " H"
    if generation:
        assert mask == reference


CONV = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


def test_a_template_that_rewrites_earlier_turns_stops_with_one_line(chatml):
    """Qwen3's way: reasoning of turns before the last user message is dropped."""
    ours = ChatEncoder(build_tokenizer(str(chatml / "tokenizer.json")), None, KEY)
    with pytest.raises(ChatError, match=r"message 1 \(assistant\).*\{% generation %\}"):
        ours.encode(conversation(5, reasoning_in_earlier_turns=True))


def test_null_keys_are_left_out_and_reasoning_aliases_read(chatml):
    ours = ChatEncoder(build_tokenizer(str(chatml / "tokenizer.json")), None, KEY)
    conv = conversation(1)
    with_nulls = [{"reasoning_content": None, "tool_calls": None, **m} for m in conv[:-1]]
    assert ours.encode(with_nulls + conv[-1:]) == ours.encode(conv)
    aliased = conv[:-1] + [
        {
            "role": "assistant",
            "content": conv[-1]["content"],
            "thinking": conv[-1]["reasoning_content"],
        }
    ]
    assert ours.encode(aliased) == ours.encode(conv)


def test_where_the_template_comes_from(tmp_path, chatml):
    tok_path = str(chatml / "tokenizer.json")
    template, origin = find_chat_template(tok_path, None, KEY)
    assert template == CHATML.read_text() and origin.endswith("tokenizer_config.json")
    # a chat_template.jinja next to it comes first, as in transformers
    folder = chatml_folder(tmp_path / "jinja")
    (folder / "chat_template.jinja").write_text("{{ 'x' }}")
    assert find_chat_template(str(folder / "tokenizer.json"), None, KEY)[0] == "{{ 'x' }}"
    # a list of named templates: the default one; a folder, a config or a .jinja as override
    config = {
        "chat_template": [{"name": "tool", "template": "t"}, {"name": "default", "template": "d"}]
    }
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    assert find_chat_template(tok_path, str(tmp_path / "cfg.json"), KEY)[0] == "d"
    assert find_chat_template(tok_path, str(folder), KEY)[0] == "{{ 'x' }}"
    assert find_chat_template(tok_path, str(LLAMA3_STYLE), KEY)[0] == LLAMA3_STYLE.read_text()
    bare = chatml_folder(tmp_path / "bare", template=None)
    with pytest.raises(ConfigError, match=rf"^{KEY}: conversations need a chat template.*bare"):
        find_chat_template(str(bare / "tokenizer.json"), None, KEY)
    with pytest.raises(ConfigError, match=rf"^{KEY}: '.*nope.jinja' does not exist"):
        find_chat_template(tok_path, str(tmp_path / "nope.jinja"), KEY)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m }")
    broken = ChatEncoder(build_tokenizer(tok_path), str(tmp_path / "bad.jinja"), KEY)
    with pytest.raises(ConfigError, match=r"chat template '.*bad.jinja': line 2: "):
        broken.encode(conversation(0))


def test_a_template_failing_on_the_data_is_one_line(tmp_path, chatml):
    """A Python error inside the template (content as a list of parts where it adds strings)."""
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    convs = [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]] + CONVERSATIONS
    with pytest.raises(DataError, match=r"row 0 .*failed: TypeError: .*do the messages have"):
        _loader(write_conversations(tmp_path / "parts.jsonl", convs), tok)


def test_sentencepiece_is_refused_in_one_line():
    sp = ChatEncoder(build_tokenizer(str(SENTENCEPIECE_PATH)), str(LLAMA3_STYLE), KEY)
    with pytest.raises(ConfigError, match=r"^model.tokenizer_path: conversations need"):
        sp.encode(conversation(0))


# ---- the loader


def _loader(path: Path, tok, **kw):
    spec = dict(
        dataset_path=str(path),
        dataset="python_docs",
        tokenizer=tok,
        local_batch_size=1,
        seq_len=kw.pop("seq_len", 63),
        shuffle=False,
    )
    return build_loader(**{**spec, **kw})


def _stream(tok, convs) -> tuple[list[int], list[bool], list[int]]:
    """The expected packing of one shard reading ``convs`` in order: ids, predicted flags, and
    where conversations start."""
    enc = ChatEncoder(tok, None, KEY)
    ids, keep, starts = [], [], []
    for c in convs:
        i, runs = enc.encode(c)
        starts.append(len(ids))
        ids += i
        keep += _predicted(i, runs).tolist()
    return ids, keep, starts


def test_loader_packs_conversations_with_labels_on_the_assistant_turns(tmp_path, chatml):
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    path = write_conversations(tmp_path / "chat.jsonl", CONVERSATIONS)
    ids, keep, starts = _stream(tok, CONVERSATIONS)
    loader = _loader(path, tok)  # the text field defaults to 'messages' here
    w = 64
    for k, batch in zip(range(len(ids) // w), loader, strict=False):
        window = ids[k * w : (k + 1) * w]
        assert batch.inputs[0].tolist() == window[:-1]
        want = [t if p else IGNORE_INDEX for t, p in zip(window[1:], keep[k * w + 1 : (k + 1) * w])]
        assert batch.labels[0].tolist() == want
        new_doc = [k * w + t in starts for t in range(1, w)]
        assert batch.doc_ids[0].tolist() == [0] + np.cumsum(new_doc[:-1]).tolist()


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_inside_a_conversation_is_exact(tmp_path, chatml, streaming):
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    path = write_conversations(tmp_path / "chat.jsonl", CONVERSATIONS * 2)
    kw = dict(global_batch_size=2, local_batch_size=1, seq_len=47, streaming=streaming)
    kw.update(shuffle=True, shuffle_buffer=3)
    whole = _loader(path, tok, **kw)
    it = iter(whole)
    for _ in range(3):
        next(it)
    state = whole.state_dict()
    assert any(json.loads(v)["not_predicted"] for k, v in state.items() if k.startswith("shard"))
    expected = [next(it) for _ in range(6)]
    resumed = _loader(path, tok, **kw)
    resumed.load_state_dict(state)
    for want, got in zip(expected, resumed, strict=False):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)


def test_a_mixture_of_text_and_conversations(tmp_path, chatml):
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    chat = write_conversations(tmp_path / "chat.jsonl", CONVERSATIONS)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain text {i} " * 5}) + "\n" for i in range(8)))
    mix = [{"path": str(chat), "weight": 0.5}, {"path": str(text), "weight": 0.5}]
    loader = _loader(tmp_path, tok, datasets=mix, global_batch_size=4, local_batch_size=4)
    batch = next(iter(loader))
    ignored = (batch.labels == IGNORE_INDEX).float().mean(1)
    assert sorted(ignored.gt(0).tolist()) == [False, False, True, True]  # text rows: all predicted


def test_bad_conversations_stop_with_a_line_naming_the_row(tmp_path, chatml):
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    convs = CONVERSATIONS[:3] + [[{"content": "no role"}]] + CONVERSATIONS[3:]
    loader = _loader(write_conversations(tmp_path / "c.jsonl", convs), tok, seq_len=15)
    with pytest.raises(DataError, match=r"conversation in row 3 of virtual shard 0.*no 'role'"):
        for _ in loader:
            pass
    bad_role = [[{"role": "robot", "content": "beep"}]] + CONVERSATIONS
    with pytest.raises(DataError, match=r"row 0 .*failed: unknown role: robot"):
        _loader(write_conversations(tmp_path / "r.jsonl", bad_role), tok)
    few = write_conversations(tmp_path / "few.jsonl", CONVERSATIONS[:2])
    with pytest.raises(DataError, match=r"has 2 conversations, fewer than its 4 virtual"):
        _loader(few, tok, global_batch_size=4)


def test_a_damaged_state_is_refused(tmp_path, chatml):
    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    loader = _loader(write_conversations(tmp_path / "c.jsonl", CONVERSATIONS), tok)
    next(iter(loader))
    state = loader.state_dict()
    saved = json.loads(state["shard_0"])
    saved["not_predicted"] = [[5, 3]]
    state["shard_0"] = json.dumps(saved).encode()
    with pytest.raises(ConfigError, match="runs of tokens not predicted .* damaged"):
        _loader(tmp_path / "c.jsonl", tok).load_state_dict(state)


def test_packed_and_unpacked_losses_agree(tmp_path, chatml):
    """Every conversation of a packed block-causal row: the per-token losses it has alone."""
    from torchtitan.models.llama.flavors import llama3_configs
    from torchtitan.models.llama.model import Transformer

    tok = build_tokenizer(str(chatml / "tokenizer.json"))
    args = dataclasses.replace(
        llama3_configs["debugmodel"],
        vocab_size=tok.n_words,
        n_layers=2,
        dim=64,
        n_heads=8,
        attn_mask_type="block_causal",
    )
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model.eval()
    batch = next(
        iter(_loader(write_conversations(tmp_path / "c.jsonl", CONVERSATIONS), tok, seq_len=255))
    )
    with torch.no_grad():
        packed = F.cross_entropy(
            model(batch.inputs, batch.doc_ids)[0], batch.labels[0], reduction="none"
        )
        doc_ids = batch.doc_ids[0]
        assert doc_ids.max() >= 2
        for d in range(int(doc_ids.max()) + 1):
            at = (doc_ids == d).nonzero().flatten()
            lo, hi = int(at[0]), int(at[-1]) + 1
            alone = model(batch.inputs[:, lo:hi])[0]
            loss = F.cross_entropy(alone, batch.labels[0, lo:hi], reduction="none")
            assert (loss - packed[lo:hi]).abs().max() < 1e-5, d
        assert (batch.labels[0] == IGNORE_INDEX).any() and (batch.labels[0] != IGNORE_INDEX).any()
