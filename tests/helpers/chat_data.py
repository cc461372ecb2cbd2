"""Chat test data: a ChatML tokenizer folder and conversations.

``chatml_folder(dest)`` is the project's test tiktoken tokenizer exported to a Hugging Face
folder, with ChatML's special tokens added (``<|im_start|>``, ``<|im_end|>``; ``<think>`` and
``</think>`` as ordinary added tokens, as Qwen3's tokenizer has them), EOS ``<|im_end|>`` and a
chat template from ``tests/assets/chat`` in its ``tokenizer_config.json``: what
``AutoTokenizer.from_pretrained`` reads, and what our ``HuggingFaceTokenizer`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from repo_paths import ASSETS, TIKTOKEN_PATH

from torchtitan.data.hf_tokenizer import write_tokenizer_files
from torchtitan.data.tokenizer import build_tokenizer

CHAT_ASSETS = ASSETS / "chat"
CHATML = CHAT_ASSETS / "chatml_think.jinja"
CHATML_GENERATION = CHAT_ASSETS / "chatml_think_generation.jinja"
LLAMA3_STYLE = CHAT_ASSETS / "llama3_style.jinja"


def chatml_folder(dest: Path, template: Path | None = CHATML) -> Path:
    """The ChatML tokenizer folder (see the module docstring); ``template`` None: no template."""
    from tokenizers import AddedToken, Tokenizer

    write_tokenizer_files(str(dest), build_tokenizer(str(TIKTOKEN_PATH)), 4096)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok.save(str(dest / "tokenizer.json"))
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<|im_end|>"
    if template is not None:
        config["chat_template"] = template.read_text()
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return dest


def chat_model_folder(tmp_path_factory) -> Path:
    """A Hub-like debug Llama folder (weights and config) with the ChatML tokenizer folder's
    files and chat template."""
    from hf_folders import write_model_folder

    tokenizer = chatml_folder(tmp_path_factory.mktemp("chatml"))
    return write_model_folder(tokenizer, tmp_path_factory.mktemp("chat-model"))


def conversation(i: int, *, reasoning_in_earlier_turns: bool = False) -> list[dict[str, Any]]:
    """Conversation ``i``: sometimes a system prompt, one to three exchanges, non-ASCII text; the
    last answer has reasoning in every other conversation (as ``reasoning_content`` or inline in
    ``<think>`` tags); with ``reasoning_in_earlier_turns`` every answer has some."""
    msgs: list[dict[str, Any]] = []
    if i % 3 == 0:
        msgs.append({"role": "system", "content": f"You are assistant n°{i}. Be brief."})
    turns = 1 + i % 3
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Q{i}.{t}: what is {i} + {t}? ✓"})
        answer = {"role": "assistant", "content": f"It is {i + t}." + " Indeed." * (i % 4)}
        last = t == turns - 1
        if reasoning_in_earlier_turns or (last and i % 2 == 1):
            if i % 4 == 1:
                answer["reasoning_content"] = f"add {i} and {t}"
            else:
                answer["content"] = f"<think>\nsum of {i} and {t}\n</think>\n\n" + answer["content"]
        msgs.append(answer)
    return msgs


def write_conversations(path: Path, convs: list[list[dict[str, Any]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in convs))
    return path
