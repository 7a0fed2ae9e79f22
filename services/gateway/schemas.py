"""Wire models of the OpenAI-compatible API (requests and responses), kept apart from internal types.

Field names and shapes follow the OpenAI API reference; extras that vLLM accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, include_stop_str_in_output, stop_token_ids,
skip_special_tokens, add_generation_prompt, continue_final_message, chat_template_kwargs,
structured_outputs and the guided_* fields) are accepted too. Unknown fields are ignored.
Requests are validated strictly, as OpenAI does: ``"2"`` is not an integer and ``"true"`` not a
boolean (an integer is a number, though). Range checks here give 400s with ``param`` set (see
errors.py); cross-field rules live in prompts.py where the prompt length is known.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer
from yutu.engine.sampling import MAX_LOGPROBS, TOP_P_MIN

# -- requests -------------------------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 2.0 is 2 (other floats stay floats, and strict validation refuses them)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]


def _integral_items(value: Any) -> Any:
    """``_integral`` on every item of a list, in one C-speed look when it holds no float (a prompt
    of token ids is thousands of items: a validator per item cost ~0.3 ms a 1,024-token request)."""
    if type(value) is list and float in set(map(type, value)):
        return [_integral(v) for v in value]
    return value


TokenIds = Annotated[list[int], BeforeValidator(_integral_items)]  # list[Int], validated in bulk
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Request(BaseModel):
    model_config = ConfigDict(strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _GenerationRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=TOP_P_MIN, le=1)  # the smallest positive float32: 2**-149
    n: Int = Field(1, ge=1)  # at most the gateway's --max-n (default 128, OpenAI's cap)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM's names)
    top_k: Int | None = Field(None, ge=-1)  # -1 or 0: no limit
    min_p: float | None = Field(
        None, ge=0, le=1
    )  # 0: none; keep tokens >= min_p x the likeliest's probability
    repetition_penalty: float | None = Field(None, gt=0)  # 1: none; > 1 discourages repeats
    min_tokens: Int = Field(0, ge=0)  # the eos and stop tokens held back until this many are out
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # a stop string reached ends the text instead of being cut
    stop_token_ids: TokenIds | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    skip_special_tokens: bool = True  # False: special tokens the model writes are in the text
    return_token_ids: bool = False  # the response shows the prompt's and the output's token ids
    cache_salt: str | None = Field(None, min_length=1)  # KV reused only between requests of the same salt
    priority: Int = Field(0, ge=-(2**63), le=2**63 - 1)  # the lower first, on every instance (vLLM's)
    use_beam_search: bool = False  # n beams, the best n the choices (services/gateway/beam_search.py)
    length_penalty: float | None = None  # beam search's scores: logprob / length ** length_penalty (1)
    # the prompt's own tokens' logprobs, each with this many alternatives (not with stream)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: Int | None = Field(
        None, ge=-1
    )  # keep the prompt's last k tokens; -1: the context
    allowed_token_ids: TokenIds | None = None  # only these tokens may be generated
    bad_words: list[str] | None = (
        None  # words the output may not contain (as tokenized, with or without a space)
    )
    # structured outputs (services/gateway/structured.py): OpenAI's, then vLLM's
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # the whitespace JSON output may have (a regex)
    # vLLM's extras that no worker implements: refused unless left at their neutral value
    # (prompts.NOT_IMPLEMENTED), not ignored
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class CompletionRequest(_GenerationRequest):
    prompt: str | TokenIds | list[TokenIds] | list[str]
    max_tokens: Int | None = Field(None, ge=0)  # 0 only with echo or prompt_logprobs: the prompt scored
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = Field(None, ge=1)


class ContentPart(_Request):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, ... reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class FunctionSpec(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None


class ToolSpec(_Request):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults); services/gateway/tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: one call at most (services/gateway/tools.py)
    # OpenAI's, refused rather than ignored (prompts.reject_unsupported)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # extras (vLLM's): how the chat template renders the messages (services/gateway/prompts.chat_prompt)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open, for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (enable_thinking, ...)
    documents: list[dict[str, Any]] | None = None  # for retrieval templates: the variable ``documents``
    echo: bool = False  # the response's content starts with the last message's, where it continues it
    add_special_tokens: bool = False  # the tokenizer's BOS too, where the chat template did not put it
    chat_template: str | None = None  # the request's own (a gateway started --trust-request-chat-template)
    include_reasoning: bool = True  # False: the thinking is left out (--reasoning-parser; content as ever)
    # refused unless neutral (prompts.NOT_IMPLEMENTED_IN_CHAT)
    mm_processor_kwargs: Any = None


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as on chat completions
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


# -- responses ------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's: one token's logprob in a ``prompt_logprobs`` entry (keyed by its token id)."""

    logprob: float
    rank: int | None  # 1: the most likely token at that position
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token; the first None


def _unless_asked() -> Any:
    """A field of vLLM's that a response shows only where its request asked for it."""
    return Field(None, exclude_if=lambda value: value is None)


class CompletionChoice(BaseModel):
    """A choice as a streamed chunk carries it."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's extra: the stop string or token that ended it
    # vLLM's return_token_ids: the prompt's (streamed: with a choice's first chunk), the output's
    prompt_token_ids: list[int] | None = _unless_asked()
    token_ids: list[int] | None = _unless_asked()


class CompletionResponseChoice(CompletionChoice):
    """A choice of a whole response."""

    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked


class _Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str


class CompletionResponse(_Completion):
    choices: list[CompletionResponseChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(_Completion):
    """A streamed text_completion chunk (the last, with the usage, has no choices)."""

    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    # vLLM's, from a gateway started with --reasoning-parser: the thinking (services/gateway/reasoning.py)
    reasoning: str | None = _unless_asked()
    reasoning_content: str | None = _unless_asked()  # the older name, sent beside (as vLLM does)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = _unless_asked()  # vLLM's return_token_ids: the output's


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked: the rendered prompt's
    prompt_token_ids: list[int] | None = _unless_asked()  # vLLM's return_token_ids: the rendered prompt's


class FunctionCallDelta(BaseModel):
    name: str | None = None  # with the call's first delta
    arguments: str | None = None  # the next piece of the arguments' JSON text


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None  # with the call's first delta
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning: str | None = None  # vLLM's (--reasoning-parser): the next piece of the thinking
    reasoning_content: str | None = None  # the same, under its older name

    @model_serializer
    def _drop_unset(self) -> dict[str, Any]:
        # OpenAI sends {"role": "assistant", "content": ""} first, then {"content": "..."}, then {}.
        fields = (
            ("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls),
            ("reasoning", self.reasoning), ("reasoning_content", self.reasoning_content),
        )  # fmt: skip
        return {k: v for k, v in fields if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = _unless_asked()  # vLLM's return_token_ids: this delta's tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = _unless_asked()  # vLLM's return_token_ids: on the role chunks


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "yutu"
    root: str
    max_model_len: int | None = None
    yutu_note: str | None = None  # set for the demo model (random weights)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# -- errors ---------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str  # what went wrong and what to change
    type: str  # invalid_request_error, authentication_error, not_found_error, request_too_large, ...
    param: str | None  # the request field to change, when one is to blame
    code: str | None  # e.g. context_length_exceeded, model_not_found, invalid_api_key


class ErrorResponse(BaseModel):
    """The OpenAI error envelope: every error the gateway answers has this body."""

    error: ErrorDetail
