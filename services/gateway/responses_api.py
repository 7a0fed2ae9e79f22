"""OpenAI's Responses API (``POST /v1/responses``) as a view of chat completions.

A Responses request is the conversation (``input``: a string, or items: messages whose content
is text parts, the function calls a response made and their outputs, reasoning items),
``instructions`` (a system message put first), function ``tools`` with ``tool_choice``, and the
sampling options; the answer is a ``response`` object whose ``output`` holds, in order, a
``reasoning`` item (from a gateway with a reasoning parser), the assistant's message (an
``output_text`` part) and its ``function_call`` items. :func:`chat_request` turns the request into
the chat completion it means, which runs as any other (same template, same limits, same
placement, the same function calling: services/gateway/tools.py); :func:`response_object` and
:class:`ResponseEvents` turn that chat completion's answer -- whole, or its chunks -- into the
Responses shapes: streamed as typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.function_call_arguments.delta`` ...
``response.completed``), each with its ``sequence_number``, and no ``[DONE]``.

The input's items become chat messages as an agent loop sends them back: a ``function_call``
joins the assistant message before it (or the calls before it) as one of its ``tool_calls``, a
``function_call_output`` is a ``tool`` message answering its ``call_id``, and a ``reasoning``
item's text is the ``reasoning_content`` of the assistant turn that follows it (chat templates
that show a turn's thinking, Qwen3's, read it there).

A response made with ``store`` (the default) is kept (services/gateway/response_store.py), and a
request naming it as ``previous_response_id`` continues its conversation: the items it answered and
its output come before the request's ``input`` (its ``instructions`` are not carried over, as on
OpenAI). :func:`input_items` gives a request's input as the items that are kept.

The answer's tokens' logprobs come with ``include: ["message.output_text.logprobs"]`` (or
``top_logprobs`` above 0, the alternatives a token): the chat completion's, in the ``output_text``
part and on each ``output_text.delta`` event, for answers that are all text (no function tools
that may be called, no reasoning parser splitting the thinking off: the chat completion's logprobs
cover every token it generated).

What is not served is refused by name (400): tools other than functions, images and files in the
input, other item types, ``conversation`` (the Conversations API), ``reasoning`` options, ``truncation: "auto"``, ``include`` other than ``reasoning.encrypted_content`` (taken: the
reasoning's text is in its item's ``content``, which goes back as it is; nothing is encrypted) and
``message.output_text.logprobs``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError
from yutu.engine.sampling import MAX_LOGPROBS

from services.gateway.errors import ApiError, invalid, validation_failed
from services.gateway.schemas import (
    FUNCTION_NAME,
    ChatCompletionRequest,
    ChatMessage,
    Int,
    StreamOptions,
    _Request,
)

# chat completion fields as the Responses request names them, for the errors of the chat path
CHAT_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}
_ROLES = ("system", "developer", "user", "assistant")
LOGPROBS = "message.output_text.logprobs"  # the include that asks for the answer's logprobs
_INCLUDES = ("reasoning.encrypted_content", LOGPROBS)


class InputPart(_Request):
    type: str
    text: str | None = None


class InputMessage(_Request):
    type: str = "message"
    role: str
    content: str | list[InputPart]


class FunctionCallItem(_Request):
    """A function call a response made, sent back as input."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Request):
    """What the caller's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputPart]


class ReasoningItem(_Request):
    """A response's reasoning item, sent back as input: its text, or its summary's."""

    type: Literal["reasoning"]
    content: list[InputPart] | None = None
    summary: list[InputPart] = []


_ITEMS: dict[str, type[_Request]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class Tool(_Request):
    """A tool as the Responses API names it (``{"type": "function", "name": ...}``, no nesting);
    only functions are served."""

    type: str
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def shown(self) -> dict[str, Any]:
        """As the response echoes it."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}  # fmt: skip


class NamedFunction(_Request):
    type: str
    name: str | None = None


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None  # None: plain text


class ResponsesRequest(_Request):
    model: str
    input: str | list[dict[str, Any]]  # items, each checked by its type (see _messages)
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # None: True, as on OpenAI (kept unless the gateway keeps none)
    previous_response_id: str | None = None  # a stored response this one continues
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    tools: list[Tool] | None = None
    truncation: str | None = None
    # refused when set (see the module docstring)
    conversation: Any = None
    background: bool | None = None
    reasoning: Any = None
    # "reasoning.encrypted_content" is taken: a reasoning item here carries its text in content
    # (encrypted_content stays null), and that text goes back as input as it is;
    # "message.output_text.logprobs": the answer's logprobs; the rest refused
    include: list[str] | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # above 0: logprobs, with alternatives

    @property
    def logprobs(self) -> bool:
        """Whether the answer's logprobs are asked for (the include, or top_logprobs above 0)."""
        return LOGPROBS in (self.include or []) or bool(self.top_logprobs)


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.conversation is not None:
        raise invalid(
            "conversation is not supported (there is no Conversations API here): continue a stored"
            " response with previous_response_id, or send the whole conversation in input",
            "conversation",
        )
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise invalid(
                f"tools of type {tool.type!r} are not supported: only function tools", f"tools.{i}.type"
            )
        if tool.name is None:
            raise invalid("a function tool needs a name", f"tools.{i}.name")
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        if choice.type != "function":
            raise invalid(
                f"tool_choice of type {choice.type!r} is not supported: none, auto, required or a"
                ' function ({"type": "function", "name": ...})',
                "tool_choice",
            )
        if choice.name is None:
            raise invalid("tool_choice names no function", "tool_choice.name")
    if body.reasoning:
        raise invalid("reasoning is not supported on /v1/responses", "reasoning")
    if body.truncation not in (None, "disabled"):
        raise invalid(
            f'truncation {body.truncation!r} is not supported: only "disabled" (a too long input is refused)',
            "truncation",
        )
    for i, what in enumerate(body.include or []):
        if what not in _INCLUDES:
            raise invalid(
                f"include {what!r} is not supported on /v1/responses (only {' and '.join(_INCLUDES)})",
                f"include.{i}",
            )
    if body.logprobs and body.tools and body.tool_choice != "none":
        raise invalid(
            "logprobs are served on /v1/responses for answers that are all text: with function tools,"
            ' only with tool_choice "none" (or use /v1/chat/completions, whose logprobs cover the calls)',
            "include" if LOGPROBS in (body.include or []) else "top_logprobs",
        )


def _messages(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> tuple[list[ChatMessage], list[str]]:
    """The chat messages of ``instructions``, the ``earlier`` turns' items (a previous response's)
    and ``input`` (module docstring), and where each came from (``instructions``,
    ``previous_response_id``, ``input`` or ``input.<i>``, its first item); 400 naming the first item
    not served."""
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    items = [(raw, "previous_response_id") for raw in earlier]
    if isinstance(body.input, str):
        items.append(({"role": "user", "content": body.input}, "input"))
    elif not body.input:
        raise invalid("input holds no message", "input")
    else:
        items.extend((raw, f"input.{i}") for i, raw in enumerate(body.input))
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    calls: dict[str, Any] | None = None  # the assistant message the next function_call joins
    for raw, where in items:
        item = _item_of(raw, where)
        if isinstance(item, ReasoningItem):
            thought = (thought or "") + "".join(p.text or "" for p in (item.content or item.summary))
            calls = None
            continue
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if calls is None:
                calls = {"role": "assistant", "content": None}
                out.append(calls)
                origins.append(where)
            calls.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, "input_text", f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            origins.append(where)
            calls = None
        else:
            assert isinstance(item, InputMessage)
            if item.role not in _ROLES:
                raise invalid(f"role {item.role!r} is not one of {', '.join(_ROLES)}", f"{where}.role")
            wanted = "output_text" if item.role == "assistant" else "input_text"
            out.append({"role": item.role, "content": _text(item.content, wanted, f"{where}.content")})
            origins.append(where)
            calls = out[-1] if item.role == "assistant" else None
        if thought is not None:
            if out[-1]["role"] != "assistant":
                raise invalid(
                    "a reasoning item must come right before the assistant message or function call it"
                    " belongs to",
                    where,
                )
            out[-1]["reasoning_content"], thought = thought, None
    if thought is not None:
        raise invalid("a reasoning item ends input: it belongs before an assistant turn", "input")
    return [ChatMessage.model_validate(m) for m in out], origins


def _item_of(raw: dict[str, Any], where: str) -> _Request:
    """The input item at ``where``, checked as its type says (a message when it says none)."""
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise invalid(
            f"input items of type {kind!r} are not supported: send {', '.join(_ITEMS)} items",
            f"{where}.type",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_failed(exc.errors(), where.split(".")) from None


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as the items a stored response keeps (and ``input_items`` lists): text is a user
    message, a message's text content one part, and every item has an ``id`` (its own, or a new
    one). For a request :func:`chat_request` took."""
    raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    items = []
    for given in raw:
        item = {"type": "message", **given}
        if item["type"] == "message":
            if isinstance(item["content"], str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", f"{_ID_PREFIXES[item['type']]}_{uuid.uuid4().hex}")
        items.append(item)
    return items


def _text(content: str | list[InputPart], wanted: str, where: str) -> str:
    """A message's content (or a function's output) as text: the string, or its text parts joined;
    ``where``: its param."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in (wanted, "input_text", "output_text") or part.text is None:
            raise invalid(
                f"content parts of type {part.type!r} are not supported: send {wanted} parts", f"{where}.{j}"
            )
    return "".join(part.text or "" for part in content)


def _format(body: ResponsesRequest) -> TextFormat | None:
    return None if body.text is None else body.text.format


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = _format(body)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise invalid('a text.format of type "json_schema" needs a name and a schema', "text.format")
    spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


@dataclass(frozen=True)
class ChatView:
    """The chat completion a Responses request means, and where each of its messages came from
    (for the errors of the chat path, see :func:`renamed`)."""

    request: ChatCompletionRequest
    # per chat message: "instructions", "previous_response_id", "input" or "input.<i>" (its first item)
    origins: list[str]


def _tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def chat_request(body: ResponsesRequest, earlier: list[dict[str, Any]] | None = None) -> ChatView:
    """The chat completion ``body`` asks for (its usage always reported, for the response's);
    ``earlier``: the items of the turns before it (its previous response's context)."""
    _refuse_unsupported(body)
    messages, origins = _messages(body, earlier or [])
    tools = [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in body.tools or []
    ]
    fields = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "stream_options": StreamOptions(include_usage=True) if body.stream else None,
        "response_format": _response_format(body),
        "user": body.user,
        "tools": tools or None,
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "logprobs": body.logprobs,
        "top_logprobs": body.top_logprobs if body.logprobs else None,
    }
    try:
        return ChatView(ChatCompletionRequest.model_validate(fields), origins)
    except ValidationError as exc:  # what the Responses request's own checks let through
        raise renamed(validation_failed(exc.errors()), origins) from None


def renamed(err: ApiError, origins: list[str]) -> ApiError:
    """An error of the chat path, in the Responses request's names: ``messages.3.content`` is
    ``input.2.content`` after ``instructions`` (``origins``: :attr:`ChatView.origins`)."""
    message = err.message
    for chat, ours in CHAT_NAMES.items():
        message = message.replace(chat, ours)
    param = CHAT_NAMES.get(err.param or "", err.param)
    if param is not None and param.startswith("messages."):
        index, _, rest = param.removeprefix("messages.").partition(".")
        if index.isdigit() and int(index) < len(origins):
            origin = origins[int(index)]
            param = (
                origin
                if origin in ("instructions", "input", "previous_response_id")
                else ".".join([origin, *([rest] if rest else [])])
            )
    return ApiError(message, err.status, err.type, param, err.code, err.headers)


def _usage(usage: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


def _shown_choice(choice: str | NamedFunction | None) -> str | dict[str, Any]:
    if isinstance(choice, NamedFunction):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


class Shell:
    """The fields of a response object that do not depend on its output; ``store``: whether it
    is to be kept."""

    def __init__(self, body: ResponsesRequest, model: str, store: bool = False) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        fmt = _format(body)
        self.fields: dict[str, Any] = {
            "background": bool(body.background),
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": model,
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": store,
            "temperature": body.temperature,
            "text": {
                "format": {"type": "text"}
                if fmt is None
                else fmt.model_dump(by_alias=True, exclude_none=True)
            },
            "tool_choice": _shown_choice(body.tool_choice),
            "tools": [tool.shown() for tool in body.tools or []],
            "top_p": body.top_p,
            "truncation": "disabled",
            "user": body.user,
        }

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The response object with this status (``error``: why a ``failed`` one failed)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                **self.fields, "error": error, "incomplete_details": incomplete, "output": output,
                "usage": usage}  # fmt: skip


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _item(kind: str, text: str, status: str) -> dict[str, Any]:
    """An output item: the assistant's ``message`` (an output_text part) or its ``reasoning``."""
    if kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [_part("message", text)]}  # fmt: skip


def _function_call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item (``call_id``: the chat tool call's id)."""
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    shell: Shell, completion: dict[str, Any], count_tokens: Callable[[str], int]
) -> dict[str, Any]:
    """The response of a whole chat completion (one choice). ``count_tokens``: of the reasoning."""
    (choice,) = completion["choices"]
    message = choice["message"]
    status = _status(choice["finish_reason"])
    output = []
    reasoning = message.get("reasoning_content")
    calls = message.get("tool_calls") or []
    if reasoning:
        output.append(_item("reasoning", reasoning, "completed"))
    if message.get("content") is not None or not (output or calls):
        output.append(_item("message", message.get("content") or "", status))
        output[-1]["content"][0]["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
    for call in calls:
        output.append(
            _function_call(call["id"], call["function"]["name"], call["function"]["arguments"], status)
        )
    return shell.response(status, output, _usage(completion.get("usage"), count_tokens(reasoning or "")))


def response_event(type_: str, sequence: int, **fields: Any) -> str:
    """One server-sent event of a Responses stream: its type, its ``sequence_number``, its fields."""
    payload = {"type": type_, "sequence_number": sequence, **fields}
    return f"event: {type_}\ndata: {json.dumps(payload)}\n\n"


class ResponseEvents:
    """A streamed chat completion's events, as the Responses API streams them (module docstring).

    ``feed`` takes the chat stream's text as it comes and returns the Responses events it makes;
    the last one (``response.completed`` or ``.incomplete``) waits in :attr:`final` until
    :meth:`completed` sends it, so that the response is kept before a client can name it."""

    def __init__(
        self, shell: Shell, count_tokens: Callable[[str], int], log: list[tuple[int, str]] | None = None
    ) -> None:
        """``log``: where each event goes too, with its sequence number, as it is made (a background
        response's events are kept for the clients that stream them)."""
        self.log = log
        self.shell = shell
        self.count_tokens = count_tokens
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items finished
        self.kind: str | None = None  # the open item's kind
        self.item: dict[str, Any] = {}
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # the open message's tokens' (when asked for)
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.ended = False
        self.final: dict[str, Any] | None = None  # the response made, once the chat stream ended
        self.error: dict[str, str] | None = None  # why the chat stream failed, when it did
        self._pending = ""

    def _event(self, type_: str, **fields: Any) -> str:
        text = response_event(type_, self.sequence, **fields)
        if self.log is not None:
            self.log.append((self.sequence, text))
        self.sequence += 1
        return text

    def start(self, created: str = "in_progress") -> str:
        """The first events: ``response.created`` (the response ``created``: queued, for a
        background one) and ``response.in_progress``."""
        return self._event("response.created", response=self.shell.response(created, [], None)) + self._event(
            "response.in_progress", response=self.shell.response("in_progress", [], None)
        )

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output), "content_index": 0}

    def _open(self, kind: str) -> str:
        self.kind, self.text, self.logprobs = kind, [], []
        self.item = _item(kind, "", "in_progress")
        self.item["content"] = []
        return self._event(
            "response.output_item.added", output_index=len(self.output), item=self.item
        ) + self._event("response.content_part.added", **self._where(), part=_part(kind, ""))

    def _open_call(self, call_id: str, name: str) -> str:
        out = self._close("completed")
        self.kind, self.text = "function_call", []
        self.item = _function_call(call_id, name, "", "in_progress")
        return out + self._event("response.output_item.added", output_index=len(self.output), item=self.item)

    def _arguments(self, text: str) -> str:
        self.text.append(text)
        return self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                           output_index=len(self.output), delta=text)  # fmt: skip

    def _close(self, status: str) -> str:
        if self.kind is None:
            return ""
        text = "".join(self.text)
        if self.kind == "function_call":
            item = {**self.item, "arguments": text, "status": status}
            out = self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=len(self.output), arguments=text)  # fmt: skip
            out += self._event("response.output_item.done", output_index=len(self.output), item=item)
            self.output.append(item)
            self.kind = None
            return out
        part = _part(self.kind, text)
        if self.kind == "reasoning":
            out = self._event("response.reasoning_text.done", **self._where(), text=text)
        else:
            part["logprobs"] = self.logprobs
            out = self._event("response.output_text.done", **self._where(), text=text, logprobs=self.logprobs)
        item = {**self.item, "status": status, "content": [part]}
        out += self._event("response.content_part.done", **self._where(), part=part)
        out += self._event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
        self.kind = None
        return out

    def _delta(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> str:
        out = ""
        if self.kind != kind:
            out += self._close("completed") + self._open(kind)
        self.text.append(text)
        if kind == "reasoning":
            self.reasoning.append(text)
            return out + self._event("response.reasoning_text.delta", **self._where(), delta=text)
        self.logprobs += logprobs or []  # the delta's tokens' (none unless asked for)
        return out + self._event(
            "response.output_text.delta", **self._where(), delta=text, logprobs=logprobs or []
        )

    def feed(self, data: str) -> str:
        """The Responses events of the chat stream's text ``data`` (whole events are taken; a
        partial one waits for the rest)."""
        self._pending += data
        *whole, self._pending = self._pending.split("\n\n")
        return "".join(self._chat_event(raw) for raw in whole if raw.startswith("data: "))

    def _chat_event(self, raw: str) -> str:
        payload = raw.removeprefix("data: ")
        if payload == "[DONE]":
            return self._end()
        chunk = json.loads(payload)
        if "error" in chunk:
            self.ended = True
            err = chunk["error"]
            self.error = {"code": "server_error", "message": err["message"]}
            return self._event("error", code=err.get("code") or err.get("type"), message=err["message"],
                               param=err.get("param"))  # fmt: skip
        out = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._delta("reasoning", delta["reasoning_content"])
            logprobs = (choice.get("logprobs") or {}).get("content")
            if delta.get("content") or (logprobs and not delta.get("tool_calls")):
                out += self._delta("message", delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or []:  # a call's id and name come with its first delta
                function = call.get("function") or {}
                if call.get("id"):
                    out += self._open_call(call["id"], function["name"])
                if function.get("arguments"):
                    out += self._arguments(function["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        return out

    def _end(self) -> str:
        if self.ended:
            return ""
        self.ended = True
        status = _status(self.finish_reason)
        out = ""
        if self.kind is None and not any(
            item["type"] in ("message", "function_call") for item in self.output
        ):
            out += self._open("message")  # an answer with no text and no calls still has its message
        out += self._close(status)
        usage = _usage(self.usage, self.count_tokens("".join(self.reasoning)))
        self.final = self.shell.response(status, self.output, usage)
        return out

    def completed(self) -> str:
        """The last event, carrying :attr:`final` (as it is now: ``store`` false if it could not be kept)."""
        assert self.final is not None, "the chat stream has not ended"
        return self.ended_with(self.final)

    def ended_with(self, response: dict[str, Any]) -> str:
        """The last event of a response that ended as ``response`` says (its status names it)."""
        return self._event(f"response.{response['status']}", response=response)
