"""Hugging Face asset folders (``model.hf_assets_path``): a ``tokenizer.json`` that the tests train
with the ``tokenizers`` library on the offline corpus gives the ids of ``transformers``'
``AutoTokenizer``; ``build_tokenizer`` takes files and folders; the config resolves the tokenizer;
``scripts/download_hf_assets.py`` asks the Hub for the right files and keeps the token out of its
output; ``scripts/generate.py`` picks the tokenizer of a folder. Running the download script
offline, and generate.py and training on a whole folder, are in tests/e2e/test_hf_assets.py."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import types
from pathlib import Path

import pytest
from download_scripts import SECRET, load_download_script
from hf_folders import copy_files, corpus, train_tokenizer_json, write_model_folder
from repo_paths import ROOT, TOKENIZER_ASSETS, load_script

from torchtitan.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    build_tokenizer,
    resolve_tokenizer_path,
    tokenizer_file_in,
    tokenizer_source,
)
from torchtitan.errors import ConfigError

REPO = "meta-llama/Llama-3.1-8B"

TEXTS = [
    "",
    "The quick brown fox jumps over the lazy dog. It's 2024; isn't it?",
    'def f(x: int) -> int:\n    """Doc."""\n    return x ** 2  # square\n',
    "naïve café, Ελληνικά, русский, 日本語のテキスト, עברית, हिन्दी",
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷 and ✔︎",
    "  lead\t\ttabs \n\n\n  trailing   \r\n\x0b\x0cend   ",
    " x",
    "        ",
    "\n" * 50,
    "3.14159 1234567890 0x1F 1e-9 -42",
    "nul\x00 bell\x07 del\x7f",
    "a . b , c n't I 'm",
    "x" * 3000,
    " \u3000 \u00a0 \t" * 40,
]
SPECIAL_TEXT = "<|begin_of_text|>hi<|end_of_text|> <s> </s> <unk>"


# ----------------------------------------------------------------------------- test tokenizers


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for style in ("bytelevel", "metaspace"):
        train_tokenizer_json(root / style, style)
        out[style] = root / style
    return out


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def pair(request, trained):
    """(folder, our tokenizer, transformers' AutoTokenizer) of one trained tokenizer."""
    transformers = pytest.importorskip("transformers")
    folder = trained[request.param]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    return folder, build_tokenizer(folder), hf


# ----------------------------------------------------------------------------- the tokenizer


def test_ids_equal_autotokenizer(pair):
    _, ours, hf = pair
    assert isinstance(ours, HuggingFaceTokenizer)
    for text in TEXTS + corpus()[:20]:
        expected = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, bos=False, eos=False) == expected, repr(text[:80])
        assert ours.encode(text, bos=True, eos=False) == [hf.bos_token_id, *expected]
        assert ours.encode(text, bos=True, eos=True) == [
            hf.bos_token_id,
            *expected,
            hf.eos_token_id,
        ]
    # the file's own post-processor adds BOS: ours is the same sequence
    assert ours.encode("def main(", bos=True, eos=False) == hf("def main(")["input_ids"]


def test_decode_equals_autotokenizer_and_round_trips(pair):
    _, ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text, bos=False, eos=False)
        assert ours.decode(ids) == hf.decode(ids), repr(text[:80])
        if "\t" not in text and "\x0b" not in text:  # metaspace: no byte fallback for these
            assert ours.decode(ids) == text, repr(text[:80])
    with_specials = ours.encode("hello", bos=True, eos=True)
    assert ours.decode(with_specials) == hf.decode(with_specials)


def test_bytelevel_round_trips_everything(trained):
    ours = build_tokenizer(trained["bytelevel"])
    for text in TEXTS + [SPECIAL_TEXT]:
        assert ours.decode(ours.encode(text, bos=False, eos=False)) == text


def test_special_token_text_is_plain_text(pair):
    """As with TikTokenizer, documents cannot inject control tokens: special-token text is
    encoded as AutoTokenizer(split_special_tokens=True) encodes it."""
    transformers = pytest.importorskip("transformers")
    folder, ours, hf = pair
    split = transformers.AutoTokenizer.from_pretrained(str(folder), split_special_tokens=True)
    ids = ours.encode(SPECIAL_TEXT, bos=False, eos=False)
    assert ids == split(SPECIAL_TEXT, add_special_tokens=False)["input_ids"]
    assert ours.bos_id not in ids and ours.eos_id not in ids
    assert ids != hf(SPECIAL_TEXT, add_special_tokens=False)["input_ids"]
    # also in a copy sent to another process (pickle drops the library's own setting)
    copy = pickle.loads(pickle.dumps(ours))
    assert copy.encode(SPECIAL_TEXT, bos=True, eos=False) == [ours.bos_id, *ids]


def test_vocabulary_and_special_ids(pair):
    folder, ours, hf = pair
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert ours.n_words == raw.get_vocab_size(with_added_tokens=True) == len(hf) == 1000
    assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.pad_id == (hf.pad_token_id if hf.pad_token_id is not None else -1)
    assert all(0 <= i < ours.n_words for t in TEXTS for i in ours.encode(t, bos=True, eos=True))


def test_special_tokens_from_map_and_model_config(trained, tmp_path):
    src = trained["bytelevel"]
    ref = build_tokenizer(src)

    # special_tokens_map.json, then config.json (an id, or a list of ids)
    folder = copy_files(src, tmp_path / "map", "tokenizer.json")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|pad|>"})
    )
    tok = build_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_id, ref.pad_id, -1)

    folder = copy_files(src, tmp_path / "config", "tokenizer.json")
    (folder / "config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0], "vocab_size": 1024})
    )
    tok = build_tokenizer(folder / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.n_words == 1024  # the model's padded embedding

    # tokenizer_config.json comes first
    copy_files(src, folder, "tokenizer_config.json")
    tok = build_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (ref.bos_id, ref.eos_id)


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, "defines no BOS token: set bos_token in tokenizer_config.json"),
        ({"bos_token": "<nope>", "eos_token": "<|end_of_text|>"}, "'<nope>' of tokenizer_config"),
        ({"bos_token": "<|begin_of_text|>"}, "defines no EOS token"),
        ([1, 2], "tokenizer_config.json does not hold a JSON object"),
    ],
)
def test_special_token_errors(trained, tmp_path, config, expected):
    folder = copy_files(trained["bytelevel"], tmp_path / "f", "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    message = _config_error(folder, key="model.hf_assets_path")
    assert expected in message


def test_special_token_id_outside_vocabulary(trained, tmp_path):
    folder = copy_files(trained["bytelevel"], tmp_path / "f", "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 5000, "eos_token_id": 1}))
    assert "bos_token_id 5000 of config.json is outside the vocabulary" in _config_error(folder)


def _config_error(path, key: str = "model.tokenizer_path") -> str:
    with pytest.raises(ConfigError) as info:
        build_tokenizer(path, key=key)
    message = str(info.value)
    assert message.startswith(f"{key}: ") and str(path) in message and "\n" not in message
    return message


# ----------------------------------------------------------------------------- files and folders


def test_build_tokenizer_files_and_folders(trained, tmp_path):
    src = trained["bytelevel"]
    assert isinstance(build_tokenizer(src / "tokenizer.json"), HuggingFaceTokenizer)
    assert isinstance(build_tokenizer(str(src)), HuggingFaceTokenizer)

    # a Llama 3 folder holding only original/tokenizer.model: the tiktoken file
    llama3 = tmp_path / "llama3"
    (llama3 / "original").mkdir(parents=True)
    shutil.copy(TOKENIZER_ASSETS / "tiktoken.model", llama3 / "original" / "tokenizer.model")
    assert tokenizer_file_in(llama3) == str(llama3 / "original" / "tokenizer.model")
    assert isinstance(build_tokenizer(llama3), TikTokenizer)
    # ... and when tokenizer.json is there too, that one
    copy_files(src, llama3, "tokenizer.json", "tokenizer_config.json")
    assert isinstance(build_tokenizer(llama3), HuggingFaceTokenizer)

    # a Llama 2 folder (or this library's SentencePiece export): tokenizer.model at the top
    llama2 = tmp_path / "llama2"
    llama2.mkdir()
    shutil.copy(TOKENIZER_ASSETS / "sentencepiece.model", llama2 / "tokenizer.model")
    assert isinstance(build_tokenizer(llama2), SentencePieceTokenizer)

    # the kind comes from the content: a tokenizer.json under another name
    shutil.copy(src / "tokenizer.json", tmp_path / "vocab.model")
    shutil.copy(src / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    assert isinstance(build_tokenizer(tmp_path / "vocab.model"), HuggingFaceTokenizer)


def test_build_tokenizer_folder_errors(tmp_path):
    empty = tmp_path / "empty"
    (empty / "original").mkdir(parents=True)
    (empty / "config.json").write_text("{}")
    message = _config_error(empty, key="model.hf_assets_path")
    assert "is a directory with none of tokenizer.json, tokenizer.model, " in message
    assert "original/tokenizer.model" in message and "download_hf_assets.py" in message

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    message = _config_error(bad)
    assert "is JSON but does not load as a Hugging Face tokenizer.json" in message


def test_tokenizer_source_rule():
    from torchtitan.config.schema import Model

    default = Model()
    assert tokenizer_source(default) == (default.tokenizer_path, "model.tokenizer_path")
    hf = dataclasses.replace(default, hf_assets_path="assets/hf/Llama-3.1-8B")
    assert tokenizer_source(hf) == ("assets/hf/Llama-3.1-8B", "model.hf_assets_path")
    assert resolve_tokenizer_path(hf) == "assets/hf/Llama-3.1-8B"
    both = dataclasses.replace(hf, tokenizer_path="assets/hf/Llama-3.1-8B/original/tokenizer.model")
    assert tokenizer_source(both) == (both.tokenizer_path, "model.tokenizer_path")
    # an unset tokenizer_path (the default, "", None) defers to hf_assets_path
    for unset in ("", None):
        cfg = types.SimpleNamespace(tokenizer_path=unset, hf_assets_path="hf")
        assert tokenizer_source(cfg) == ("hf", "model.hf_assets_path")
        cfg = types.SimpleNamespace(tokenizer_path=unset, hf_assets_path=None)
        assert tokenizer_source(cfg) == (DEFAULT_TOKENIZER_PATH, "model.tokenizer_path")


def test_checkpoint_hf_load_source():
    from torchtitan.checkpoint import hf_load_source
    from torchtitan.config.schema import JobConfig

    cfg = JobConfig()
    assert hf_load_source(cfg.checkpoint, cfg.model) is None
    cfg.model.hf_assets_path = "assets/hf/Llama-3.2-1B"
    assert hf_load_source(cfg.checkpoint, cfg.model) == (
        "assets/hf/Llama-3.2-1B",
        "model.hf_assets_path",
    )
    cfg.checkpoint.initial_load_path = "elsewhere"
    assert hf_load_source(cfg.checkpoint, cfg.model) == (
        "elsewhere",
        "checkpoint.initial_load_path",
    )


def test_export_writes_the_tokenizer_files(trained, tmp_path):
    """A run that trained with a tokenizer.json exports it next to its weights."""
    transformers = pytest.importorskip("transformers")
    from torchtitan.data.hf_tokenizer import write_tokenizer_files

    src = trained["metaspace"]
    # BOS / EOS known only from config.json: the export names them in tokenizer_config.json
    folder = copy_files(src, tmp_path / "src", "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ours = build_tokenizer(folder)
    files = write_tokenizer_files(str(tmp_path / "out"), ours, 64)
    assert files == ["tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text, bos=True, eos=False)
    again = build_tokenizer(tmp_path / "out")
    assert (again.bos_id, again.eos_id, again.n_words) == (1, 2, ours.n_words)


# ----------------------------------------------------------------------------- download script


@pytest.fixture()
def dl(monkeypatch):
    return load_download_script(monkeypatch, "download_hf_assets")


TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "original/tokenizer.model",
    "tokenizer.model",
]
CONFIG_PATTERNS = ["config.json", "generation_config.json"]
WEIGHT_PATTERNS = [*CONFIG_PATTERNS, "*.safetensors", "model.safetensors.index.json"]
# The files of meta-llama/Llama-3.1-8B (as listed on the Hub) and what each selection fetches.
LLAMA31_FILES = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "USE_POLICY.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
    "model.safetensors.index.json",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/tokenizer.model",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.mark.parametrize(
    "argv, patterns",
    [
        ([], TOKENIZER_PATTERNS),
        (["--assets", "tokenizer"], TOKENIZER_PATTERNS),
        (["--assets", "tokenizer", "config"], TOKENIZER_PATTERNS + CONFIG_PATTERNS),
        (["--assets", "config"], CONFIG_PATTERNS),
        (["--assets", "weights"], WEIGHT_PATTERNS),
        (["--assets", "weights", "config", "weights"], WEIGHT_PATTERNS),
        (["--all"], TOKENIZER_PATTERNS + WEIGHT_PATTERNS),
    ],
)
def test_download_allow_patterns(dl, argv, patterns):
    args = dl.build_parser().parse_args(["--repo_id", REPO, *argv])
    assert dl.allow_patterns(dl.selected_assets(args)) == patterns


def test_download_patterns_select_the_right_files(dl):
    """The patterns as the Hub client applies them (its own filter) to a real file list."""
    from huggingface_hub.utils import filter_repo_objects

    def fetched(*assets):
        return sorted(filter_repo_objects(LLAMA31_FILES, allow_patterns=dl.allow_patterns(assets)))

    assert fetched("tokenizer") == [
        "original/tokenizer.model",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert fetched("config") == ["config.json", "generation_config.json"]
    weights = fetched("weights")
    assert weights == sorted(CONFIG_PATTERNS + [f for f in LLAMA31_FILES if f.startswith("model")])
    assert "original/consolidated.00.pth" not in fetched(*dl.ALL_ASSETS)
    assert sorted(fetched(*dl.ALL_ASSETS)) == sorted(set(fetched("tokenizer")) | set(weights))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--assets"], "--assets"),
        (["--assets", "everything"], "invalid choice: 'everything'"),
        (["--assets", "tokenizer", "--all"], "not allowed with argument"),
        (["--repo_id", "no-slash"], "--repo_id"),
    ],
)
def test_download_bad_arguments(dl, capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        dl.main(["--repo_id", REPO, *argv, "--hf_token", SECRET])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert expected in err
    assert SECRET not in out + err


def _fake_snapshot(calls, files=("tokenizer.json", "tokenizer_config.json")):
    def fake(**kwargs):
        calls.append(kwargs)
        folder = Path(kwargs["local_dir"]).resolve()
        for name in files:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("{}")
        return str(folder)

    return fake


def test_download_passes_arguments(dl, monkeypatch, capsys, tmp_path):
    calls: list[dict] = []
    monkeypatch.setattr(dl, "snapshot_download", _fake_snapshot(calls))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert dl.main(["--repo_id", REPO, "--local_dir", str(tmp_path / "a")]) == 0
    assert calls[-1] == {
        "repo_id": REPO,
        "allow_patterns": TOKENIZER_PATTERNS,
        "local_dir": str(tmp_path / "a"),
        "token": SECRET,
        "revision": None,
    }
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "a")
    assert SECRET not in out + err

    # --hf_token wins over HF_TOKEN; the default folder is assets/hf/<name>
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        dl, "snapshot_download", _fake_snapshot(calls, ["tokenizer.json", "config.json"])
    )
    argv = ["--repo_id", REPO, "--hf_token", "other", "--assets", "tokenizer", "config"]
    assert dl.main([*argv, "--revision", "v1"]) == 0
    assert calls[-1]["token"] == "other" and calls[-1]["revision"] == "v1"
    assert calls[-1]["local_dir"] == os.path.join("assets", "hf", "Llama-3.1-8B")
    assert calls[-1]["allow_patterns"] == TOKENIZER_PATTERNS + CONFIG_PATTERNS

    monkeypatch.delenv("HF_TOKEN")
    assert dl.main(["--repo_id", REPO, "--local_dir", str(tmp_path / "b")]) == 0
    assert calls[-1]["token"] is None


def test_download_reports_missing_files(dl, monkeypatch, capsys, tmp_path):
    """A repository without the asked-for files (a download that matched nothing)."""
    monkeypatch.setattr(dl, "snapshot_download", _fake_snapshot([], ["README.md"]))
    argv = ["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path), "--all"]
    assert dl.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and SECRET not in err and err.count("\n") == 1
    assert err.startswith(f"download_hf_assets.py: error: repository {REPO} has no tokenizer")
    assert "no config.json" in err and "no safetensors weights" in err


def test_download_never_echoes_the_token(dl, monkeypatch, capsys):
    def fake(**kwargs):
        raise RuntimeError(f"something went wrong with token {kwargs['token']}")

    monkeypatch.setattr(dl, "snapshot_download", fake)
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET]) == 1
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert err.startswith("download_hf_assets.py: error:") and err.count("\n") == 1

    class Forbidden(Exception):  # what the Hub client raises carries the HTTP response
        response = types.SimpleNamespace(status_code=403)

    def gated(**kwargs):
        raise Forbidden(f"Access to {REPO} is restricted for token {kwargs['token']}")

    monkeypatch.setattr(dl, "snapshot_download", gated)
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET, "--all"]) == 1
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert "gated" in err and f"https://huggingface.co/{REPO}" in err and "licence" in err


# ----------------------------------------------------------------------------- generate.py


@pytest.fixture()
def gen(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return load_script("generate")


def test_generate_tokenizer_choice(gen, trained, tmp_path):
    folder = trained["bytelevel"]
    assert isinstance(gen.load_tokenizer(None, str(folder)), HuggingFaceTokenizer)
    assert isinstance(gen.load_tokenizer(str(folder), "step-5"), HuggingFaceTokenizer)
    tiktoken = str(TOKENIZER_ASSETS / "tiktoken.model")
    assert isinstance(gen.load_tokenizer(tiktoken, str(folder)), TikTokenizer)
    dcp = tmp_path / "step-5"
    dcp.mkdir()
    with pytest.raises(ConfigError, match=r"^--tokenizer: needed, since --checkpoint '.*step-5'"):
        gen.load_tokenizer(None, str(dcp))
    with pytest.raises(ConfigError, match=r"^--tokenizer: '.*step-5' is a directory with none"):
        gen.load_tokenizer(str(dcp), str(folder))


# ----------------------------------------------------------------------------- a whole folder


@pytest.fixture(scope="module")
def hf_folder(trained, tmp_path_factory) -> Path:
    """A Hub-like Llama folder of the debug flavor with the trained byte-level tokenizer."""
    return write_model_folder(trained["bytelevel"], tmp_path_factory.mktemp("Llama-debug"))


def test_hf_folder_tokenizer(hf_folder):
    tok = build_tokenizer(hf_folder, key="model.hf_assets_path")
    assert isinstance(tok, HuggingFaceTokenizer) and tok.n_words == 1000
