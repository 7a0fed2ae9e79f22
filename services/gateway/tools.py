"""Function calling (``tools`` on chat completions), by structured outputs.

The request's tools reach the chat template (the variable ``tools``, as transformers passes them),
and ``tool_choice`` decides what comes back:

- ``"none"`` (the default without tools): text, as any chat completion;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output follows that
  function's ``parameters`` schema (``yutu.engine.structured``), and comes back as one tool call
  whose ``arguments`` are the output; ``finish_reason`` stays ``stop``, as OpenAI answers;
- ``"required"``: the output follows a JSON array of one or more ``{"name", "parameters"}``
  objects of the tools' (vLLM's shape; exactly one with ``parallel_tool_calls: false``), and
  comes back as that many tool calls with ``finish_reason`` ``tool_calls``;
- ``"auto"`` (the default with tools) lets the model choose between text and calls in its own
  format, which the gateway finds with the parser it was started with (``--tool-call-parser``,
  services/gateway/tool_parsers.py): calls found come back as tool calls, with the text before
  them as content and ``finish_reason`` ``tool_calls``; without a parser, a 400 (as vLLM). Free
  text cannot be held to ``parallel_tool_calls: false`` as it is written: the first call the
  model wrote comes back, the others are dropped (as vLLM does).

A call cut short by ``max_tokens`` keeps ``finish_reason`` ``length``: a named call with the
arguments as far as they got, a ``required`` array or an ``auto`` call that does not parse as the
text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.chunks import chat_choice
from services.gateway.errors import invalid
from services.gateway.reasoning import ReasoningSplit
from services.gateway.schemas import ChatCompletionRequest, FunctionCall, ToolCall, ToolSpec
from services.gateway.tool_parsers import PARSERS, ToolCallParser, default_call_id

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its output."""

    mode: Literal["none", "named", "required", "auto"]
    function: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # the JSON schema the output follows (named, required)
    parser: ToolCallParser | None = None  # the gateway's: finds the calls in free text (auto), names calls
    parallel: bool = True  # auto: every call found comes back (False: the first only)
    tools: tuple[ToolSpec, ...] = ()  # auto: the request's, which a parser may read values by

    @property
    def calls(self) -> bool:
        """The output is tool calls, not text."""
        return self.mode in ("named", "required")

    def skip_special_tokens(self, requested: bool) -> bool:
        """Whether the output's text leaves special tokens out: as ``requested``, unless calls in
        free text are marked by special tokens, which the parser must see."""
        return requested and not (
            self.mode == "auto" and self.parser is not None and not self.parser.skip_special_tokens
        )

    def new_call(self, name: str, arguments: str) -> ToolCall:
        """A tool call with a new id (of the model family's form, where the gateway knows it)."""
        call_id = self.parser.call_id() if self.parser is not None else default_call_id()
        return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))

    def split(self, text: str) -> tuple[str, list[ToolCall] | None]:
        """A choice's whole output text as the text that is content (``""`` when none) and its
        tool calls (None where there are none, and where a ``required`` array or an ``auto``
        call was cut short: the text is all there is)."""
        if self.mode == "named":
            assert self.function is not None
            return "", [self.new_call(self.function, text)]
        if self.mode == "required":
            try:  # the grammar's shape, unless a stop string or max_tokens cut it
                calls = [
                    self.new_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                    for i in json.loads(text)
                ]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, None
            return "", calls
        if self.mode == "auto":
            assert self.parser is not None
            parsed = self.parser.parse(text, self.tools)
            if parsed is not None:
                found = parsed[1] if self.parallel else parsed[1][:1]
                return parsed[0], [self.new_call(c.name, c.arguments) for c in found]
        return text, None

    def message(self, text: str) -> tuple[str | None, list[ToolCall] | None]:
        """The message's content and tool calls: content None beside calls unless text came
        before them (``auto``)."""
        content, calls = self.split(text)
        return (content if calls is None or content.strip() else None), calls

    def finish_reason(self, finish_reason: str | None, calls: list[ToolCall] | None) -> str | None:
        """``tool_calls`` where calls came of ``required`` (not cut short) or of ``auto``; else the
        choice's own (a named call's is ``stop``, as OpenAI answers)."""
        if calls and (self.mode == "auto" or (self.mode == "required" and finish_reason == "stop")):
            return "tool_calls"
        return finish_reason


def tool_plan(req: ChatCompletionRequest, parser: ToolCallParser | None = None) -> ToolPlan:
    """The request's tool plan (``parser``: the gateway's ``--tool-call-parser``, which ``auto``
    needs); 400 naming ``tools`` or ``tool_choice`` when they do not agree."""
    tools = req.tools or []
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise invalid("tools must name distinct functions", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none", parser=parser)
    if not tools:
        raise invalid("tool_choice other than none needs tools", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise invalid(
                'tool_choice "auto" (the default with tools) needs the model\'s tool-call format, which'
                f" this gateway was not given: start it with --tool-call-parser ({', '.join(PARSERS)}),"
                ' or use "required", name a function ({"type": "function", "function": {"name": ...}})'
                ' or "none"',
                "tool_choice",
            )
        return ToolPlan("auto", parser=parser, parallel=req.parallel_tool_calls, tools=tuple(tools))
    if choice == "required":
        return ToolPlan("required", schema=_any_of_the_calls(tools, req.parallel_tool_calls), parser=parser)
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise invalid(f"tool_choice names function {name!r}, which is not among tools", "tool_choice")
    return ToolPlan(
        "named",
        function=name,
        schema=tools[names.index(name)].function.parameters or NO_ARGUMENTS,
        parser=parser,
    )


def _any_of_the_calls(tools: list[ToolSpec], parallel: bool = True) -> dict[str, Any]:
    """A JSON array of one or more calls of the tools (exactly one unless ``parallel``):
    ``{"name": ..., "parameters": {...}}`` each; the tools' ``$defs`` lifted to the top, where
    their ``$ref`` s find them."""
    definitions: dict[str, Any] = {}
    options = []
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_ARGUMENTS)
        for key, value in parameters.pop("$defs", {}).items():
            if definitions.setdefault(key, value) != value:
                raise invalid(f"two tools define $defs {key!r} differently; rename one", "tools")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


class ChoiceStream:
    """One streamed choice's deltas, as its text comes (``ChatChunkChoice`` dicts, by
    ``services.gateway.chunks.chat_choice``): text as content; a named call's arguments as they
    come, its id and name with the first; ``required`` calls whole at the end (a partial array is
    no call yet); under ``auto``, content up to where a call may begin (the parser says), the
    rest held until the end and sent as calls if it parses as calls, else as content. Logprobs,
    and token ids (``token_ids``: vLLM's ``return_token_ids``), go with the first delta sent after
    their tokens. With ``reasoning`` (a gateway's ``--reasoning-parser``), the thinking goes out
    first as ``reasoning`` deltas, and only the answer is content as above."""

    def __init__(
        self, index: int, plan: ToolPlan, token_ids: bool = False, reasoning: ReasoningSplit | None = None
    ) -> None:
        self.index = index
        self.plan = plan
        self.reasoning = reasoning
        self._text = ""  # the output so far (held modes)
        self._sent = 0  # characters of it sent as content
        self._logprobs: list[dict[str, Any]] = []  # of tokens not sent yet
        self._ids: list[int] | None = [] if token_ids else None  # of tokens not sent yet, if shown
        self._call_id: str | None = None  # a named call's, once its first delta went out

    def feed(
        self,
        text: str,
        logprobs: list[dict[str, Any]] | None,
        finish_reason: str | None,
        token_ids: Sequence[int] = (),
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas for the next piece of output (maybe none), and the finish reason to send."""
        self._logprobs += logprobs or []
        if self._ids is not None:
            self._ids += token_ids
        if self.reasoning is None:
            return self._answer(text, finish_reason)
        thought, text = self.reasoning.feed(text)
        if finish_reason is not None:
            more_thought, more_text = self.reasoning.finish()
            thought, text = thought + more_thought, text + more_text
        thinking = [self._delta(reasoning=thought)] if thought and self.reasoning.shown else []
        deltas, finish_reason = self._answer(text, finish_reason)
        return thinking + deltas, finish_reason

    def _answer(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas of the answer's next piece, as the request's tools shape them."""
        if self.plan.mode == "none":
            return ([self._delta(content=text)] if text or self._pending() else []), finish_reason
        if self.plan.mode == "named":
            if not text and not self._pending() and (finish_reason is None or self._call_id is not None):
                return [], finish_reason
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self._call_id is None:
                assert self.plan.function is not None
                self._call_id = self.plan.new_call(self.plan.function, "").id
                call = {"index": 0, "id": self._call_id, "type": "function",
                        "function": {"name": self.plan.function, "arguments": text}}  # fmt: skip
            return [self._delta(tool_calls=[call])], finish_reason
        self._text += text
        deltas = []
        if finish_reason is None:
            if self.plan.mode == "auto":  # the content that no call can follow
                assert self.plan.parser is not None
                end = self.plan.parser.content_end(self._text)
                if end > self._sent:
                    deltas.append(self._delta(content=self._text[self._sent : end]))
                    self._sent = end
            return deltas, None
        content, calls = self.plan.split(self._text)
        if content[self._sent :]:
            deltas.append(self._delta(content=content[self._sent :]))
        if calls:
            deltas.append(self._delta(tool_calls=[
                {"index": i, "id": c.id, "type": "function", "function": c.function.model_dump()}
                for i, c in enumerate(calls)
            ]))  # fmt: skip
        elif self._pending():
            deltas.append(self._delta())
        return deltas, self.plan.finish_reason(finish_reason, calls)

    def _pending(self) -> bool:
        """Whether tokens not sent yet are to be shown although their text is not (logprobs, ids)."""
        return bool(self._logprobs or self._ids)

    def _delta(self, **fields: Any) -> dict[str, Any]:
        logprobs, self._logprobs = self._logprobs, []
        ids, self._ids = self._ids, (None if self._ids is None else [])
        return chat_choice(self.index, logprobs=logprobs or None, token_ids=ids, **fields)
