"""Conversations as training documents: rendered with the tokenizer's chat template, predicted on
the assistant turns only.

A conversation is a row whose field holds a list of messages, each a mapping with a ``role`` and
usually a ``content`` (``{"messages": [{"role": "user", "content": "..."}, ...]}``, the layout of
Hugging Face chat datasets).

Rendering
    The template is rendered as ``transformers``' ``apply_chat_template`` renders it (5.x,
    ``utils/chat_template_utils.py``): Jinja's ``ImmutableSandboxedEnvironment`` with
    ``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols`` extension; a ``tojson`` filter that
    is ``json.dumps`` (``ensure_ascii=False``); the globals ``raise_exception``, ``strftime_now``,
    ``dict`` and ``namespace``; the variables ``messages``, ``add_generation_prompt`` (false:
    training renders whole conversations), ``tools`` and ``documents`` (none) and the tokenizer's
    special-token texts (``bos_token``, ``eos_token``, ...). As there, a message's reasoning under
    ``reasoning_content``, ``thinking`` or ``reasoning`` is given to the template under the first
    two names. A key whose value is null is left out of its message: a JSON-lines file read
    through Arrow gives every message every key any message has, null where it had none, and a
    template's ``is defined`` test must see the message as written.

Tokens
    The rendering is encoded the way ``apply_chat_template(tokenize=True)`` encodes it: the whole
    text at once, with no BOS or EOS added (the template writes the ones it wants), and the
    template's special-token text (``<|im_start|>``) read as special tokens. Only here: the text of
    ordinary documents never becomes control tokens.

Labels
    A token is predicted when its characters overlap an assistant span of the rendering (the
    rule of ``transformers``' ``return_assistant_tokens_mask``):
    - a template with ``{% generation %}`` blocks marks the spans itself, as ``transformers``'
      ``return_assistant_tokens_mask`` reads them;
    - otherwise assistant message ``i``'s span runs from the end of
      ``render(messages[:i], add_generation_prompt=True)`` (the prompt that asks for it) to the
      end of ``render(messages[:i + 1])`` (its text, end-of-turn token and what the template
      writes after it). Both renderings must begin the whole conversation's; a template that
      renders earlier turns differently once later ones follow (Qwen3's drops the reasoning of
      turns before the last user message) stops with one line asking for ``{% generation %}``
      blocks.

Where the template comes from
    ``training.chat_template`` when set: a ``.jinja`` file, a ``tokenizer_config.json`` or a
    folder holding either. Otherwise the tokenizer's folder: ``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{name, template}``
    whose ``default`` is taken), the order ``transformers`` reads them in.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from torchtitan.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    """A conversation that cannot be rendered or labelled; the reader adds which row it is."""


def is_conversation(value: Any) -> bool:
    """Whether a row's field holds a conversation: a non-empty list of mappings."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


# ---- finding the template


def _template_of_config(path: str, key: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read '{path}' as JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(
                f"{key}: '{path}' lists chat templates {sorted(map(str, named))} but none named "
                "'default'; point training.chat_template at the .jinja file to use"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{key}: the chat_template of '{path}' is not a string")
    return template


def _template_in(folder: str, key: str) -> tuple[str, str] | None:
    jinja = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        return _read_text(jinja, key), jinja
    config = os.path.join(folder, CONFIG_FILE)
    if os.path.isfile(config):
        template = _template_of_config(config, key)
        if template is not None:
            return template, config
    return None


def _read_text(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read '{path}' ({e})") from None


def find_chat_template(tokenizer_path: str, override: str | None, key: str) -> tuple[str, str]:
    """``(template, where it came from)``: ``override`` (see the module docstring), else the
    tokenizer's folder; a one-line ConfigError naming ``key`` when there is none."""
    if override:
        if os.path.isdir(override):
            found = _template_in(override, key)
            if found is None:
                raise ConfigError(
                    f"{key}: folder '{override}' holds no {TEMPLATE_FILE} and no {CONFIG_FILE} "
                    "with a chat_template"
                )
            return found
        if not os.path.isfile(override):
            raise ConfigError(
                f"{key}: '{override}' does not exist; give a .jinja file, a {CONFIG_FILE} or a "
                "folder holding one"
            )
        if override.endswith(".json"):
            template = _template_of_config(override, key)
            if template is None:
                raise ConfigError(f"{key}: '{override}' has no chat_template")
            return template, override
        return _read_text(override, key), override
    folder = os.path.dirname(os.path.abspath(tokenizer_path))
    found = _template_in(folder, key)
    if found is None:
        raise ConfigError(
            f"{key}: conversations need a chat template, and the tokenizer's folder '{folder}' "
            f"has none (no {TEMPLATE_FILE}, no chat_template in {CONFIG_FILE}); set {key} to a "
            ".jinja file (a base model's tokenizer usually has no template)"
        )
    return found


# ---- rendering


def _environment() -> Any:
    """A Jinja environment configured as ``transformers`` configures the one it renders chat
    templates in, with a ``{% generation %}`` tag that records where its output lands."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(jinja2.ext.Extension):
        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.output: list[str] | None = None  # the pieces rendered so far, while recording
            self.spans: list[tuple[int, int]] = []
            environment.extend(generation_spans=self)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_record")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            if self.output is not None:
                start = sum(map(len, self.output))
                self.spans.append((start, start + len(text)))
            return text

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is private")

    class Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationSpans, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=Dict(),
        namespace=Namespace,
    )
    return env


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: null keys left out, reasoning under its names."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template and the special-token texts it is rendered with."""

    def __init__(self, source: str, origin: str, variables: dict[str, str]) -> None:
        import jinja2

        self.origin, self.variables = origin, dict(variables)
        self.marks_generation = _GENERATION_TAG.search(source) is not None
        self._env = _environment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError(
                f"chat template '{origin}': line {e.lineno}: {e.message}; fix the template"
            ) from None

    def render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
    ) -> str:
        return self._render(messages, add_generation_prompt, record=False)[0]

    def _render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, record: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2

        tracker = self._env.generation_spans
        pieces: list[str] = []
        tracker.output, tracker.spans = (pieces if record else None), []
        try:
            for piece in self._template.generate(
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            ):
                pieces.append(piece)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the chat template '{self.origin}' failed: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # Jinja passes the template's Python errors through: a message's content that is
            # a list of parts where the template adds strings, say
            raise ChatError(
                f"the chat template '{self.origin}' failed: {type(e).__name__}: {e} (do the "
                "messages have the fields and types this template expects?)"
            ) from None
        finally:
            tracker.output = None
        return "".join(pieces), list(tracker.spans)

    def assistant_spans(
        self, messages: Sequence[dict[str, Any]]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's rendering and the character spans of its assistant turns
        (see the module docstring)."""
        if self.marks_generation:
            return self._render(messages, False, record=True)
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True)
            tail = self.render(messages[: i + 1])
            if not (text.startswith(head) and text.startswith(tail) and len(head) <= len(tail)):
                raise ChatError(
                    f"the chat template '{self.origin}' renders the turns before message {i} "
                    "(assistant) differently once later messages follow, so its span cannot be "
                    "found by rendering the conversation up to it; use a template that marks "
                    "assistant text with {% generation %} ... {% endgeneration %}"
                )
            spans.append((len(head), len(tail)))
        return text, spans


# ---- encoding


class ChatEncoder:
    """Conversations -> token ids and the positions that are not predicted.

    Built from the tokenizer (which must read special-token text in a rendering:
    ``encode_rendered``) and ``template`` (``training.chat_template``, or None for the
    tokenizer's own; ``key`` names the setting in messages). The template is found and compiled
    on first use, so a run without conversations never needs one.
    """

    def __init__(self, tokenizer: Any, template: str | None, key: str) -> None:
        self.tokenizer, self._override, self.key = tokenizer, template, key
        self._template: ChatTemplate | None = None

    @property
    def loaded(self) -> ChatTemplate | None:
        """The template, if a conversation has needed it yet."""
        return self._template

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            tok = self.tokenizer
            if not hasattr(tok, "encode_rendered"):
                raise ConfigError(
                    f"model.tokenizer_path: conversations need a Hugging Face tokenizer.json or "
                    f"a tiktoken model (to read the template's special tokens); "
                    f"{type(tok).__name__} '{getattr(tok, 'path', '?')}' is neither"
                )
            source, origin = find_chat_template(tok.path, self._override, self.key)
            self._template = ChatTemplate(source, origin, tok.template_variables())
        return self._template

    def encode(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[list[int]]]:
        """``(ids, not predicted)``: the conversation's token ids and the ``[start, stop)`` runs
        of positions whose token is not a target (everything outside the assistant spans)."""
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ChatError(f"message {i} has no 'role' string (keys: {sorted(m)})")
        msgs = template_messages(messages)
        text, spans = self.template.assistant_spans(msgs)
        ids, offsets = self.tokenizer.encode_rendered(text)
        return ids, not_predicted_runs(offsets, spans)


def not_predicted_runs(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[list[int]]:
    """The ``[start, stop)`` runs of tokens (``offsets``: their ``(start, end)`` characters, in
    order) that overlap no span."""
    runs: list[list[int]] = []
    k, spans = 0, sorted(spans)
    for j, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k < len(spans) and end > spans[k][0]:
            continue  # predicted
        if runs and runs[-1][1] == j:
            runs[-1][1] = j + 1
        else:
            runs.append([j, j + 1])
    return runs
