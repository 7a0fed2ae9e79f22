"""Tokenizer of a Hugging Face model directory, without transformers.

``tokenizer.json`` is run by the ``tokenizers`` library (its post-processor decides whether BOS is
added); ``tokenizer_config.json`` supplies the special tokens and the chat template, which is
rendered in a sandboxed jinja2 environment the way transformers renders it (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``, ``{% generation %}``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from jinja2 import nodes
from jinja2.parser import Parser
from tokenizers.decoders import DecodeStream

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (it raised, or the model has no template)."""


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text, for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        cfg = tokenizer_config or {}
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = cfg.get(key)
            if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
                value = value.get("content")
            if isinstance(value, str):
                self.special_tokens[key] = value
        self.chat_template = chat_template
        eos_ids: list[int] = []
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := backend.token_to_id(eos)) is not None:
            eos_ids.append(eos_id)
        eos_ids.extend(int(i) for i in extra_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(eos_ids))
        # The added tokens marked special: those decode(skip_special_tokens=True) leaves out.
        self.special_token_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, the chat template and generation_config EOS ids."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: Yutu needs a fast-tokenizer tokenizer.json in the model directory "
                "(save one with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg = _read_json(path / "tokenizer_config.json") or {}
        template = _chat_template(path, cfg)
        gen = _read_json(path / "generation_config.json") or {}
        extra_eos = gen.get("eos_token_id")
        if extra_eos is None:
            extra_eos = []
        elif isinstance(extra_eos, int):
            extra_eos = [extra_eos]
        return cls(backend, cfg, template, extra_eos)

    # -- ids ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The eos_token of tokenizer_config.json, then generation_config.json's eos_token_id(s)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- text -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; add_special_tokens applies tokenizer.json's post-processor (BOS...)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid or incomplete UTF-8 becomes U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template (or ``chat_template``, a request's) into
        prompt text.

        The text already holds the template's special tokens (BOS included where the template adds
        it), so encode it with ``add_special_tokens=False`` -- or call ``encode_chat``. Extra keyword
        arguments (``tools``, ``documents``, ``enable_thinking``, ...) become template variables.
        ``continue_final_message``: the text ends with the last message's content, left open for the
        model to continue (what the template puts after it is cut, as transformers does). Raises
        ChatTemplateError.
        """
        if chat_template is None and self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json has no chat_template): "
                "use the completions API with a plain prompt, or add a template to the model directory"
            )
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        template = self._compiled_template if chat_template is None else _compiled(chat_template)
        try:
            text = template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if not continue_final_message:
            return text
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ChatTemplateError("continue_final_message needs a last message with text to continue")
        for content in (final, final.strip()):  # a template may trim the content
            if content in text:
                return text[: text.rindex(content) + len(content)]
        raise ChatTemplateError(
            "continue_final_message is set, but the chat template does not show the last message's text"
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt (special tokens come from the template only)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        return _compiled(self.chat_template)


@lru_cache(maxsize=16)  # requests' own templates: a client tends to send one again and again
def _compiled(source: str) -> jinja2.Template:
    """``source`` compiled in the sandboxed environment; ChatTemplateError if it does not parse."""
    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas, never emitting half a character.

    The fast path: the ``tokenizers`` library's streaming decoder (``DecodeStream``, seeded with a
    few prompt ids of context so the first delta decodes as it would mid-text -- SentencePiece drops
    the leading space of a decode's first token), about 15x cheaper per token than decoding a window
    twice in Python (:class:`ReferenceDetokenizer`, which it agrees with delta for delta). It holds
    ids back while they end in an incomplete character; ``flush`` emits what is held back at the end
    of the stream (incomplete bytes become U+FFFD). For a prompt that ends on a character boundary,
    the concatenated deltas plus ``flush()`` equal ``tokenizer.decode(generated_ids)``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-5:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._emitted: list[int] = context  # the last ids whose text is out (flush decodes after them)
        self._held: list[int] = []  # ids pushed since the last delta
        self.token_ids: list[int] = []  # every generated id pushed so far

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly completed text ('' while a character is incomplete)."""
        ids = list(new_ids)
        if not ids:
            return ""
        self.token_ids.extend(ids)
        self._held.extend(ids)
        text = self._stream.step(self.tokenizer.backend, ids)
        if text is None:
            return ""
        self._emitted, self._held = self._held, []
        return str(text)

    def flush(self) -> str:
        """Emit held-back text at the end of the stream (incomplete bytes become U+FFFD)."""
        if not self._held:
            return ""
        decode = self.tokenizer.decode
        before = decode(self._emitted, self.skip_special_tokens)
        after = decode(self._emitted + self._held, self.skip_special_tokens)
        self._emitted, self._held = self._held, []
        return after[len(before) :]


class ReferenceDetokenizer:
    """The plain reference of :class:`IncrementalDetokenizer` (tests check the two agree).

    Each ``push`` decodes a short window of recent ids twice (with and without the new ones) and
    emits the difference, unless the new text ends in U+FFFD (an incomplete UTF-8 sequence or a
    partial piece): then it waits for more ids. ``flush`` emits whatever is held back. For a prompt
    that ends on a character boundary, the concatenated deltas plus ``flush()`` equal
    ``tokenizer.decode(generated_ids)``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens of context so the first delta decodes as it would mid-text
        # (SentencePiece drops the leading space of the first token of a decode).
        self._ids: list[int] = list(prompt_ids[-5:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids before this are already emitted
        self.token_ids: list[int] = []  # every generated id pushed so far

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly completed text ('' while a character is incomplete)."""
        self.token_ids.extend(new_ids)
        self._ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit held-back text at the end of the stream (incomplete bytes become U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""  # nothing complete yet: wait for the ids that finish the character
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def _chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json, or tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = (_read_json(path / "chat_template.json") or {}).get("chat_template") or cfg.get(
        "chat_template"
    )
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text in training): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
