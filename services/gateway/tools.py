"""Function calling (``tools`` on chat completions), by structured outputs.

The request's tools reach the chat template (the variable ``tools``, as transformers passes them),
and ``tool_choice`` decides what comes back:

- ``"none"`` (the default without tools): text, as any chat completion;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output follows that
  function's ``parameters`` schema (``yutu.engine.structured``), and comes back as one tool call
  whose ``arguments`` are the output; ``finish_reason`` stays ``stop``, as OpenAI answers;
- ``"required"``: the output follows a JSON array of one or more ``{"name", "parameters"}``
  objects of the tools' (vLLM's shape), and comes back as that many tool calls with
  ``finish_reason`` ``tool_calls``;
- ``"auto"`` (the default with tools) lets the model choose between text and a call in its own
  format, which only a parser for that model family can find in free text: not implemented, so a
  400 (vLLM refuses it too unless started with a tool-call parser).

A call cut short by ``max_tokens`` keeps ``finish_reason`` ``length``: a named call with the
arguments as far as they got, a ``required`` array that does not parse as the text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.errors import invalid
from services.gateway.schemas import ChatCompletionRequest, FunctionCall, ToolCall, ToolSpec

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its output."""

    mode: Literal["none", "named", "required"]
    function: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # the JSON schema the output follows (named, required)

    @property
    def calls(self) -> bool:
        """The output is tool calls, not text."""
        return self.mode != "none"

    def finish_reason(self, finish_reason: str | None, calls: list[ToolCall] | None) -> str | None:
        if self.mode == "required" and calls and finish_reason == "stop":
            return "tool_calls"
        return finish_reason

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in a choice's whole output text; None where it holds none (``required``
        cut short: the text is all there is)."""
        if self.mode == "named":
            assert self.function is not None
            return [new_call(self.function, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return None
            return [
                new_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
            ]
        return None


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; 400 naming ``tools`` or ``tool_choice`` when they do not agree."""
    tools = req.tools or []
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise invalid("tools must name distinct functions", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise invalid("tool_choice other than none needs tools", "tool_choice")
    if choice == "auto":
        raise invalid(
            'tool_choice "auto" (the default with tools) is not supported: it needs a parser for the'
            ' model\'s own tool-call format. Use "required", name a function ({"type": "function",'
            ' "function": {"name": ...}}), or "none"',
            "tool_choice",
        )
    if choice == "required":
        return ToolPlan("required", schema=_any_of_the_calls(tools))
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise invalid(f"tool_choice names function {name!r}, which is not among tools", "tool_choice")
    return ToolPlan(
        "named", function=name, schema=tools[names.index(name)].function.parameters or NO_ARGUMENTS
    )


def _any_of_the_calls(tools: list[ToolSpec]) -> dict[str, Any]:
    """A JSON array of one or more calls of the tools: ``{"name": ..., "parameters": {...}}`` each;
    the tools' ``$defs`` lifted to the top, where their ``$ref`` s find them."""
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
    if definitions:
        schema["$defs"] = definitions
    return schema
