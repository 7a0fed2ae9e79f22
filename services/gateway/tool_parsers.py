"""Tool calls in a model's free text, for ``tool_choice: "auto"``: one parser per model family.

With ``auto`` the model itself chooses between answering and calling, in the format its chat
template taught it, so the gateway must be told the format (``--tool-call-parser``, as vLLM's
flag of the same name):

- ``hermes`` (Hermes 2/3, Qwen2.5, Qwen3 and others): calls are ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks after any text;
- ``llama3_json`` (Llama 3.1-3.3 with their JSON tool template): the whole answer is one call
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), after an optional
  ``<|python_tag|>``;
- ``mistral`` (Mistral 7B v0.3, Mixtral, Mistral Nemo / Small / Large): calls follow the special
  token ``[TOOL_CALLS]``, as a JSON array ``[{"name": ..., "arguments": {...}}, ...]`` or, in newer
  tokenizers (v11 and up), as ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]``;
  call ids are nine letters and digits, which Mistral's chat templates require of the ids sent back;
- ``pythonic`` (Llama 3.2 and 4, and others taught Python's call syntax): the whole answer is a
  Python list of calls with keyword arguments of literal values,
  ``[weather(city="Oslo", days=2), now()]``, in Llama 4 between ``<|python_start|>`` and
  ``<|python_end|>``; read with ``ast``, never evaluated;
- ``granite`` (Granite 3.x): the whole answer is a JSON array of calls
  ``[{"name": ..., "arguments": {...}}, ...]``, after the special token ``<|tool_call|>`` (3.0)
  or the text ``<tool_call>`` (3.1 and up), or neither;
- ``phi4_mini_json`` (Phi-4-mini): calls are a JSON array after ``functools``,
  ``functools[{"name": ..., "arguments": {...}}]`` (``parameters`` for ``arguments`` read too),
  after any text;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): calls are XML-like blocks after any text,
  ``<tool_call><function=weather><parameter=city>Oslo</parameter></function></tool_call>`` (the
  ``<tool_call>`` wrapper optional, each value on lines of its own), whose values are text: each is
  read as the type the tool's schema gives its parameter (integer, number, boolean, object or array;
  ``null`` is null; a string, or a parameter the schema does not name, stays text), as vLLM reads them.

Where a format's markers are special tokens (``[TOOL_CALLS]``; ``<tool_call>`` in some Hermes
models), the text must keep them: with ``auto`` the choice is detokenized with
``skip_special_tokens`` false, whatever the request asked (vLLM does the same).

A parser reads a choice's whole text (:meth:`ToolCallParser.parse`); streamed, the text before
the point where a call may begin goes out as content as it comes (:meth:`ToolCallParser.content_end`)
and the rest is held until the choice ends. Text that starts like a call but does not parse as
one is content, whole, as the model wrote it.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, cast

if TYPE_CHECKING:
    from services.gateway.schemas import ToolSpec


def default_call_id() -> str:
    """A tool call's id where no model family asks for another form."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolCallParser:
    """A model family's tool-call format."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool] = True  # False: its markers may be special tokens, kept in the text

    def call_id(self) -> str:
        """A new tool call's id."""
        return default_call_id()

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
        """(the content before the calls, the calls) when ``text`` holds calls, else None;
        ``tools``: the request's (a format whose values are text reads them by their schema)."""
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


def partial_marker(text: str, marker: str) -> int:
    """Where ``text`` ends in the beginning of ``marker`` (a marker coming in pieces), else its length."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


class HermesParser(ToolCallParser):
    name = "hermes"
    skip_special_tokens = False  # Hermes 2 Pro and 3 (Llama 3 based) make <tool_call> a special token
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
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
        return first if first >= 0 else partial_marker(text, self.START)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
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


class MistralParser(ToolCallParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    ID_CHARACTERS = string.ascii_letters + string.digits

    def call_id(self) -> str:
        return "".join(secrets.choice(self.ID_CHARACTERS) for _ in range(9))

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
        first = text.find(self.START)
        if first < 0:
            return None
        rest = text[first + len(self.START) :].lstrip()
        calls: list[ParsedCall] = []
        if rest.startswith("["):  # a JSON array of calls (tokenizers before v11)
            try:
                items, end = json.JSONDecoder().raw_decode(rest)
            except json.JSONDecodeError:
                return None
            if not isinstance(items, list) or not items or rest[end:].strip():
                return None
            for item in items:
                call = _call(item, "arguments")
                if call is None:
                    return None
                calls.append(call)
        else:  # name[ARGS]{...}, each call after its own [TOOL_CALLS] (v11 and up)
            for part in text[first + len(self.START) :].split(self.START):
                name, args, arguments = part.partition(self.ARGS)
                if not args or not name.strip():
                    return None
                try:
                    value, end = json.JSONDecoder().raw_decode(arguments.strip())
                except json.JSONDecodeError:
                    return None
                call = _call({"name": name.strip(), "arguments": value}, "arguments")
                if call is None or arguments.strip()[end:].strip():
                    return None
                calls.append(call)
        return text[:first], calls

    def content_end(self, text: str) -> int:
        first = text.find(self.START)
        return first if first >= 0 else partial_marker(text, self.START)


def _call_array(body: str) -> list[ParsedCall] | None:
    """The calls of ``body``, a JSON array of ``{"name", "arguments" (or "parameters")}`` objects and
    nothing after it; None if it is not that."""
    try:
        items, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items or body[end:].strip():
        return None
    calls = [
        _call(i, "parameters" if isinstance(i, dict) and "parameters" in i else "arguments") for i in items
    ]
    return None if any(c is None for c in calls) else cast("list[ParsedCall]", calls)


class GraniteParser(ToolCallParser):
    name = "granite"
    skip_special_tokens = False  # Granite 3.0's <|tool_call|> is a special token
    MARKERS = ("<|tool_call|>", "<tool_call>")

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
        body = text.strip()
        for marker in self.MARKERS:
            body = body.removeprefix(marker).lstrip()
        if not body.startswith("["):
            return None
        calls = _call_array(body)
        return None if calls is None else ("", calls)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        for marker in self.MARKERS:
            if len(body) < len(marker) and marker.startswith(body):
                return 0  # the beginning of a marker: could still be a call
            body = body.removeprefix(marker).lstrip()
        return 0 if not body or body.startswith("[") else len(text)


class Phi4MiniJsonParser(ToolCallParser):
    name = "phi4_mini_json"
    START = "functools"

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
        first = text.find(self.START + "[")
        if first < 0:
            return None
        calls = _call_array(text[first + len(self.START) :])
        return None if calls is None else (text[:first], calls)

    def content_end(self, text: str) -> int:
        first = text.find(self.START + "[")
        return first if first >= 0 else partial_marker(text, self.START + "[")


class PythonicParser(ToolCallParser):
    name = "pythonic"
    skip_special_tokens = False  # Llama 4's <|python_start|> and <|python_end|> are special tokens
    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None  # a call by its bare name, keyword arguments only
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                if len(arguments) != len(node.keywords):
                    return None  # **kwargs
                calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None  # not a literal (a name, an expression), or no JSON for it (a set, bytes)
        return "", calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("[") or body.startswith(self.START) or self.START.startswith(body):
            return 0  # could still be a call: hold it all
        return len(text)


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"
    skip_special_tokens = False  # its markers may be special tokens
    START, FUNCTION = "<tool_call>", "<function="
    BLOCK = re.compile(
        r"\s*(?:<tool_call>\s*)?<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>)?", re.DOTALL
    )
    PARAMETERS = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def parse(self, text: str, tools: Sequence[ToolSpec] = ()) -> tuple[str, list[ParsedCall]] | None:
        first = self.content_end(text)
        if first == len(text):
            return None
        calls, at = [], first
        while at < len(text):
            block = self.BLOCK.match(text, at)
            if block is None:
                return None  # text between or after the calls, or a call cut short: all content
            name, body = block.group(1).strip(), block.group(2)
            schema = _parameters(tools, name)
            arguments = {}
            for parameter in self.PARAMETERS.finditer(body):
                key, value = parameter.group(1).strip(), parameter.group(2)
                value = value.removeprefix("\n").removesuffix("\n")  # each value on lines of its own
                arguments[key] = _typed(value, schema.get(key))
            if self.PARAMETERS.sub("", body).strip():
                return None  # something in the call that is no parameter
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
            at = block.end()
        return text[:first], calls

    def content_end(self, text: str) -> int:
        found = [i for i in (text.find(self.START), text.find(self.FUNCTION)) if i >= 0]
        if found:
            return min(found)
        return min(partial_marker(text, self.START), partial_marker(text, self.FUNCTION))


def _parameters(tools: Sequence[ToolSpec], name: str) -> dict[str, Any]:
    """The JSON schemas of function ``name``'s parameters, by parameter (empty where unknown)."""
    for tool in tools:
        if tool.function.name == name:
            properties = (tool.function.parameters or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the type its JSON schema names (vLLM's reading of Qwen3-Coder's
    values): text that does not read as that type stays text, as does a string's or an unknown
    parameter's; ``null`` is null whatever the type."""
    if value.lower() == "null":
        return None
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the type that is not null
        kind = next((k for k in kind if k != "null"), None)
    if kind is None or kind == "string":
        return value
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() and math.isfinite(number) else number
        if kind == "boolean":
            return value.strip().lower() == "true"
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return ast.literal_eval(value)  # Python's literals (single quotes, True), never run
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        MistralParser,
        PythonicParser,
        Qwen3CoderParser,
        GraniteParser,
        Phi4MiniJsonParser,
    )
}


@cache
def parser_named(name: str | None) -> ToolCallParser | None:
    """The parser of ``--tool-call-parser`` (stateless: one for the gateway), or None."""
    return None if name is None else PARSERS[name]()
