"""The gateway's settings: built once from the command line in ``main`` and passed down frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Any

from yutu.config import ServiceSettings, add_common_options, add_model_options, option

from services.gateway.limits import (
    DEFAULT_MAX_CHOICES_IN_FLIGHT,
    DEFAULT_MAX_N,
    DEFAULT_MAX_TOTAL_TOKENS,
    RequestLimits,
)
from services.gateway.reasoning import PARSERS as REASONING_PARSERS
from services.gateway.response_store import DEFAULT_TTL_S
from services.gateway.tool_parsers import PARSERS


def split_api_keys(values: list[str] | str | None) -> tuple[str, ...]:
    """``--api-key a --api-key b,c`` (or ``YUTU_API_KEY=a,b``) -> ("a", "b", "c"); blanks dropped."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    keys: list[str] = []
    for value in values:
        keys.extend(k.strip() for k in value.split(",") if k.strip())
    return tuple(dict.fromkeys(keys))


class _AppendOverEnv(argparse.Action):
    """Like ``action="append"``, but the first flag replaces a default taken from the environment."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = list(current) if isinstance(current, list) else []
        items.append(values)
        setattr(namespace, self.dest, items)


own = partial(option, scope="gateway")  # this service's own options: YUTU_GATEWAY_<OPTION>


@dataclass(frozen=True)
class GatewaySettings(ServiceSettings):
    model: str | None  # checkpoint dir or hub id (for the tokenizer); None: the built-in demo model
    served_model_name: str | None  # name clients use; None: the model directory's name (as the worker)
    port: int  # HTTP port of the OpenAI API (0: any free port)
    api_keys: tuple[str, ...]  # empty: no authentication
    max_request_bytes: int  # larger request bodies get a 413 before they are parsed
    registry_poll_s: float  # how often the worker pool re-reads the registry
    worker_liveness_timeout_s: float  # a worker silent this long gets no requests; its in-flight ones fail
    failover_wait_s: float = 30.0  # a stream whose worker was lost waits this long for one to take it over
    limits: RequestLimits = RequestLimits()  # what one request may cost, and how many choices run at once
    tokenizer_threads: int = 0  # threads tokenizing large prompts; 0: sized to the machine
    tool_call_parser: str | None = (
        None  # the model's tool-call format, for tool_choice "auto" (tool_parsers.py)
    )
    trust_request_chat_template: bool = False  # chat requests may bring their own template (vLLM's flag)
    reasoning_parser: str | None = None  # the model's thinking markers, split off the answer (reasoning.py)
    responses_ttl_s: float = (
        DEFAULT_TTL_S  # how long stored responses are kept; 0: none is (response_store.py)
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewaySettings:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        if args.max_request_bytes <= 0:
            raise ValueError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
        if args.tokenizer_threads < 0:
            raise ValueError(f"--tokenizer-threads must be 0 (auto) or more, got {args.tokenizer_threads}")
        if args.registry_poll <= 0:
            raise ValueError(f"--registry-poll must be positive, got {args.registry_poll}")
        if args.worker_liveness_timeout <= 0:
            raise ValueError(
                f"--worker-liveness-timeout must be positive, got {args.worker_liveness_timeout}"
            )
        if args.tool_call_parser and args.tool_call_parser not in PARSERS:  # from the environment
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(sorted(PARSERS))}, got {args.tool_call_parser!r}"
            )
        if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:  # from the environment
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(sorted(REASONING_PARSERS))},"
                f" got {args.reasoning_parser!r}"
            )
        if args.responses_ttl < 0:
            raise ValueError(
                f"--responses-ttl must be 0 (keep none) or more seconds, got {args.responses_ttl}"
            )
        if args.failover_wait < 0:
            raise ValueError(
                f"--failover-wait must be 0 (fail at once) or more seconds, got {args.failover_wait}"
            )
        return cls(
            **ServiceSettings.common(args, "gateway"),
            model=args.model,
            served_model_name=args.served_model_name,
            port=args.port,
            api_keys=split_api_keys(args.api_key),
            max_request_bytes=args.max_request_bytes,
            registry_poll_s=args.registry_poll,
            worker_liveness_timeout_s=args.worker_liveness_timeout,
            failover_wait_s=args.failover_wait,
            limits=RequestLimits(
                max_n=args.max_n,
                max_total_tokens=args.max_total_tokens,
                max_choices_in_flight=args.max_choices_in_flight,
            ),
            tokenizer_threads=args.tokenizer_threads,
            tool_call_parser=args.tool_call_parser or None,
            trust_request_chat_template=args.trust_request_chat_template,
            reasoning_parser=args.reasoning_parser or None,
            responses_ttl_s=args.responses_ttl,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    api = parser.add_argument_group("api")
    own(api, "--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    option(
        api,
        "--api-key",
        default=None,
        action=_AppendOverEnv,
        help="accepted API key (repeat the flag or separate with commas); none: no authentication",
    )
    own(api, "--max-request-bytes", type=int, default=32 * 2**20, help="largest request body accepted")
    own(api, "--registry-poll", type=float, default=1.0, help="seconds between worker registry scans")
    own(
        api,
        "--worker-liveness-timeout",
        type=float,
        default=3.0,
        help="seconds a worker may go without answering heartbeats before its requests fail and it"
        " gets no new ones (until it answers again)",
    )
    own(
        api,
        "--failover-wait",
        type=float,
        default=30.0,
        help="seconds a stream whose decode instance or mixed worker was lost waits for another one to"
        " take it over with every token so far, when none is usable now (yutu up restarts a lost one"
        " in seconds); 0: the stream ends with an error at once",
    )
    own(
        api,
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="the model's tool-call format, which chat requests with tools and tool_choice auto (the"
        " default with tools) need to find its calls in its text: hermes (Hermes, Qwen2.5, Qwen3),"
        " llama3_json (Llama 3.1-3.3), mistral (Mistral, Mixtral), pythonic (Llama 3.2 and 4), qwen3_coder"
        " (Qwen3-Coder, Qwen3.5), granite (Granite 3), phi4_mini_json (Phi-4-mini); unset: such"
        " requests get a 400"
        " (required and named tool choices need none)",
    )
    own(
        api,
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="a reasoning model's thinking markers (<think> ... </think>): qwen3 (Qwen3, Qwen3.5),"
        " deepseek_r1 (DeepSeek R1 and its distillations, QwQ); chat responses then carry the thinking"
        " as reasoning (and reasoning_content) and only the answer as content; unset: the thinking is"
        " content, as the model wrote it",
    )
    own(
        api,
        "--responses-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help="seconds a response made on /v1/responses with store (the API's default) is kept in Redis,"
        " for previous_response_id (the next turn of a conversation, on any gateway of the deployment),"
        " GET and DELETE /v1/responses/{id} and its input_items; each kept response holds its whole"
        " conversation so far; 0: none is kept (every response says store false, previous_response_id"
        " is a 400)",
    )
    own(
        api,
        "--trust-request-chat-template",
        type=bool,
        default=False,
        help="let chat requests bring their own chat template (chat_template, as vLLM's flag of that"
        " name allows): rendered in Jinja's sandbox, but a template's loops run on the gateway's CPU, so"
        " only for clients you trust; off: such a request is a 400",
    )
    cost = parser.add_argument_group("request limits")
    own(cost, "--max-n", type=int, default=DEFAULT_MAX_N, help="most choices (n) a request may ask for")
    own(
        cost,
        "--max-total-tokens",
        type=int,
        default=DEFAULT_MAX_TOTAL_TOKENS,
        help="most tokens all choices of one request may generate (n x max_tokens, summed over prompts)",
    )
    own(
        cost,
        "--max-choices-in-flight",
        type=int,
        default=DEFAULT_MAX_CHOICES_IN_FLIGHT,
        help="most choices of one request running on workers at once (the rest start as those end)",
    )
    own(
        cost,
        "--tokenizer-threads",
        type=int,
        default=0,
        help="threads that tokenize large prompts (small ones are tokenized inline); 0: half the CPUs, 1-8",
    )
    add_common_options(parser)
