"""What a replay measured: one record per request, the summary Mooncake's paper reports, its outputs.

The metrics, per request (all from the client's clock, ``time.perf_counter``):

- TTFT: send -> the first chunk carrying content (text);
- TBT: the paper's time between tokens, the mean of the request's worst 10% inter-token gaps
  (gaps between content chunks; at least one gap is taken); none with fewer than two chunks;
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``; none with fewer than two tokens;
- e2e: send -> the end of the stream.

Goodput counts the completed requests that meet both SLOs (TTFT <= ``slo_ttft_ms`` and TBT <=
``slo_tbt_ms``; a request without a TBT meets that one), per second of the replay's makespan
(first send to last end) and as a share of the requests sent.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TBT_WORST_SHARE = 0.1


class Outcome:
    """How a request ended (plain strings, so records serialise as they are)."""

    OK = "ok"  # the stream ended with [DONE] and carried usage
    REJECTED = "rejected"  # HTTP 429 (the server shed load; Retry-After recorded)
    ERROR = "error"  # any other HTTP status, an error event in the stream, a transport failure
    TIMEOUT = "timeout"  # past the per-request timeout
    DEADLINE = "deadline"  # still running at the overall deadline, cancelled
    UNSENT = "unsent"  # its send time came after the overall deadline


@dataclass
class RequestRecord:
    """One request of the replay: what was sent, and what came back. Filled in by the client."""

    line: int  # trace line
    send_at_s: float  # scheduled send time, seconds after the replay started
    prompt_tokens: int  # token ids sent
    max_tokens: int
    ideal_cached_tokens: int
    prompt_tokens_cut: int
    output_tokens_cut: int
    outcome: str = Outcome.UNSENT
    sent_at_s: float | None = None  # actual send time
    status: int | None = None  # HTTP status
    error: str | None = None  # its kind, what the summary counts: "http 400", "stream error", "timeout", ...
    detail: str | None = None  # the server's message (or the exception's)
    retry_after: str | None = None
    ttft_ms: float | None = None
    tbt_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    chunks: int = 0  # content chunks received
    output_tokens: int | None = None  # usage.completion_tokens
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    request_id: str | None = None  # x-request-id
    prefill: str | None = None  # x-yutu-prefill
    decode: str | None = None  # x-yutu-decode
    chunk_times_s: list[float] = field(default_factory=list, repr=False)  # content chunks, after send

    def finish_timing(self, end_s: float) -> None:
        """Derive TTFT, TBT, TPOT and e2e from the chunk times and the end (seconds after send)."""
        self.e2e_ms = end_s * 1000.0
        times = self.chunk_times_s
        self.chunks = len(times)
        if not times:
            return
        self.ttft_ms = times[0] * 1000.0
        self.tbt_ms = tbt_ms(times)
        tokens = self.output_tokens if self.output_tokens is not None else len(times)
        if tokens >= 2:
            self.tpot_ms = (self.e2e_ms - self.ttft_ms) / (tokens - 1)

    def meets(self, slo_ttft_ms: float, slo_tbt_ms: float) -> bool:
        return (
            self.outcome == Outcome.OK
            and self.ttft_ms is not None
            and self.ttft_ms <= slo_ttft_ms
            and (self.tbt_ms is None or self.tbt_ms <= slo_tbt_ms)
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["chunk_times_s"]
        return out


def tbt_ms(chunk_times_s: Sequence[float], worst_share: float = TBT_WORST_SHARE) -> float | None:
    """Mean of the worst ``worst_share`` of the gaps between consecutive chunk times, in ms."""
    gaps = np.diff(np.asarray(chunk_times_s, dtype=np.float64))
    if gaps.size == 0:
        return None
    k = max(1, math.ceil(gaps.size * worst_share))
    worst = np.sort(gaps)[-k:]
    return float(worst.mean() * 1000.0)


@dataclass(frozen=True)
class Stat:
    """Percentiles (linear interpolation) and mean of one metric over the requests that have it."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stat:
        xs = np.asarray([v for v in values if v is not None], dtype=np.float64)
        if xs.size == 0:
            return cls(0, None, None, None, None)
        p50, p90, p99 = (float(v) for v in np.percentile(xs, [50, 90, 99]))
        return cls(int(xs.size), float(xs.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    """Everything a replay reports; ``to_json()`` is summary.json, ``records`` the per-request lines."""

    config: dict[str, Any]
    server: dict[str, Any]
    requests: dict[str, int]  # planned, sent, then a count per outcome
    errors: dict[str, int]  # per reason: "http 400", "stream error", "ReadError", ...
    retry_after: dict[str, int]  # Retry-After values of the 429s
    ttft_ms: Stat
    tbt_ms: Stat
    tpot_ms: Stat
    e2e_ms: Stat
    goodput: dict[str, float]
    throughput: dict[str, float]
    cache: dict[str, float]
    tokens: dict[str, int]
    instances: dict[str, dict[str, int]]  # "prefill" / "decode" -> instance -> requests
    records: list[RequestRecord] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "records"}
        return {k: dataclasses.asdict(v) if isinstance(v, Stat) else v for k, v in out.items()}


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def summarize(records: Sequence[RequestRecord], config: dict[str, Any], server: dict[str, Any],
              slo_ttft_ms: float, slo_tbt_ms: float) -> Summary:  # fmt: skip
    """The summary of a finished replay (every record has its final outcome)."""
    sent = [r for r in records if r.outcome != Outcome.UNSENT]
    ok = [r for r in records if r.outcome == Outcome.OK]
    outcomes = Counter(r.outcome for r in records)
    starts = [r.sent_at_s for r in sent if r.sent_at_s is not None]
    ends = [r.sent_at_s + r.e2e_ms / 1000.0 for r in sent if r.sent_at_s is not None and r.e2e_ms is not None]
    makespan = max(ends) - min(starts) if starts and ends else 0.0
    met = sum(r.meets(slo_ttft_ms, slo_tbt_ms) for r in records)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    usage_prompt = sum(r.usage_prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ideal = sum(r.ideal_cached_tokens for r in records)
    planned_prompt = sum(r.prompt_tokens for r in records)
    return Summary(
        config=config,
        server=server,
        requests={
            "planned": len(records),
            "sent": len(sent),
            "completed": len(ok),
            **{
                o: outcomes.get(o, 0)
                for o in (Outcome.REJECTED, Outcome.ERROR, Outcome.TIMEOUT, Outcome.DEADLINE, Outcome.UNSENT)
            },
        },  # fmt: skip
        errors=dict(
            Counter(r.error or "?" for r in records if r.outcome in (Outcome.ERROR, Outcome.TIMEOUT))
        ),
        retry_after=dict(Counter(r.retry_after or "none" for r in records if r.outcome == Outcome.REJECTED)),
        ttft_ms=Stat.of([r.ttft_ms for r in ok]),
        tbt_ms=Stat.of([r.tbt_ms for r in ok]),
        tpot_ms=Stat.of([r.tpot_ms for r in ok]),
        e2e_ms=Stat.of([r.e2e_ms for r in ok]),
        goodput={
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tbt_ms": slo_tbt_ms,
            "requests_meeting_slo": met,
            "share": _ratio(met, len(sent)),
            "requests_per_s": _ratio(met, makespan),
        },
        throughput={
            "makespan_s": makespan,
            "completed_per_s": _ratio(len(ok), makespan),
            "output_tokens_per_s": _ratio(output_tokens, makespan),
            "prompt_tokens_per_s": _ratio(usage_prompt, makespan),
        },
        cache={
            "cached_tokens": cached,
            "prompt_tokens": usage_prompt,
            "cached_ratio": _ratio(cached, usage_prompt),
            "ideal_cached_tokens": ideal,
            "ideal_prompt_tokens": planned_prompt,
            "ideal_cached_ratio": _ratio(ideal, planned_prompt),
        },
        tokens={
            "prompt_tokens_sent": sum(r.prompt_tokens for r in sent),
            "prompt_tokens_cut": sum(r.prompt_tokens_cut for r in records),
            "requests_truncated": sum(r.prompt_tokens_cut > 0 for r in records),
            "output_tokens_cut": sum(r.output_tokens_cut for r in records),
            "max_tokens_requested": sum(r.max_tokens for r in sent),
            "output_tokens": output_tokens,
        },
        instances={
            "prefill": dict(Counter(r.prefill for r in sent if r.prefill is not None)),
            "decode": dict(Counter(r.decode for r in sent if r.decode is not None)),
        },
        records=list(records),
    )


# -- outputs -----------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(s: Summary) -> str:
    """A readable report of ``s`` (what the CLI prints)."""
    req, cache, good = s.requests, s.cache, s.goodput
    lines = [
        f"requests: {req['planned']} planned, {req['sent']} sent, {req['completed']} completed, "
        f"{req['rejected']} rejected (429), {req['error']} errors, {req['timeout']} timed out, "
        f"{req['deadline']} cut at the deadline, {req['unsent']} unsent",
        "",
        f"{'metric':<10}{'count':>7}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, stat in (
        ("TTFT ms", s.ttft_ms),
        ("TBT ms", s.tbt_ms),
        ("TPOT ms", s.tpot_ms),
        ("e2e ms", s.e2e_ms),
    ):
        lines.append(
            f"{name:<10}{stat.count:>7}{_fmt(stat.mean):>10}{_fmt(stat.p50):>10}{_fmt(stat.p90):>10}{_fmt(stat.p99):>10}"
        )
    lines += [
        "",
        f"goodput (TTFT <= {good['slo_ttft_ms']:g} ms and TBT <= {good['slo_tbt_ms']:g} ms): "
        f"{good['requests_per_s']:.3f} req/s, {good['share']:.1%} of sent ({good['requests_meeting_slo']:g})",
        f"throughput: {s.throughput['completed_per_s']:.3f} req/s, "
        f"{s.throughput['output_tokens_per_s']:.1f} output tok/s over {s.throughput['makespan_s']:.1f} s",
        f"cached tokens: {cache['cached_ratio']:.1%} ({cache['cached_tokens']:g} of {cache['prompt_tokens']:g}); "
        f"ideal with an unlimited prefix cache: {cache['ideal_cached_ratio']:.1%}",
        f"prompts truncated to fit: {s.tokens['requests_truncated']} ({s.tokens['prompt_tokens_cut']} tokens cut)",
    ]
    if s.errors:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())))
    if s.retry_after:
        lines.append(
            "Retry-After of rejections: " + ", ".join(f"{k}: {v}" for k, v in sorted(s.retry_after.items()))
        )
    for role, counts in s.instances.items():
        if counts:
            lines.append(f"{role} instances: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def write_report(s: Summary, out_dir: Path) -> list[Path]:
    """Write summary.json, requests.jsonl and, with matplotlib, the plots; returns the paths written.

    Without matplotlib the plots are skipped and ``plots_skipped.txt`` says how to get them.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, per_request = out_dir / "summary.json", out_dir / "requests.jsonl"
    summary.write_text(json.dumps(s.to_json(), indent=2) + "\n")
    per_request.write_text("".join(json.dumps(r.to_json()) + "\n" for r in s.records))
    written = [summary, per_request]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note = out_dir / "plots_skipped.txt"
        note.write_text(PLOTS_SKIPPED + "\n")
        return [*written, note]
    ok = [r for r in s.records if r.outcome == Outcome.OK]
    for name, values, label in (
        ("ttft_cdf.png", [r.ttft_ms for r in ok], "TTFT (ms)"),
        ("tbt_cdf.png", [r.tbt_ms for r in ok], "TBT: mean of the worst 10% gaps (ms)"),
    ):
        xs = np.sort(np.asarray([v for v in values if v is not None], dtype=np.float64))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.step(xs, np.arange(1, xs.size + 1) / max(1, xs.size), where="post")
        ax.set(
            xlabel=label, ylabel="share of requests", title=f"{label.split(':')[0]} CDF ({xs.size} requests)"
        )
        ax.grid(alpha=0.3)
        fig.savefig(out_dir / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(6, 4))
    timed = [(r.sent_at_s, r.ttft_ms) for r in ok if r.sent_at_s is not None and r.ttft_ms is not None]
    ax.scatter([t for t, _ in timed], [v for _, v in timed], s=8)
    ax.axhline(s.goodput["slo_ttft_ms"], color="red", linestyle="--", label="TTFT SLO")
    ax.set(xlabel="arrival (s after the replay started)", ylabel="TTFT (ms)", title="TTFT over arrival time")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(out_dir / "ttft_over_time.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [*written, out_dir / "ttft_over_time.png"]


PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install -e '.[load]' installs it)"
