"""Tokenizers, the committed test tokenizers and the script that builds them, and the Hub
download script (in-process, against a fake Hub; run offline as a process in
tests/e2e/test_tokenizer.py)."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest
from download_scripts import SECRET, load_download_script
from repo_paths import ROOT, SENTENCEPIECE_PATH, TIKTOKEN_PATH, load_script

from torchtitan.data.tokenizer import (
    MAX_RUN_CHARS,
    SentencePieceTokenizer,
    TikTokenizer,
    Tokenizer,
    _encode_chunks,
    _split_long_runs,
    build_tokenizer,
    llama3_special_tokens,
    read_tiktoken_ranks,
)
from torchtitan.errors import ConfigError


@pytest.fixture(scope="module")
def tt() -> TikTokenizer:
    return TikTokenizer(TIKTOKEN_PATH)


@pytest.fixture(scope="module")
def sp() -> SentencePieceTokenizer:
    return SentencePieceTokenizer(SENTENCEPIECE_PATH)


@pytest.fixture(scope="module", params=["tiktoken", "sentencepiece"])
def tok(request, tt, sp) -> Tokenizer:
    return tt if request.param == "tiktoken" else sp


TEXTS = {
    "empty": "",
    "ascii": "The quick brown fox jumps over the lazy dog. It's 2024; isn't it?",
    "code": 'def f(x: int) -> int:\n    """Doc."""\n    return x ** 2  # square\n',
    "unicode": "naïve café, Ελληνικά, русский, 日本語のテキスト, עברית, हिन्दी",
    "emoji": "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷 and ✔︎",
    "whitespace": "  lead\t\ttabs \n\n\n  trailing   \r\n\x0b\x0cend   ",
    "only_spaces": "        ",
    "newlines": "\n" * 50,
    "numbers": "3.14159 1234567890 0x1F 1e-9 -42",
    "control": "nul\x00 bell\x07 del\x7f",
    "special_text": "<|begin_of_text|>hi<|end_of_text|> <s> </s> <unk> <|eot_id|>",
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text, bos=False, eos=False)
    assert all(isinstance(i, int) and 0 <= i < tok.n_words for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_with_bos_eos_decodes_plain_text(sp):
    # SentencePiece renders bos/eos as nothing; the text between them survives.
    text = TEXTS["ascii"]
    assert sp.decode(sp.encode(text, bos=True, eos=True)) == text


def _million_char_text() -> str:
    paragraph = "Tokenizers turn text into integers. Ünïcödé, 数字 123456, emoji 🚀 and\ttabs.\n\n"
    parts = [paragraph * 5000, " " * 100_000, "x" * 60_000, "\n" * 30_000, "é" * 40_000]
    text = "".join(parts)
    text += paragraph * ((1_000_000 - len(text)) // len(paragraph) + 1)
    return text[:1_000_000]


def test_round_trip_one_million_chars(tok):
    text = _million_char_text()
    assert len(text) == 1_000_000
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text


@pytest.mark.parametrize("char", [" ", "a", "\n", "😀"])
def test_tiktoken_long_runs(tt, char):
    text = char * 300_000
    assert tt.decode(tt.encode(text, bos=False, eos=False)) == text


def test_split_long_runs():
    text = "ab" + " " * 10 + "cdefghij" + "\n\n" + "k"
    pieces = list(_split_long_runs(text, 3))
    assert "".join(pieces) == text
    for piece in pieces:
        run = longest = 0
        for a, b in zip(" " + piece, piece):
            run = run + 1 if a.isspace() == b.isspace() else 1
            longest = max(longest, run)
        assert longest <= 3
    assert list(_split_long_runs("short text", 5)) == ["short text"]
    assert list(_split_long_runs("", 3)) == []


def test_chunking_is_invisible_on_ordinary_text(tt):
    text = TEXTS["ascii"] + TEXTS["unicode"] + " " * MAX_RUN_CHARS
    assert list(_encode_chunks(text)) == [text]
    assert tt.encode(text, bos=False, eos=False) == tt._model.encode_ordinary(text)


def test_bos_eos(tok):
    body = tok.encode("hello world", bos=False, eos=False)
    assert body and tok.bos_id not in body and tok.eos_id not in body
    assert tok.encode("hello world", bos=True, eos=False) == [tok.bos_id, *body]
    assert tok.encode("hello world", bos=False, eos=True) == [*body, tok.eos_id]
    assert tok.encode("hello world", bos=True, eos=True) == [tok.bos_id, *body, tok.eos_id]
    assert tok.encode("", bos=True, eos=True) == [tok.bos_id, tok.eos_id]
    assert tok.encode("", bos=False, eos=False) == []


def test_tiktoken_ids(tt):
    assert tt.n_words == 2000 + 256
    assert (tt.bos_id, tt.eos_id, tt.pad_id) == (2000, 2001, -1)
    assert tt.decode([tt.bos_id]) == "<|begin_of_text|>"
    assert tt.decode([tt.eos_id]) == "<|end_of_text|>"
    specials = tt.special_tokens
    assert len(specials) == 256
    assert sorted(specials.values()) == list(range(2000, 2256))
    assert specials["<|eot_id|>"] == 2009
    assert specials["<|python_tag|>"] == 2010
    assert specials["<|reserved_special_token_246|>"] == 2255


def test_llama3_special_token_order():
    tokens = llama3_special_tokens()
    assert len(tokens) == len(set(tokens)) == 256
    assert tokens[:11] == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    assert tokens[11] == "<|reserved_special_token_2|>"
    assert tokens[-1] == "<|reserved_special_token_246|>"


def test_sentencepiece_ids(sp):
    assert sp.n_words == 2000
    assert (sp.bos_id, sp.eos_id, sp.pad_id) == (1, 2, -1)
    assert sp._model.unk_id() == 0


@pytest.mark.parametrize(
    "text", ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "x<|python_tag|>y"]
)
def test_tiktoken_special_text_is_plain_text(tt, text):
    ids = tt.encode(text, bos=False, eos=False)
    assert all(i < 2000 for i in ids), ids
    assert len(ids) > 1
    assert tt.decode(ids) == text


@pytest.mark.parametrize("text", ["<s>", "</s>", "<unk>", "<s>hi</s>"])
def test_sentencepiece_special_text_is_plain_text(sp, text):
    ids = sp.encode(text, bos=False, eos=False)
    assert not {0, 1, 2} & set(ids), ids
    assert sp.decode(ids) == text


def test_autodetect(tmp_path):
    assert isinstance(build_tokenizer(str(TIKTOKEN_PATH)), TikTokenizer)
    assert isinstance(build_tokenizer(str(SENTENCEPIECE_PATH)), SentencePieceTokenizer)
    # The kind comes from the content, not the name.
    shutil.copy(TIKTOKEN_PATH, tmp_path / "tokenizer.model")
    shutil.copy(SENTENCEPIECE_PATH, tmp_path / "bpe.tiktoken")
    assert isinstance(build_tokenizer(str(tmp_path / "tokenizer.model")), TikTokenizer)
    assert isinstance(build_tokenizer(tmp_path / "bpe.tiktoken"), SentencePieceTokenizer)


def test_autodetect_crlf_and_partial_sniff(tmp_path, monkeypatch, tt):
    import torchtitan.data.tokenizer as tokenizer_module

    path = tmp_path / "tokenizer.model"
    path.write_bytes(TIKTOKEN_PATH.read_bytes().replace(b"\n", b"\r\n"))
    monkeypatch.setattr(tokenizer_module, "_SNIFF_BYTES", 100)  # only the file's start is read
    tok = build_tokenizer(path)
    assert isinstance(tok, TikTokenizer)
    text = TEXTS["ascii"]
    assert tok.encode(text, bos=True, eos=True) == tt.encode(text, bos=True, eos=True)


def test_error_file_too_large(tmp_path, monkeypatch):
    import torchtitan.data.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "_MAX_TOKENIZER_BYTES", 1000)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 1001)
    assert "too large" in _assert_config_error(path)


def _assert_config_error(path) -> str:
    with pytest.raises(ConfigError) as info:
        build_tokenizer(str(path))
    message = str(info.value)
    assert "model.tokenizer_path" in message
    assert str(path) in message
    assert "\n" not in message
    return message


def test_error_missing_file(tmp_path):
    assert "does not exist" in _assert_config_error(tmp_path / "nope.model")


def test_error_directory(tmp_path):
    assert "directory" in _assert_config_error(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        bytes(range(256)) * 10,
        b"",
        b"hello world\n",
        "not base64 at all é\n".encode(),
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 100,
    ],
    ids=["binary", "empty", "text", "utf8-text", "png"],
)
def test_error_unrecognised_file(tmp_path, content):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    message = _assert_config_error(path)
    assert "neither a tiktoken BPE file nor a SentencePiece model" in message
    assert "download_tokenizer.py" in message


def test_error_malformed_bpe_file(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"YQ== 0\nYQ== 1\n")  # the same token twice
    message = _assert_config_error(path)
    assert "tiktoken" in message


def test_error_bpe_line_past_the_sniffed_start_is_named(tmp_path):
    # the start reads as a BPE file; line 8001, far past the sniffed bytes, does not
    lines = [base64.b64encode(b"tok%05d" % i) + b" %d" % i for i in range(8000)]
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\n".join([*lines, b"dG9r 8000 extra"]) + b"\n")
    assert "line 8001 'dG9r 8000 extra' is not '<base64 token> <rank>'" in _assert_config_error(
        path
    )


def _write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))


def test_tiktoken_file_is_read_from_disk_not_from_a_cache(tmp_path, monkeypatch):
    """Two checkouts hold different files at one relative path: each load reads its own file, as
    the fingerprint does (tiktoken's caching loader returned the first one read at that path)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))
    full = read_tiktoken_ranks(TIKTOKEN_PATH)
    small = {t: r for t, r in full.items() if r < 1000}  # merges of lower ranks: a valid BPE
    _write_ranks(tmp_path / "one" / "tok" / "tokenizer.model", full)
    _write_ranks(tmp_path / "two" / "tok" / "tokenizer.model", small)
    seen = {}
    for checkout in ("one", "two", "one"):
        monkeypatch.chdir(tmp_path / checkout)
        tok = build_tokenizer("tok/tokenizer.model")
        digest = hashlib.sha256(Path("tok/tokenizer.model").read_bytes()).hexdigest()
        assert tok.fingerprint()["sha256"] == digest
        seen.setdefault(checkout, []).append(
            (tok.n_words, tok.encode(TEXTS["code"], bos=False, eos=False))
        )
    assert seen["one"][0][0] == 2000 + 256 and seen["two"][0][0] == 1000 + 256
    assert seen["one"][0] == seen["one"][1]
    assert max(seen["two"][0][1]) < 1000 < max(seen["one"][0][1])


def test_no_code_reads_tokenizers_through_tiktokens_cache():
    """tiktoken.load.load_tiktoken_bpe caches by path string; the library and scripts read the
    file themselves (read_tiktoken_ranks)."""
    users = [
        str(p.relative_to(ROOT))
        for folder in ("torchtitan", "scripts", "benchmarks")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "load_tiktoken_bpe(" in p.read_text(encoding="utf-8")
    ]
    assert users == []


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read any file"
)
def test_error_unreadable_file(tmp_path):
    path = tmp_path / "tokenizer.model"
    shutil.copy(TIKTOKEN_PATH, path)
    path.chmod(0)
    try:
        assert "cannot read" in _assert_config_error(path)
    finally:
        path.chmod(0o644)


def test_error_unreadable_file_simulated(tmp_path, monkeypatch):
    import torchtitan.data.tokenizer as tokenizer_module

    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    path = tmp_path / "tokenizer.model"
    shutil.copy(TIKTOKEN_PATH, path)
    monkeypatch.setattr(tokenizer_module, "open", deny, raising=False)
    assert "cannot read" in _assert_config_error(path)


# ---------------------------------------------------------------------------------------------
# scripts/build_test_tokenizers.py and the committed assets
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build_script():
    return load_script("build_test_tokenizers")


def test_tiktoken_asset_ranks(tt):
    ranks = read_tiktoken_ranks(TIKTOKEN_PATH)
    assert sorted(ranks.values()) == list(range(2000))
    for b in range(256):
        assert ranks[bytes([b])] == b
    for token, rank in ranks.items():
        if rank < 256:
            continue
        # Every learned token joins two lower-ranked tokens ...
        assert any(
            ranks.get(token[:k], rank) < rank and ranks.get(token[k:], rank) < rank
            for k in range(1, len(token))
        ), token
        # ... and tiktoken's rank-ordered merging rebuilds it from its bytes.
        assert tt._model._encode_bytes(token) == [rank], token


def test_sentencepiece_asset_settings():
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(SENTENCEPIECE_PATH.read_bytes())
    spec = proto.trainer_spec
    assert spec.model_type == pb.TrainerSpec.BPE
    assert spec.vocab_size == len(proto.pieces) == 2000
    assert spec.byte_fallback
    assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (0, 1, 2, -1)
    assert proto.normalizer_spec.name == "identity"


def test_train_bpe_small_corpus(build_script):
    counts = build_script.pretokenize(["low lower lowest newer newest wider widest"] * 3)
    ranks = build_script.train_bpe(counts, 270)
    assert len(ranks) == 270
    assert sorted(ranks.values()) == list(range(270))
    learned = sorted(ranks, key=ranks.get)[256:]
    assert len(set(learned)) == len(learned)
    assert b" lo" in learned
    for token in learned:
        assert any(
            ranks.get(token[:k], 270) < ranks[token] and ranks.get(token[k:], 270) < ranks[token]
            for k in range(1, len(token))
        )
    with pytest.raises(ValueError, match="corpus too small"):
        build_script.train_bpe(counts, 5000)


# ---------------------------------------------------------------------------------------------
# scripts/download_tokenizer.py
# ---------------------------------------------------------------------------------------------

REPO = "meta-llama/Meta-Llama-3.1-8B"


@pytest.fixture()
def dl(monkeypatch):
    return load_download_script(monkeypatch, "download_tokenizer")


@pytest.mark.parametrize(
    "argv",
    [
        ["--repo_id", ""],
        ["--repo_id", "   "],
        ["--repo_id", "no-slash"],
        ["--repo_id", "a/b/c"],
        ["--repo_id", "/name"],
        ["--repo_id", "owner/"],
        ["--repo_id", "own er/name"],
        ["--repo_id", "owner/na..me"],
        [],
    ],
)
def test_download_bad_arguments(dl, capsys, argv):
    with pytest.raises(SystemExit) as info:
        dl.main([*argv, "--hf_token", SECRET])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "--repo_id" in err
    assert SECRET not in out + err


def test_repo_filename(dl):
    assert dl.repo_filename("original") == "original/tokenizer.model"
    assert dl.repo_filename("original/") == "original/tokenizer.model"
    assert dl.repo_filename("") == "tokenizer.model"


def test_download_passes_arguments(dl, monkeypatch, capsys, tmp_path):
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        return str(Path(kwargs["local_dir"]) / kwargs["filename"])

    monkeypatch.setattr(dl, "hf_hub_download", fake)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert dl.main(["--repo_id", REPO, "--local_dir", str(tmp_path)]) == 0
    assert calls[-1] == {
        "repo_id": REPO,
        "filename": "original/tokenizer.model",
        "local_dir": str(tmp_path),
        "token": SECRET,
    }
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "original" / "tokenizer.model")
    assert SECRET not in out + err

    assert dl.main(["--repo_id", REPO, "--hf_token", "other", "--tokenizer_path", ""]) == 0
    assert calls[-1]["token"] == "other"
    assert calls[-1]["filename"] == "tokenizer.model"
    assert calls[-1]["local_dir"] == "assets/tokenizer/"

    monkeypatch.delenv("HF_TOKEN")
    assert dl.main(["--repo_id", REPO]) == 0
    assert calls[-1]["token"] is None


def test_download_never_echoes_exception_text(dl, monkeypatch, capsys):
    def fake(**kwargs):
        raise RuntimeError(f"something went wrong with token {kwargs['token']}")

    monkeypatch.setattr(dl, "hf_hub_download", fake)
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET]) == 1
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert err.startswith("download_tokenizer.py: error:") and err.count("\n") == 1


def test_download_local_write_error(dl, monkeypatch, capsys):
    def fake(**kwargs):
        raise PermissionError(13, "Permission denied", "/readonly/original/tokenizer.model")

    monkeypatch.setattr(dl, "hf_hub_download", fake)
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET]) == 1
    err = capsys.readouterr().err
    assert "Permission denied" in err and "/readonly/original/tokenizer.model" in err


class FakeHub:
    """A stand-in for the Hub behind huggingface_hub's real HTTP client (a mock transport), so
    the real ``hf_hub_download`` runs and raises its real exceptions."""

    def __init__(self, respond):
        import huggingface_hub
        from huggingface_hub.utils import _http

        if not hasattr(huggingface_hub, "set_client_factory"):
            pytest.skip("this huggingface_hub has no set_client_factory")
        http = sys.modules[type(_http.get_session()).__module__.split(".")[0]]
        if not hasattr(http, "MockTransport"):
            pytest.skip("huggingface_hub's HTTP library has no MockTransport")
        self.http = http
        self.requests = []
        self._respond = respond
        self._previous_factory = _http._GLOBAL_CLIENT_FACTORY
        huggingface_hub.set_client_factory(
            lambda: http.Client(transport=http.MockTransport(self._handle), follow_redirects=True)
        )

    def close(self) -> None:
        import huggingface_hub

        huggingface_hub.set_client_factory(self._previous_factory)

    def _handle(self, request):
        if "/resolve/" not in request.url.path:  # side requests the library may make
            return self.response(404, request)
        self.requests.append(request)
        return self._respond(self, request)

    def response(self, status, request, headers=None, content=b""):
        return self.http.Response(status, headers=headers or {}, content=content, request=request)


@pytest.fixture()
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("time.sleep", lambda seconds: None)  # the library's retry backoff
    hubs = []

    def make(respond):
        hubs.append(FakeHub(respond))
        return hubs[-1]

    yield make
    for hub in hubs:
        hub.close()


def _error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("download_tokenizer.py:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("status", [401, 403])
def test_download_gated(dl, fake_hub, capsys, tmp_path, status):
    hub = fake_hub(
        lambda hub, req: hub.response(
            status, req, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}
        )
    )
    argv = ["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path)]
    assert dl.main(argv) == 1
    line = _error_line(capsys)
    assert "gated" in line and "licence" in line and f"https://huggingface.co/{REPO}" in line
    assert hub.requests[0].headers["authorization"] == f"Bearer {SECRET}"


def test_download_forbidden_token(dl, fake_hub, capsys, tmp_path):
    # A plain 403 (a fine-grained token without access to gated repositories, say).
    fake_hub(lambda hub, req: hub.response(403, req, {"X-Error-Message": "Forbidden"}))
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path)]) == 1
    line = _error_line(capsys)
    assert "gated" in line and "token" in line


@pytest.mark.parametrize("status", [401, 404])
def test_download_repo_not_found(dl, fake_hub, capsys, tmp_path, status):
    fake_hub(lambda hub, req: hub.response(status, req, {"X-Error-Code": "RepoNotFound"}))
    argv = ["--repo_id", "nobody/no-such-model", "--local_dir", str(tmp_path)]
    assert dl.main(argv) == 1
    line = _error_line(capsys)
    assert "nobody/no-such-model" in line and "not found" in line
    assert "--hf_token" in line  # no token was given: say how to pass one


def test_download_file_not_found(dl, fake_hub, capsys, tmp_path):
    fake_hub(lambda hub, req: hub.response(404, req, {"X-Error-Code": "EntryNotFound"}))
    argv = ["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path)]
    argv += ["--tokenizer_path", "nope"]
    assert dl.main(argv) == 1
    line = _error_line(capsys)
    assert "nope/tokenizer.model" in line and REPO in line and "--tokenizer_path" in line


def test_download_network_error(dl, fake_hub, capsys, tmp_path):
    def respond(hub, request):
        raise hub.http.ConnectError("[Errno -2] Name or service not known", request=request)

    hub = fake_hub(respond)
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path)]) == 1
    line = _error_line(capsys)
    assert "could not be reached" in line
    assert len(hub.requests) > 1  # the library retried before giving up


def test_download_server_error(dl, fake_hub, capsys, tmp_path):
    fake_hub(lambda hub, req: hub.response(503, req))
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path)]) == 1
    line = _error_line(capsys)
    assert "HTTP 503" in line and "try again later" in line


def test_download_success(dl, fake_hub, capsys, tmp_path):
    content = TIKTOKEN_PATH.read_bytes()
    etag = hashlib.sha256(content).hexdigest()

    def respond(hub, request):
        assert request.url.path == f"/{REPO}/resolve/main/original/tokenizer.model"
        headers = {
            "ETag": f'"{etag}"',
            "X-Repo-Commit": "0123456789abcdef0123456789abcdef01234567",
            "Content-Length": str(len(content)),
        }
        return hub.response(200, request, headers, b"" if request.method == "HEAD" else content)

    fake_hub(respond)
    assert dl.main(["--repo_id", REPO, "--hf_token", SECRET, "--local_dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    path = Path(out.strip().splitlines()[-1])
    assert path == tmp_path / "original" / "tokenizer.model"
    assert path.read_bytes() == content
    assert isinstance(build_tokenizer(str(path)), TikTokenizer)
