"""Replay a Mooncake trace against a running Yutu stack's OpenAI API; report what the paper measures.

    .venv/bin/python loadtests/replay.py TRACE.jsonl --url http://127.0.0.1:8000 --time-scale 3 \\
        --limit 200 --out out/replay

Every trace request becomes a streamed ``/v1/completions`` call with a token-id prompt synthesised
from its hash ids (``replay_trace``: equal ids, equal tokens, so shared prefixes stay shared),
``max_tokens`` its scaled output length, ``ignore_eos``, temperature 0 and usage in the stream. The
calls leave at their recorded timestamps divided by ``--time-scale``, open loop (none waits for an
earlier one). The report (``replay_report``): TTFT, TBT, TPOT and e2e percentiles, goodput under
the SLOs, the cached-token ratio next to the ideal one, rejections (429), errors, and the
instances named by the ``x-yutu-prefill`` / ``x-yutu-decode`` response headers.

From another script (the folder of this file on ``sys.path``, as it is for scripts run from it)::

    from replay import ReplayConfig, replay
    from replay_report import format_table, write_report

    summary = replay(ReplayConfig(trace=Path("trace.jsonl"), url="http://127.0.0.1:8000", time_scale=3))
    print(format_table(summary)); write_report(summary, Path("out/run1"))
    summary.ttft_ms.p90, summary.goodput["requests_per_s"], summary.cache["cached_ratio"]

``replay`` runs its own event loop; inside one, ``await areplay(config)``. Bad input or an
unreachable server raise ``ReplayError`` with what to do; the run itself always ends by itself:
each request has a timeout and the whole run a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_report import Outcome, RequestRecord, Summary, format_table, summarize, write_report  # noqa: E402
from replay_trace import Synthesis, WireRequest, ideal_cached_tokens, plan, read_trace  # noqa: E402


class ReplayError(Exception):
    """The replay cannot start: bad options, an unusable trace, or a server that cannot be asked."""


@dataclass(frozen=True)
class ReplayConfig:
    """One replay. ``None`` for vocab_size / max_model_len / model: ask the server."""

    trace: Path
    url: str = "http://127.0.0.1:8000"  # the gateway (a trailing /v1 is accepted)
    model: str | None = None
    api_key: str | None = None
    start: int = 0  # first trace line
    limit: int | None = 200  # trace requests at most
    duration_s: float | None = None  # send only what is due within this many seconds of replay time
    time_scale: float = 1.0  # 3: three times faster than recorded
    block_tokens: int = 64  # wire tokens per 512-token trace block
    output_scale: float | None = None  # None: block_tokens / 512
    vocab_size: int | None = None
    max_model_len: int | None = None
    min_token_id: int = 10
    seed: int = 0
    kv_block_size: int = 16  # the engine's KV block size, for the ideal cached ratio
    slo_ttft_ms: float = 1000.0
    slo_tbt_ms: float = 100.0
    request_timeout_s: float = 120.0
    deadline_s: float | None = None  # None: last send time + request_timeout_s + 30 s
    max_connections: int = 512

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class ServerInfo:
    model: str
    max_model_len: int
    vocab_size: int
    vocab_source: str  # "option", "/v1/models" or "/detokenize probe"


# -- the server --------------------------------------------------------------------------------


async def _get_json(client: httpx.AsyncClient, path: str) -> Any:
    try:
        resp = await client.get(path)
    except httpx.HTTPError as exc:
        raise ReplayError(
            f"cannot reach {client.base_url}{path} ({type(exc).__name__}: {exc}): start the stack "
            "(`yutu up`) or pass --url"
        ) from exc
    if resp.status_code != 200:
        raise ReplayError(
            f"GET {path} answered {resp.status_code}: {resp.text[:300]} (check --url / --api-key)"
        )
    return resp.json()


async def _token_id_accepted(client: httpx.AsyncClient, model: str, token_id: int) -> bool:
    try:
        resp = await client.post("/detokenize", json={"model": model, "tokens": [token_id]})
    except httpx.HTTPError as exc:
        raise ReplayError(
            f"/detokenize failed ({type(exc).__name__}) probing the vocabulary: pass --vocab-size"
        ) from exc
    if resp.status_code not in (200, 400):
        raise ReplayError(
            f"/detokenize answered {resp.status_code} while probing the vocabulary size: pass --vocab-size"
        )
    return resp.status_code == 200


async def probe_vocab_size(client: httpx.AsyncClient, model: str) -> int:
    """The server's vocabulary size, found as the smallest token id ``/detokenize`` refuses (400).

    The gateway accepts exactly the ids in ``[0, vocab_size)``: doubling, then bisecting, takes
    about ``2 * log2(vocab_size)`` tiny requests.
    """
    if not await _token_id_accepted(client, model, 0):
        raise ReplayError("/detokenize refuses token id 0: pass --vocab-size")
    lo, hi = 0, 1024  # invariant once hi is refused: lo accepted, hi refused
    while await _token_id_accepted(client, model, hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            raise ReplayError("/detokenize accepts every token id below 2^24: pass --vocab-size")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if await _token_id_accepted(client, model, mid) else (lo, mid)
    return hi


async def discover(client: httpx.AsyncClient, cfg: ReplayConfig) -> ServerInfo:
    """Model, context length and vocabulary size: the options where given, else the server's."""
    cards = (await _get_json(client, "/v1/models")).get("data", [])
    card = next((c for c in cards if cfg.model in (None, c.get("id"))), None)
    if card is None:
        names = ", ".join(str(c.get("id")) for c in cards) or "none"
        raise ReplayError(f"the server does not serve model {cfg.model!r} (it serves: {names}); fix --model")
    max_len = cfg.max_model_len or card.get("max_model_len")
    if not max_len:
        raise ReplayError(
            "the server reports no max_model_len (no worker ready yet?): wait, or pass --max-model-len"
        )
    if cfg.vocab_size is not None:
        vocab, source = cfg.vocab_size, "option"
    elif card.get("vocab_size"):
        vocab, source = int(card["vocab_size"]), "/v1/models"
    else:
        vocab, source = await probe_vocab_size(client, card["id"]), "/detokenize probe"
    return ServerInfo(model=card["id"], max_model_len=int(max_len), vocab_size=vocab, vocab_source=source)


# -- one request -------------------------------------------------------------------------------


def request_body(model: str, req: WireRequest) -> bytes:
    """The JSON body of ``req``, built before the replay starts (no encoding on the send path)."""
    body = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))
    return str(payload)[:200]


async def _read_stream(resp: httpx.Response, rec: RequestRecord, sent: float) -> None:
    """Consume the SSE stream into ``rec``: chunk times, usage, finish reason, an error event.

    One ``json.loads`` per event of a few hundred bytes: negligible next to httpx's own work.
    """
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            rec.outcome = Outcome.OK if rec.error is None else Outcome.ERROR
            return
        event = json.loads(data)
        if "error" in event:
            rec.error, rec.detail = "stream error", _error_message(event)
            continue
        for choice in event.get("choices", ()):
            if choice.get("text"):
                rec.chunk_times_s.append(time.perf_counter() - sent)
            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
        usage = event.get("usage")
        if usage:
            rec.output_tokens = usage.get("completion_tokens")
            rec.usage_prompt_tokens = usage.get("prompt_tokens")
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    rec.outcome, rec.error = Outcome.ERROR, rec.error or "stream ended without [DONE]"


async def _read_refusal(resp: httpx.Response, rec: RequestRecord) -> None:
    """A non-200 answer: 429 is a rejection (with its Retry-After), anything else an error."""
    text = (await resp.aread()).decode(errors="replace")
    try:
        rec.detail = _error_message(json.loads(text))
    except ValueError:
        rec.detail = text[:200]
    if resp.status_code == 429:
        rec.outcome, rec.retry_after = Outcome.REJECTED, resp.headers.get("retry-after")
    else:
        rec.outcome, rec.error = Outcome.ERROR, f"http {resp.status_code}"


async def send_one(client: httpx.AsyncClient, body: bytes, rec: RequestRecord, timeout_s: float,
                   t0: float) -> None:  # fmt: skip
    """Send one request and fill ``rec`` (``t0``: the replay's start); raises only when cancelled."""
    sent = time.perf_counter()
    rec.sent_at_s = sent - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST", "/v1/completions", content=body, headers={"content-type": "application/json"}
            ) as resp:
                rec.status = resp.status_code
                rec.request_id = resp.headers.get("x-request-id")
                rec.prefill = resp.headers.get("x-yutu-prefill")
                rec.decode = resp.headers.get("x-yutu-decode")
                if resp.status_code == 200:
                    await _read_stream(resp, rec, sent)
                else:
                    await _read_refusal(resp, rec)
    except (TimeoutError, httpx.TimeoutException):
        rec.outcome, rec.error = Outcome.TIMEOUT, "timeout"
        rec.detail = f"no end of stream within {timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        rec.outcome, rec.error, rec.detail = Outcome.ERROR, type(exc).__name__, str(exc)[:200]
    finally:
        rec.finish_timing(time.perf_counter() - sent)


# -- the replay --------------------------------------------------------------------------------


async def _drive(client: httpx.AsyncClient, cfg: ReplayConfig, wire: list[WireRequest], bodies: list[bytes],
                 records: list[RequestRecord]) -> None:  # fmt: skip
    """Send every request at its time (open loop), then wait for all of them until the deadline."""
    last_send = wire[-1].send_at_s if wire else 0.0
    deadline = cfg.deadline_s if cfg.deadline_s is not None else last_send + cfg.request_timeout_s + 30.0
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    for req, body, rec in zip(wire, bodies, records, strict=True):
        if req.send_at_s > deadline:
            break  # the rest stay UNSENT
        delay = req.send_at_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)  # the schedule itself, not synchronisation
        tasks.append(asyncio.create_task(send_one(client, body, rec, cfg.request_timeout_s, t0)))
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - (time.perf_counter() - t0)))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for rec, task in zip(records, tasks, strict=False):
        if task in pending:
            rec.outcome, rec.detail = Outcome.DEADLINE, f"still running at the {deadline:g} s deadline"


def _check(cfg: ReplayConfig) -> None:
    for name in ("time_scale", "request_timeout_s", "slo_ttft_ms", "slo_tbt_ms"):
        if getattr(cfg, name) <= 0:
            raise ReplayError(f"{name} must be > 0, got {getattr(cfg, name)}")
    if cfg.start < 0 or (cfg.limit is not None and cfg.limit < 1):
        raise ReplayError(f"start must be >= 0 and limit >= 1, got start={cfg.start} limit={cfg.limit}")
    if cfg.max_connections < 1:
        raise ReplayError(f"max_connections must be >= 1, got {cfg.max_connections}")


async def areplay(cfg: ReplayConfig) -> Summary:
    """Replay ``cfg.trace`` against ``cfg.url`` and summarise it (see the module docstring)."""
    _check(cfg)
    try:
        trace = read_trace(cfg.trace, cfg.start, cfg.limit)
    except ValueError as exc:
        raise ReplayError(str(exc)) from exc
    if not trace:
        raise ReplayError(f"{cfg.trace} has no requests from line {cfg.start + 1}: lower --start")
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(30.0, cfg.request_timeout_s))
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        server = await discover(client, cfg)
        try:
            synthesis = Synthesis(
                vocab_size=server.vocab_size, max_model_len=server.max_model_len, block_tokens=cfg.block_tokens,
                min_token_id=cfg.min_token_id, seed=cfg.seed, output_scale=cfg.output_scale,
            )  # fmt: skip
            wire = plan(trace, synthesis, cfg.time_scale, cfg.duration_s)
            ideal = ideal_cached_tokens(wire, cfg.block_tokens, cfg.kv_block_size)
        except ValueError as exc:
            raise ReplayError(str(exc)) from exc
        bodies = [request_body(server.model, req) for req in wire]
        records = [
            RequestRecord(
                line=req.trace.line,
                send_at_s=req.send_at_s,
                prompt_tokens=len(req.prompt),
                max_tokens=req.max_tokens,
                ideal_cached_tokens=cached,
                prompt_tokens_cut=req.prompt_tokens_cut,
                output_tokens_cut=req.output_tokens_cut,
            )  # fmt: skip
            for req, cached in zip(wire, ideal, strict=True)
        ]
        await _drive(client, cfg, wire, bodies, records)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()}
    config.pop("api_key")
    return summarize(records, config, dataclasses.asdict(server), cfg.slo_ttft_ms, cfg.slo_tbt_ms)


def replay(cfg: ReplayConfig) -> Summary:
    """``areplay`` on a fresh uvloop event loop (like every Yutu service): for scripts without a loop."""
    return uvloop.run(areplay(cfg))


# -- the command line --------------------------------------------------------------------------


# (group, flag, ReplayConfig field, type, help); defaults come from ReplayConfig
_OPTIONS: list[tuple[str, str, str, Any, str]] = [
    ("server", "--url", "url", str, "the gateway's base URL (with or without /v1)"),
    ("server", "--model", "model", str, "model to request (default: the first the server lists)"),
    ("which requests, when", "--start", "start", int, "first trace line to replay (0-based)"),
    ("which requests, when", "--limit", "limit", int, "replay at most this many trace requests (0: all)"),
    ("which requests, when", "--duration", "duration_s", float,
     "send only the requests due within this many seconds of replay time (after --time-scale)"),
    ("which requests, when", "--time-scale", "time_scale", float,
     "divide recorded timestamps by this: 3 replays three times faster"),
    ("token synthesis", "--block-tokens", "block_tokens", int,
     "tokens each 512-token trace block becomes; input lengths scale by block-tokens/512"),
    ("token synthesis", "--output-scale", "output_scale", float,
     "max_tokens = ceil(output_length * this), at least 1 (default: block-tokens/512)"),
    ("token synthesis", "--vocab-size", "vocab_size", int,
     "token ids are drawn below this (default: the server's: /v1/models, else probed on /detokenize)"),
    ("token synthesis", "--max-model-len", "max_model_len", int,
     "cap on prompt + max_tokens; longer prompts lose their tail (default: the server's, /v1/models)"),
    ("token synthesis", "--min-token-id", "min_token_id", int, "smallest token id drawn"),
    ("token synthesis", "--seed", "seed", int, "seed of the token synthesis: block tokens from (seed, hash id)"),
    ("token synthesis", "--kv-block-size", "kv_block_size", int,
     "the engine's KV block size: the ideal cached ratio counts only full blocks"),
    ("report and limits", "--slo-ttft-ms", "slo_ttft_ms", float, "TTFT SLO for goodput"),
    ("report and limits", "--slo-tbt-ms", "slo_tbt_ms", float, "TBT SLO for goodput"),
    ("report and limits", "--request-timeout", "request_timeout_s", float,
     "seconds one request may take, its whole stream included"),
    ("report and limits", "--deadline", "deadline_s", float,
     "seconds after the start when whatever still runs is cancelled (default: last send + timeout + 30)"),
    ("report and limits", "--max-connections", "max_connections", int, "HTTP connection pool size"),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Replay a Mooncake trace (JSON Lines: timestamp, input_length, output_length, hash_ids) "
        "against a Yutu stack's OpenAI API, open loop, and report TTFT, TBT, TPOT, goodput under SLOs, "
        "the cached-token ratio next to the ideal one, rejections, errors and the instances used.",
    )
    p.add_argument("trace", type=Path, help="Mooncake trace file (.jsonl)")
    defaults = ReplayConfig(trace=Path("."))
    groups: dict[str, argparse._ArgumentGroup] = {}
    for group, flag, dest, kind, text in _OPTIONS:
        g = groups.setdefault(group, p.add_argument_group(group))
        default = getattr(defaults, dest)
        shown = "" if default is None else " (default: %(default)s)"
        metavar = flag.lstrip("-").replace("-", "_").upper()
        g.add_argument(flag, dest=dest, type=kind, default=default, metavar=metavar, help=text + shown)
    groups["server"].add_argument(
        "--api-key", default=os.environ.get("YUTU_API_KEY"), help="bearer token (default: $YUTU_API_KEY)"
    )
    groups["report and limits"].add_argument(
        "--out", type=Path, default=None, help="write DIR/summary.json, DIR/requests.jsonl and PNG plots"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    out = args.pop("out")
    args["limit"] = args["limit"] or None  # 0: the whole trace from --start
    try:
        summary = replay(ReplayConfig(**args))
    except ReplayError as exc:
        print(f"replay: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary))
    if out is not None:
        for path in write_report(summary, out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
