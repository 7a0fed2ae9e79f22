"""The ``yutu`` command line: ``yutu up`` runs the whole local stack; ``yutu <service>`` runs one service.

Each service's options live with the service (``services/<name>/main.py``: ``add_arguments`` and
``run``); this module only dispatches, importing just the service asked for (importing torch for
``yutu gateway --help`` would be slow).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from yutu.config import DEFAULT_REDIS_URL, option

# command -> (module, one-line description)
SERVICES: dict[str, tuple[str, str]] = {
    "gateway": ("services.gateway.main", "OpenAI-compatible HTTP gateway"),
    "worker": ("services.worker.main", "model engine worker (mixed prefill + decode)"),
    "store-master": ("services.store_master.main", "KV store metadata master"),
    "store-node": ("services.store_node.main", "KV store memory node"),
}

USAGE = """usage: yutu <command> [options]

commands:
  up              start the local stack: Redis (if none is running), the KV store, workers, the gateway
{services}

Run `yutu <command> --help` for the options of one command. Every option can also be set
from the environment: the options of `yutu up` and those all services share as YUTU_<OPTION>
(--redis-url is YUTU_REDIS_URL), a service's own options as YUTU_<SERVICE>_<OPTION> (the
gateway's --port is YUTU_GATEWAY_PORT); --help names the variable of each option.
"""

log = logging.getLogger("yutu.up")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    services = "\n".join(f"  {name:<15} {desc}" for name, (_, desc) in SERVICES.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(services=services))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        return up(rest)
    if command not in SERVICES:
        print(f"yutu: unknown command {command!r}\n\n" + USAGE.format(services=services), file=sys.stderr)
        return 2
    module_name, description = SERVICES[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"yutu {command}", description=description)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)))


def up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yutu up",
        description="Start the whole Yutu stack on this machine and serve the OpenAI API until Ctrl-C.",
    )
    option(
        parser,
        "--model",
        default=None,
        help="Hugging Face checkpoint dir (or hub id); none: the built-in demo model",
    )
    option(parser, "--served-model-name", default=None, help="model name clients use")
    option(parser, "--host", default="127.0.0.1", help="gateway bind address")
    option(parser, "--port", type=int, default=8000, help="gateway port")
    option(
        parser,
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help="Redis registry; started locally if unreachable",
    )
    option(parser, "--workers", type=int, default=1, help="number of engine workers")
    option(
        parser,
        "--store-nodes",
        type=int,
        default=1,
        help="KV store memory nodes (0: run without the KV store)",
    )
    option(
        parser, "--store-segment-size", default="256MiB", help="DRAM each store node contributes (e.g. 4GiB)"
    )
    option(parser, "--block-size", type=int, default=16, help="tokens per KV block")
    option(
        parser, "--max-model-len", type=int, default=None, help="context length limit (default: the model's)"
    )
    option(parser, "--kv-cache-memory-mib", type=int, default=512, help="KV cache memory per worker, in MiB")
    option(
        parser,
        "--api-key",
        default=None,
        help="require this bearer token at the gateway (comma separated for several)",
    )
    option(
        parser,
        "--log-dir",
        default=None,
        help="write each service's log to DIR/<name>.log instead of the terminal",
    )
    option(
        parser,
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for every service to be ready",
    )
    return parser


def up(argv: list[str]) -> int:
    from yutu.engine.default_model import DEFAULT_MODEL_NAME
    from yutu.engine.model_source import resolve_model, served_model_name
    from yutu.launcher import ProcessGroup, child_env, free_port, python_module, redis_reachable, start_redis

    args = up_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s yutu up: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polls are not news
    if args.workers < 1:
        raise SystemExit("error: --workers must be at least 1")
    if args.store_nodes < 0:
        raise SystemExit("error: --store-nodes must be 0 or more")
    group = ProcessGroup(Path(args.log_dir) if args.log_dir else None)
    stop_requested = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not redis_reachable(args.redis_url):
            log.info("no Redis at %s: starting redis-server", args.redis_url)
            start_redis(group, args.redis_url, Path.home() / ".cache" / "yutu" / "redis")
        log.info("preparing model %s", args.model or f"{DEFAULT_MODEL_NAME} (built-in demo)")
        model_dir = resolve_model(args.model)
        served = args.served_model_name or served_model_name(args.model, model_dir)
        env = child_env()
        common = ["--redis-url", args.redis_url]
        if args.store_nodes:
            admin_port = free_port()
            master_args = ["--admin-port", str(admin_port), "--instance-id", "store-master", *common]
            group.spawn(
                "store-master",
                python_module("yutu.cli", "store-master", *master_args),
                f"http://127.0.0.1:{admin_port}/ready",
                env,
            )
        for i in range(args.store_nodes):
            admin_port = free_port()
            node_args = ["--admin-port", str(admin_port), "--segment-size", args.store_segment_size,
                         "--instance-id", f"store-node-{i}", *common]  # fmt: skip
            group.spawn(
                f"store-node-{i}",
                python_module("yutu.cli", "store-node", *node_args),
                f"http://127.0.0.1:{admin_port}/ready",
                env,
            )
        for i in range(args.workers):
            admin_port = free_port()
            worker_args = ["--model", str(model_dir), "--served-model-name", served, "--admin-port", str(admin_port),
                           "--block-size", str(args.block_size), "--kv-cache-memory-mib", str(args.kv_cache_memory_mib),
                           "--instance-id", f"worker-{i}", *common]  # fmt: skip
            if args.max_model_len:
                worker_args += ["--max-model-len", str(args.max_model_len)]
            group.spawn(
                f"worker-{i}",
                python_module("yutu.cli", "worker", *worker_args),
                f"http://127.0.0.1:{admin_port}/ready",
                env,
            )
        gateway_args = [
            "--model",
            str(model_dir),
            "--served-model-name",
            served,
            "--host",
            args.host,
            "--port",
            str(args.port),
            *common,
        ]
        gateway_env = dict(env)
        if args.api_key:  # through the environment, not argv: other users can read a command line in ps
            gateway_env["YUTU_API_KEY"] = args.api_key
        ready_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        group.spawn(
            "gateway",
            python_module("yutu.cli", "gateway", *gateway_args),
            f"http://{ready_host}:{args.port}/ready",
            gateway_env,
        )
        group.wait_ready(args.ready_timeout)
        _banner(f"http://{ready_host}:{args.port}/v1", served, model_dir, args.model is None)
        while not stop_requested:
            exited = group.first_exited()
            if exited is not None:
                log.error("%s exited with code %s; stopping the stack", exited.name, exited.proc.returncode)
                return 1
            time.sleep(0.2)
        log.info("stopping")
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _banner(url: str, served: str, model_dir: Path, demo: bool) -> None:
    lines = [f"Yutu is up: {url}  (model: {served})", f"  try: curl {url}/completions -H 'Content-Type: application/json' "
             f"-d '{{\"model\": \"{served}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'"]  # fmt: skip
    if demo:
        lines += [
            f"  NOTE: {served} is the built-in demo model: random weights, so its text is meaningless.",
            "        Serve a real checkpoint with: make run MODEL=/path/to/hf-dir",
        ]
    lines.append("  Ctrl-C stops everything.")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
