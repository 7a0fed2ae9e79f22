"""Tool calls in a model's free text, for ``tool_choice: "auto"``: one parser per model family.

With ``auto`` the model itself chooses between answering and calling, in the format its chat
template taught it, so the gateway must be told the format (``--tool-call-parser``, as vLLM's
flag of the same name):

- ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3 and others): calls are ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks after any text;
- ``llama3_json`` (Llama 3.1-3.3 with their JSON tool template): the whole answer is one call
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), after an optional
  ``<|python_tag|>``.

A parser reads a choice's whole text (:meth:`ToolCallParser.parse`); streamed, the text before
the point where a call may begin goes out as content as it comes (:meth:`ToolCallParser.content_end`)
and the rest is held until the choice ends. Text that starts like a call but does not parse as
one is content, whole, as the model wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolCallParser:
    """A model family's tool-call format."""

    name: ClassVar[str]

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        """(the content before the calls, the calls) when ``text`` holds calls, else None."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of ``text`` (a prefix of a choice's output) is surely content, whatever follows."""
        raise NotImplementedError


def _call(item: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolCallParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        first = text.find(self.START)
        if first < 0:
            return None
        calls, at = [], first
        while at >= 0:
            end = text.find(self.END, at)
            if end < 0:
                return None  # a call cut short (max_tokens): the text is all there is
            try:
                call = _call(json.loads(text[at + len(self.START) : end]), "arguments")
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
            after = end + len(self.END)
            at = text.find(self.START, after)
            if text[after : at if at >= 0 else len(text)].strip():
                return None  # text between or after the calls: not this format (nothing is dropped)
        return text[:first], calls

    def content_end(self, text: str) -> int:
        first = text.find(self.START)
        if first >= 0:
            return first
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):  # a start tag coming in pieces
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]] | None:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return None
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                item, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return None
            call = _call(item, "parameters" if "parameters" in item else "arguments")
            if call is None:
                return None
            calls.append(call)
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            at = len(body) - len(rest.removeprefix(";").lstrip())
        return "", calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[: len(self.TAG)]):
            return 0  # could still be a call: hold it all
        return len(text)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


@cache
def parser_named(name: str | None) -> ToolCallParser | None:
    """The parser of ``--tool-call-parser`` (stateless: one for the gateway), or None."""
    return None if name is None else PARSERS[name]()
