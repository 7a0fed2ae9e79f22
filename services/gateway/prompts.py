"""From a validated API request to worker requests: prompt token ids, sampling parameters, stop strings.

Everything here raises :class:`ApiError` with the OpenAI envelope's ``param`` set, so the client
learns which field to change. Nothing here talks to a worker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

from yutu.engine.sampling import SamplingParams
from yutu.engine.tokenizer import ChatTemplateError, Tokenizer
from yutu.errors import ErrorKind

from services.gateway.errors import ApiError, context_length_exceeded, invalid
from services.gateway.limits import RequestLimits
from services.gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _GenerationRequest,
)
from services.gateway.tokenization import PromptTokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ChoiceSpec:
    """One worker request: choice ``index`` of the response, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: tuple[str, ...]
    score_only: bool = False  # max_tokens 0 (echo, prompt_logprobs): the worker's one token is not shown
    include_stop: bool = False  # a stop string reached ends the text (vLLM's include_stop_str_in_output)
    skip_special_tokens: bool = True  # special tokens are left out of the text (vLLM's, by default)
    cache_salt: str | None = None  # its KV is shared only with requests of the same salt (vLLM's)
    priority: int = 0  # served before higher values, after lower ones, on every instance (vLLM's)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError.of_kind(
            ErrorKind.NOT_FOUND,
            f"The model `{requested}` does not exist: this server serves `{served}` (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    bad = [t for t in ids if not 0 <= t < vocab_size]
    raise invalid(f"token ids must be in [0, {vocab_size}); got {bad[:5]}", param)


def is_token_ids(prompt: object) -> TypeGuard[list[int]]:
    """A list of ints only (or empty), looked at once rather than an isinstance per id."""
    return type(prompt) is list and set(map(type, prompt)) <= {int}


def num_prompts(req: CompletionRequest) -> int:
    """How many prompts a completions request has (a string or a list of ids is one)."""
    prompt = req.prompt
    if isinstance(prompt, str) or is_token_ids(prompt):
        return 1
    return len(prompt)


async def completion_prompts(
    req: CompletionRequest, tokens: PromptTokenizer, max_model_len: int | None
) -> list[list[int]]:
    """Token ids of each prompt of a completions request (text, ids, or a list of either).

    With ``max_model_len``, a text prompt proved too long for it is refused (400) before it is
    tokenized.
    """
    prompt = req.prompt
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = [p for p in prompt if isinstance(p, str)]
    else:
        texts = None
    if texts is not None:
        encoded = await tokens.encode(texts, max_model_len, "prompt")
    elif prompt and is_token_ids(prompt):
        encoded = [list(prompt)]
    else:
        encoded = [list(p) for p in prompt if isinstance(p, list)]
    if not encoded:
        raise invalid(
            "prompt must not be empty: send a string, a list of token ids, or a list of those", "prompt"
        )
    for ids in encoded:
        if not ids:
            raise invalid("prompt encodes to no tokens: send some text or token ids", "prompt")
        check_token_ids(ids, tokens.tokenizer.vocab_size, "prompt")
    return encoded


# The chat template's variables that requests set through their own fields, not chat_template_kwargs.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "tools", "documents"}
)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content as a string (text parts joined), an
    assistant's earlier thinking under both its names (``reasoning``, ``reasoning_content``)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        item = msg.model_dump(exclude_none=True)
        content = msg.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise invalid(
                        f"content part of type {part.type!r} is not supported: send text parts only",
                        f"messages.{i}.content",
                    )
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        elif content is None:
            item["content"] = ""
        thinking = item.get("reasoning", item.get("reasoning_content"))
        if msg.role == "assistant" and isinstance(thinking, str):  # templates read either name (vLLM's)
            item["reasoning"] = item["reasoning_content"] = thinking
        for call in item.get("tool_calls") or ():  # templates read arguments as an object (vLLM's way)
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # left as the client sent it
        out.append(item)
    return out


async def chat_prompt(
    messages: list[ChatMessage],
    tokens: PromptTokenizer,
    add_generation_prompt: bool = True,
    max_model_len: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of the chat prompt rendered with the model's template (``tools``: the request's
    tool definitions, which the template may show the model; ``template_kwargs``: vLLM's
    ``chat_template_kwargs``, more variables of the template, ``enable_thinking`` say; ``documents``:
    the template variable of that name, for retrieval templates;
    ``continue_final_message``: the last message left open for the model to continue;
    ``add_special_tokens``: the tokenizer's BOS put first where the template did not, vLLM's;
    ``chat_template``: the request's own template instead of the model's).

    With ``max_model_len``, a rendered prompt proved too long for it is refused (400) untokenized.
    """
    if continue_final_message and add_generation_prompt:
        raise invalid(
            "continue_final_message continues the last message instead of starting a new one: set"
            " add_generation_prompt false with it (it is true by default)",
            "continue_final_message",
        )
    taken = sorted(TEMPLATE_VARIABLES & set(template_kwargs or ()))
    if taken:
        raise invalid(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do",
            "chat_template_kwargs",
        )
    dicts = template_messages(messages)
    variables = {**(template_kwargs or {}), **({} if documents is None else {"documents": documents})}
    try:
        ids = await tokens.encode_chat(
            dicts, add_generation_prompt, max_model_len, tools=tools,
            continue_final_message=continue_final_message, template_kwargs=variables,
            chat_template=chat_template,
        )  # fmt: skip
    except ChatTemplateError as exc:
        raise invalid(str(exc), "messages") from None
    if not ids:
        raise invalid("the chat prompt encodes to no tokens", "messages")
    bos = tokens.tokenizer.bos_token_id
    if add_special_tokens and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


def request_chat_template(template: str | None, trusted: bool) -> str | None:
    """A request's own chat template, where the gateway was started trusting its clients with one
    (``--trust-request-chat-template``); a 400 otherwise."""
    if template is not None and not trusted:
        raise invalid(
            "this gateway does not accept chat templates from requests: start it with"
            " --trust-request-chat-template to (a template runs on the gateway's CPU)",
            "chat_template",
        )
    return template


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: what the response repeats before its own content -- the last message's
    content where the response continues it (its role is the assistant's, or ``add_generation_prompt``
    is false: no new message is started); "" otherwise, and without echo."""
    last = req.messages[-1]
    if not req.echo or (req.add_generation_prompt and last.role != "assistant"):
        return ""
    return str(template_messages([last])[0]["content"])


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if any(not s for s in stops):
        raise invalid("stop strings must be non-empty", "stop")
    return tuple(stops)


def logit_bias_for(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids, as JSON keys, to a bias) as (id, bias) pairs, ordered by
    id; 400 naming ``logit_bias`` for a key that is not a token id of the vocabulary. The values'
    range and repeated ids are SamplingParams' to check (its errors name the field too)."""
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdecimal() else -1  # "+1", " 1" and "1.0" are not ids
        if not 0 <= token < vocab_size:
            raise invalid(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias"
            )
        pairs.append((token, value))
    return tuple(sorted(pairs))


# vLLM's request extras Yutu does not implement, with the value that asks for nothing (None is
# neutral too) and what to say: a request setting one otherwise is refused, not served as if it had not.
NOT_IMPLEMENTED: dict[str, tuple[object, str]] = {
    "logits_processors": ([], "logits_processors are not supported"),
    "kv_transfer_params": (
        None,
        "kv_transfer_params is not supported: Yutu moves KV between its own instances",
    ),
    "vllm_xargs": ({}, "vllm_xargs is not supported"),
}
NOT_IMPLEMENTED_IN_CHAT: dict[str, tuple[object, str]] = {
    "mm_processor_kwargs": ({}, "mm_processor_kwargs is not supported: text models only"),
}


def reject_unsupported(req: _GenerationRequest) -> None:
    """Refuse, rather than silently ignore, features no worker implements."""
    chat = isinstance(req, ChatCompletionRequest)
    for name, (neutral, why) in (
        NOT_IMPLEMENTED | NOT_IMPLEMENTED_IN_CHAT if chat else NOT_IMPLEMENTED
    ).items():
        value = getattr(req, name)
        if value is not None and value != neutral:
            raise invalid(why, name)
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise invalid(
            "prompt_logprobs are not available with stream: true (on completions, echo with logprobs"
            " streams the prompt's logprobs)",
            "prompt_logprobs",
        )
    if req.length_penalty not in (None, 1.0) and not req.use_beam_search:
        raise invalid("length_penalty applies to beam search: set use_beam_search true", "length_penalty")
    if req.truncate_prompt_tokens == 0:
        raise invalid(
            "truncate_prompt_tokens must be at least 1 (the prompt's last tokens to keep), or -1 for the"
            " model's context",
            "truncate_prompt_tokens",
        )
    if req.allowed_token_ids == []:
        raise invalid(
            "allowed_token_ids must name at least one token id (leave it unset for all)", "allowed_token_ids"
        )
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not (req.echo or req.prompt_logprobs is not None):
            raise invalid(
                "max_tokens must be at least 1; 0 only with echo or prompt_logprobs (the prompt scored,"
                " nothing generated)",
                "max_tokens",
            )
        if req.suffix:
            raise invalid("suffix is not supported: leave it unset", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise invalid("best_of is not supported: use n to get several completions", "best_of")
    if isinstance(req, ChatCompletionRequest):
        for legacy in ("functions", "function_call"):
            if getattr(req, legacy) is not None:
                raise invalid(
                    f"{legacy} (deprecated by OpenAI) is not supported: send tools and tool_choice", legacy
                )
        if req.modalities is not None and set(req.modalities) - {"text"}:
            raise invalid("only the text modality is supported", "modalities")
        if req.audio is not None:
            raise invalid("audio output is not supported: leave audio unset", "audio")
        if req.web_search_options is not None:
            raise invalid("web search is not supported: leave web_search_options unset", "web_search_options")
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")


def max_tokens_for(
    prompt_len: int,
    requested: int | None,
    default: int | None,
    max_model_len: int,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> int:
    """Tokens to generate: the request's, else ``default`` (None: up to the context), within the context.

    Raises 400 ``context_length_exceeded`` naming both numbers (and the field: ``prompt_param`` or
    ``max_tokens_param``) when the prompt, or the prompt plus the requested tokens, does not fit.
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has"
            f" {prompt_len} tokens: shorten the {prompt_param}",
            prompt_param,
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens, but {prompt_len + requested}"
            f" were requested ({prompt_len} in the prompt, {requested} for the completion): lower"
            f" {max_tokens_param} to at most {room} or shorten the {prompt_param}",
            max_tokens_param,
        )
    return requested


def bad_word_ids(words: list[str] | None, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as the token sequences the engine bans: each word as it encodes at the
    start of a text, and also as it encodes after a space (a word mid-text) where that gives as many
    tokens but a different first one; 400 for a word that encodes to nothing."""
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words or ()):
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise invalid("bad_words must be words: this one encodes to no tokens", f"bad_words.{i}")
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return tuple(out)


def truncated(req: _GenerationRequest, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    """The prompts cut to their last ``truncate_prompt_tokens`` tokens (-1: the context's length), as
    vLLM truncates them (on the left); as they are without it."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return prompts
    keep = max_model_len if keep == -1 else keep
    return [ids[-keep:] for ids in prompts]


def sampling_for(
    req: _GenerationRequest,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    logit_bias: tuple[tuple[int, float], ...] = (),
    grammar: str | None = None,
    bad_words: tuple[tuple[int, ...], ...] = (),
    grammar_after_thinking: tuple[int, int, bool] | None = None,
) -> SamplingParams:
    """SamplingParams of choice ``choice`` (its seed is ``seed + choice``, so choices differ);
    ``logit_bias`` as :func:`logit_bias_for` made it, ``grammar`` as
    :func:`services.gateway.structured.grammar_for` did, ``bad_words`` as :func:`bad_word_ids` did;
    ``grammar_after_thinking`` as :func:`services.gateway.reasoning.thinking_of` found it."""
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else None
    seed = None if req.seed is None else req.seed + choice
    allowed = None if req.allowed_token_ids is None else tuple(dict.fromkeys(req.allowed_token_ids))
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and logprobs is not None:
        # echo with logprobs: the prompt's tokens are shown with theirs (OpenAI's legacy completions)
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=req.min_p or 0.0,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            allowed_token_ids=allowed,  # a repeated id asks nothing more
            bad_words=bad_words,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            grammar=grammar,
            grammar_after_thinking=grammar_after_thinking,
        )
    except ValueError as exc:  # SamplingParams names the field first: "top_p must be ..."
        field = str(exc).split(" ", 1)[0]
        raise invalid(str(exc), field if field in SamplingParams.__dataclass_fields__ else None) from None


def check_cost_before_tokenizing(
    req: _GenerationRequest, limits: RequestLimits, prompts: int, requested: int | None, param: str
) -> None:
    """n, and the tokens the request may generate as far as the body alone tells (400s)."""
    limits.check_n(req.n)
    limits.check_planned(prompts, req.n, requested, param)


def choice_specs(
    req: _GenerationRequest,
    prompts: list[list[int]],
    max_model_len: int,
    requested_max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    *,
    limits: RequestLimits,
    tokenizer: Tokenizer,
    max_tokens_param: str = "max_tokens",
    prompt_param: str = "prompt",
    grammar: str | None = None,
    grammar_after_thinking: tuple[int, int, bool] | None = None,
    skip_special_tokens: bool | None = None,
) -> list[ChoiceSpec]:
    """One spec per (prompt, choice), indexed prompt-major as OpenAI does: index = p * n + i.

    Refuses (400, ``max_tokens_param``) a request whose choices may generate more tokens in all
    than ``limits`` allow, counting each choice's exact max_tokens; and (400, ``prompt_param`` or
    ``max_tokens_param``) one whose prompt and max_tokens do not fit the context. ``grammar``: the
    output constraint :func:`services.gateway.structured.grammar_for` compiled (held from after a
    reasoning model's thinking with ``grammar_after_thinking``); ``skip_special_tokens``: the request's own unless given (a tool-call format may need them).
    """
    reject_unsupported(req)
    stops = stop_strings(req.stop)
    logit_bias = logit_bias_for(req.logit_bias, tokenizer.vocab_size)
    if req.allowed_token_ids is not None:
        check_token_ids(req.allowed_token_ids, tokenizer.vocab_size, "allowed_token_ids")
    bad_words = bad_word_ids(req.bad_words, tokenizer)
    score_only = requested_max_tokens == 0  # (scoring the prompt) the worker computes one token, not shown
    per_prompt = [
        max_tokens_for(
            len(ids), requested_max_tokens or (1 if score_only else None), default_max_tokens, max_model_len,
            prompt_param, max_tokens_param,
        )
        for ids in prompts
    ]  # fmt: skip
    limits.check_generated(sum(per_prompt) * req.n, len(prompts), req.n, max_tokens_param)
    specs = []
    for p, (ids, max_tokens) in enumerate(zip(prompts, per_prompt, strict=True)):
        for i in range(req.n):
            sampling = sampling_for(
                req, max_tokens, logprobs, i, logit_bias, grammar, bad_words, grammar_after_thinking
            )
            specs.append(
                ChoiceSpec(
                    p * req.n + i,
                    p,
                    ids,
                    sampling,
                    stops,
                    score_only,
                    req.include_stop_str_in_output,
                    req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                    req.cache_salt,
                    req.priority,
                )  # fmt: skip
            )
    return specs
