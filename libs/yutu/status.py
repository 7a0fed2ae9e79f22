"""``yutu status``: the whole deployment at a glance, from the registry and the admin endpoints.

    yutu status [--redis-url URL] [--registry-prefix yutu] [--watch SECONDS] [--json]

One row per registered instance, by kind: whether its ``/ready`` answers 200 (or why not), its
endpoints, and what it carries -- engines (mixed, prefill, decode) their running and waiting
requests and KV usage from their registry record; the store master its objects and memory in use
(``/stats``); the conductor its policy (``/policy``). Reading is all it does: nothing is changed.
Instances whose admin endpoint does not answer within a second are shown as unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from yutu.config import DEFAULT_REDIS_URL, option

KINDS = ("gateway", "conductor", "prefill", "decode", "worker", "store-master", "store-node")
ENGINES = ("prefill", "decode", "worker")
HTTP_TIMEOUT_S = 1.0


@dataclass
class Row:
    kind: str
    instance_id: str
    ready: str  # "yes", "no: <why>" or "unreachable: <error>"
    endpoint: str  # its HTTP or admin URL
    load: dict[str, Any] = field(default_factory=dict)


def _admin_url(record: dict[str, Any]) -> str | None:
    endpoints = record.get("endpoints") or {}
    return endpoints.get("admin") or endpoints.get("http")


def _ready(http: Any, url: str | None) -> str:
    import httpx

    if url is None:
        return "unknown: no admin endpoint registered"
    try:
        resp = http.get(f"{url}/ready")
    except httpx.HTTPError as exc:
        return f"unreachable: {type(exc).__name__}"
    if resp.status_code == 200:
        return "yes"
    try:
        detail = resp.json().get("problems") or resp.json()
    except ValueError:
        detail = resp.text[:200]
    return f"no: {detail}"


def _load(http: Any, kind: str, record: dict[str, Any], url: str | None) -> dict[str, Any]:
    import httpx

    meta = record.get("meta") or {}
    if kind in ENGINES:
        out = {k: meta[k] for k in ("num_running", "num_waiting", "kv_usage", "dtype") if k in meta}
        if meta.get("broken"):
            out["broken"] = meta["broken"]
        return out
    if url is None or kind not in ("store-master", "conductor"):
        return {}
    try:
        if kind == "store-master":
            stats = http.get(f"{url}/stats").json()
            return {k: stats[k] for k in ("objects", "used", "capacity", "usage", "segments") if k in stats}
        policy = http.get(f"{url}/policy").json()
        return {k: policy[k] for k in ("policy", "disagg_threshold", "prefill_stealing") if k in policy}
    except (httpx.HTTPError, ValueError, TypeError):
        return {}


def collect(redis_url: str, prefix: str = "yutu") -> list[Row]:
    """Every registered instance with its readiness and load; raises redis errors if Redis is down."""
    import httpx
    import redis

    rows: list[Row] = []
    with (
        redis.Redis.from_url(redis_url, socket_timeout=2.0) as r,
        httpx.Client(timeout=HTTP_TIMEOUT_S) as http,
    ):
        for kind in KINDS:
            for key in sorted(r.scan_iter(f"{prefix}:svc:{kind}:*")):
                raw = r.get(key)
                if raw is None:
                    continue  # expired meanwhile
                try:
                    record = json.loads(raw)
                    instance_id = str(record["instance_id"])
                except (ValueError, KeyError, TypeError):
                    rows.append(Row(kind, key.decode(errors="replace"), "no: malformed registry record", ""))
                    continue
                url = _admin_url(record)
                rows.append(
                    Row(kind, instance_id, _ready(http, url), url or "", _load(http, kind, record, url))
                )
    return rows


def _fmt_load(load: dict[str, Any]) -> str:
    parts = []
    for k, v in load.items():
        if k in ("used", "capacity") and isinstance(v, int):
            v = f"{v / 2**20:.0f} MiB"
        elif k in ("kv_usage", "usage") and isinstance(v, float):
            v = f"{v:.0%}"
        parts.append(f"{k} {v}")
    return ", ".join(parts)


def render(rows: list[Row]) -> str:
    if not rows:
        return "no instance is registered (is the stack up, and is --redis-url / --registry-prefix its?)"
    head = ("KIND", "INSTANCE", "READY", "ENDPOINT", "LOAD")
    table = [head] + [(r.kind, r.instance_id, r.ready, r.endpoint, _fmt_load(r.load)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in table
    ).rstrip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    option(parser, "--redis-url", default=DEFAULT_REDIS_URL, help="the deployment's Redis registry")
    option(parser, "--registry-prefix", default="yutu", help="the deployment's registry prefix")
    parser.add_argument(
        "--watch", type=float, default=None, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import redis

    if args.watch is not None and args.watch <= 0:
        raise SystemExit("yutu status: error: --watch must be a positive number of seconds")
    while True:
        try:
            rows = collect(args.redis_url, args.registry_prefix)
        except (redis.RedisError, OSError) as exc:
            print(f"yutu status: cannot read the registry at {args.redis_url}: {exc}", file=sys.stderr)
            return 1
        text = json.dumps([asdict(r) for r in rows], indent=2) if args.json else render(rows)
        if args.watch is None:
            print(text)
            return 0
        print("\x1b[2J\x1b[H" + time.strftime("%H:%M:%S ") + args.redis_url + "\n" + text, flush=True)
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
