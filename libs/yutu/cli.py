"""The ``yutu`` command line: ``yutu up`` runs the whole local stack; ``yutu <service>`` runs one service.

Each service's options live with the service (``services/<name>/main.py``: ``add_arguments`` and
``run``); this module only dispatches, importing just the service asked for (importing torch for
``yutu gateway --help`` would be slow).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from yutu.config import DEFAULT_REDIS_URL, DEVICES, DTYPES, KERNEL_CHOICES, add_policy_options, option
from yutu.restarts import MAX_RESTARTS, RESTART_WINDOW_S

# command -> (module, one-line description)
SERVICES: dict[str, tuple[str, str]] = {
    "gateway": ("services.gateway.main", "OpenAI-compatible HTTP gateway"),
    "worker": ("services.worker.main", "model engine worker (mixed prefill + decode)"),
    "conductor": ("services.conductor.main", "KV-cache-aware global scheduler (places requests)"),
    "prefill": ("services.prefill.main", "prefill instance (first tokens; KV held for the decode)"),
    "decode": ("services.decode.main", "decode instance (pulls the KV, streams the tokens)"),
    "store-master": ("services.store_master.main", "KV store metadata master"),
    "store-node": ("services.store_node.main", "KV store memory node"),
    "simulate": ("yutu.sim.main", "replay a Mooncake trace through a simulated cluster (docs/simulation.md)"),
    "calibrate": ("yutu.sim.calibrate", "measure our engine and write a simulator profile"),
    "status": ("yutu.status", "the deployment at a glance: instances, readiness, load, store usage"),
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

if TYPE_CHECKING:
    from yutu.launcher import ChildSpec

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
    try:
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"yutu {command}", description=description)
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(rest)))
    except KeyboardInterrupt:  # Ctrl-C before the service took over its signals (still importing)
        return 130


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
    option(
        parser,
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="text, or json for yutu up and every service (one object per line, with request_id)",
    )
    option(parser, "--host", default="127.0.0.1", help="gateway bind address")
    option(parser, "--port", type=int, default=8000, help="gateway port")
    option(
        parser,
        "--redis-url",
        default=DEFAULT_REDIS_URL,
        help="Redis registry; started locally if unreachable",
    )
    option(
        parser,
        "--redis-dir",
        default=None,
        help="where a Redis started here keeps its append-only file (default: "
        "~/.cache/yutu/redis/<port>, so a restarted stack finds its store metadata again)",
    )
    topology = parser.add_argument_group(
        "topology (disaggregated by default: a conductor, prefill and decode pools)"
    )
    option(topology, "--prefill", type=int, default=1, help="prefill instances (disaggregated stack)")
    option(topology, "--decode", type=int, default=1, help="decode instances (disaggregated stack)")
    option(
        topology,
        "--workers",
        type=int,
        default=None,
        help="run K mixed workers (prefill + decode in one process) instead: no conductor, prefill or decode instances",
    )
    option(
        topology,
        "--torch-threads",
        type=int,
        default=0,
        help="torch threads per engine process (0: the CPUs left after one for the front ends, shared by the engines)",
    )
    option(
        topology,
        "--prefill-threads",
        type=int,
        default=0,
        help="most torch threads per engine for a step of 256 tokens or more, a long prompt's chunk;"
        " such a step takes the CPUs no other engine computes on, never fewer than --torch-threads"
        " (0: every CPU -- a prefill instance uses the decode's core while the decode idles)",
    )
    option(
        topology,
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="engine dtype for every instance (auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32)",
    )
    option(
        topology,
        "--device",
        default="auto",
        choices=DEVICES,
        help="where every instance's engine computes: cpu or cuda (all on the current CUDA device); auto:"
        " cuda where torch sees a GPU",
    )
    option(
        topology,
        "--kernels",
        default="auto",
        choices=KERNEL_CHOICES,
        help="the engines' CPU kernels for every instance (decode attention, norms, rotary, SwiGLU): native"
        " (C++ built once per machine), torch (torch's operations) or auto (native where they build, else"
        " torch, with a warning)",
    )
    option(
        topology,
        "--engine-core",
        default="process",
        choices=("process", "thread"),
        help="where each instance's model runs: process (its own child process) or thread (inside the worker)",
    )
    conductor = parser.add_argument_group("conductor (disaggregated stack)")
    # Prefill stealing on: one host's instances share its cores, and a decode instance that takes a
    # prefill off a long queue puts its own core to work on it (docs/architecture.md, measured).
    add_policy_options(conductor, scope="", prefill_stealing=True)
    option(
        conductor,
        "--admin-token",
        default=None,
        help="bearer token for the conductor's PUT /policy (none: the policy is fixed while it runs)",
    )
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
        parser,
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's; a LongRoPE model's pretraining length, past which "
        "every sequence is rotated by its long factors)",
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
        "--tool-call-parser",
        default=None,
        choices=("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite", "phi4_mini_json"),
        help="the model's tool-call format, for chat requests with tools and tool_choice auto (the"
        " gateway's --tool-call-parser: hermes for Hermes and Qwen, llama3_json for Llama 3.1-3.3,"
        " mistral for Mistral and Mixtral, pythonic for Llama 3.2 and 4, qwen3_coder for Qwen3-Coder,"
        " granite for Granite 3, phi4_mini_json for Phi-4-mini)",
    )
    option(
        parser,
        "--reasoning-parser",
        default=None,
        choices=("deepseek_r1", "qwen3"),
        help="a reasoning model's thinking markers (the gateway's --reasoning-parser: qwen3 for Qwen3,"
        " deepseek_r1 for DeepSeek R1 and QwQ): chat responses carry the thinking as reasoning, apart"
        " from the answer",
    )
    option(
        parser,
        "--trust-request-chat-template",
        type=bool,
        default=False,
        help="let chat requests bring their own chat template (the gateway's flag of that name: only"
        " for clients you trust, a template runs on the gateway's CPU)",
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
    option(
        parser,
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help="restarts of one crashed child within --restart-window before the stack stops (0: none)",
    )
    option(
        parser,
        "--restart-window",
        type=float,
        default=RESTART_WINDOW_S,
        help="seconds over which --max-restarts is counted",
    )
    return parser


def up(argv: list[str]) -> int:
    """Run the stack until Ctrl-C/SIGTERM (0) or until it cannot go on (1).

    Every child but the gateway is restarted when it crashes (:class:`yutu.launcher.ProcessGroup`);
    the gateway's exit, a crash loop or a child that dies before the stack is first ready stops it.
    """
    from urllib.parse import urlparse

    from yutu.engine.default_model import DEFAULT_MODEL_NAME
    from yutu.engine.model_source import resolve_model, served_model_name
    from yutu.launcher import ProcessGroup, redis_reachable, start_redis
    from yutu.restarts import RestartPolicy
    from yutu.transfer.region import reclaim_stale_regions

    args = up_parser().parse_args(argv)
    if args.log_format == "json":
        from yutu.logs import setup_logging

        setup_logging("info", "json")
        os.environ["YUTU_LOG_FORMAT"] = "json"  # every child it starts logs JSON too (child_env)
    else:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s yutu up: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # readiness polls are not news
    if args.workers is not None and args.workers < 1:
        raise SystemExit("error: --workers must be at least 1")
    if args.workers is None and (args.prefill < 1 or args.decode < 1):
        raise SystemExit(
            "error: --prefill and --decode must be at least 1 (or run mixed workers with --workers K)"
        )
    if args.store_nodes < 0:
        raise SystemExit("error: --store-nodes must be 0 or more")
    if args.torch_threads < 0 or args.prefill_threads < 0:
        raise SystemExit("error: --torch-threads and --prefill-threads must be 0 (derived) or more")
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    group = ProcessGroup(Path(args.log_dir) if args.log_dir else None, policy)
    stop_requested = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        reclaim_stale_regions()  # shared memory of store nodes that were killed outright
        if not redis_reachable(args.redis_url):
            data_dir = (
                Path(args.redis_dir)
                if args.redis_dir
                else Path.home() / ".cache" / "yutu" / "redis" / str(urlparse(args.redis_url).port or 6379)
            )
            log.info(
                "no Redis at %s: starting redis-server (append-only file in %s)", args.redis_url, data_dir
            )
            start_redis(group, args.redis_url, data_dir, persist=True, restart=True)
        log.info("preparing model %s", args.model or f"{DEFAULT_MODEL_NAME} (built-in demo)")
        model_dir = resolve_model(args.model)
        served = args.served_model_name or served_model_name(args.model, model_dir)
        prepare_kernels(args.kernels, args.device)
        if stop_requested:
            return 0
        for spec in stack_specs(args, model_dir, served):
            group.start(spec)
        deadline = time.monotonic() + args.ready_timeout
        if not group.wait_ready(args.ready_timeout, lambda: stop_requested):
            log.info("stopping before the stack was ready")
            return 0
        ready_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        conductor = next((c for c in group.children if c.spec.name == "conductor"), None)
        conductor_url = (
            None
            if conductor is None or conductor.ready_url is None
            else conductor.ready_url.removesuffix("/ready")
        )
        engines = [
            c.spec.name for c in group.children if c.spec.name.startswith(("worker-", "prefill-", "decode-"))
        ]

        def supervised_stop() -> bool:  # children are supervised (restarted) while they find each other
            fatal = group.supervise()
            if fatal is not None:
                raise RuntimeError(fatal)
            return stop_requested

        if not wait_serving(f"http://{ready_host}:{args.port}", conductor_url, engines,
                            deadline - time.monotonic(), supervised_stop):  # fmt: skip
            log.info("stopping before the stack was ready")
            return 0
        _banner(
            f"http://{ready_host}:{args.port}/v1", served, model_dir, args.model is None, conductor_url, args
        )
        while not stop_requested:
            fatal = group.supervise()
            if fatal is not None:
                log.error("%s", fatal)
                return 1
            time.sleep(0.2)
        log.info("stopping")
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        group.stop()
        reclaim_stale_regions()  # and what children killed outright while it ran left behind
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_serving(
    gateway_url: str,
    conductor_url: str | None,
    engines: list[str],
    timeout_s: float,
    should_stop: Callable[[], bool],
) -> bool:
    """Block until a request would be served: the gateway uses every engine instance (its /info) and
    the conductor places on every one (its /instances). Each service is ready on its own before
    they have found each other through the registry; without this wait the first requests after
    the banner could meet "no decode instance is live". False if ``should_stop()``; TimeoutError
    names what is still missing when time runs out."""
    import httpx

    deadline = time.monotonic() + max(timeout_s, 0.0)
    missing: list[str] = []
    with httpx.Client(timeout=2.0) as http:
        while True:
            if should_stop():
                return False
            try:
                info = http.get(f"{gateway_url}/info").json()
                usable = {
                    w["instance_id"]
                    for kind in ("workers", "decode", "prefill")
                    for w in info[kind]
                    if w["usable"]
                }
                missing = [f"{name} (gateway)" for name in engines if name not in usable]
                if conductor_url is not None:
                    rows = http.get(f"{conductor_url}/instances").json()["instances"]
                    live = {row["instance_id"] for row in rows if row["live"]}
                    missing += [f"{name} (conductor)" for name in engines if name not in live]
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                missing = [f"answers from the gateway and conductor ({exc})"]
            if not missing:
                return True
            if time.monotonic() > deadline:
                raise TimeoutError(f"the services are ready but not yet connected: {', '.join(missing)}")
            time.sleep(0.1)


def prepare_kernels(choice: str, device: str) -> None:
    """Build the engines' native kernels here, once, where this machine has not yet (``make run``
    has; ~70 s otherwise), rather than in every engine at its start, racing for the build. Engines
    on CUDA (``device``, as ``--device`` says) use none."""
    import torch

    from yutu.engine.loader import resolve_device
    from yutu.engine.native import build_directory, engine_kernels

    try:
        if choice == "torch" or resolve_device(device) == "cuda":
            return
    except ValueError as exc:  # --device cuda without a GPU: said once here, not by every worker
        raise SystemExit(f"error: {exc}") from None
    if not build_directory().exists():
        log.info("building the native kernels (once per machine and virtualenv, ~70 s)")
    try:
        engine_kernels(choice, torch.device("cpu"))  # the workers' engines' (auto: warns, goes on without)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"error: --kernels native: {exc}") from None


def stack_specs(args: argparse.Namespace, model_dir: Path, served: str) -> list[ChildSpec]:
    """The services of the stack in start order: store master, store nodes, then the conductor,
    prefill and decode instances (or the mixed workers with ``--workers``), then the gateway.

    All but the gateway are restarted after a crash, with the same arguments and a fresh admin
    port (they register their endpoints; the launcher polls the new ready URL).
    """
    from yutu.launcher import ADMIN_PORT, ChildSpec, child_env, python_module

    env = child_env()
    common = ["--redis-url", args.redis_url, "--admin-port", ADMIN_PORT]
    ready = f"http://127.0.0.1:{ADMIN_PORT}/ready"

    def service(name: str, command: str, *flags: str) -> ChildSpec:
        argv = python_module("yutu.cli", command, "--instance-id", name, *flags, *common)
        return ChildSpec(name, tuple(argv), env, ready, restart=True)

    specs: list[ChildSpec] = []
    if args.store_nodes:
        specs.append(service("store-master", "store-master"))
    for i in range(args.store_nodes):
        specs.append(service(f"store-node-{i}", "store-node", "--segment-size", args.store_segment_size))
    engines = engine_processes(args)
    torch_threads = args.torch_threads or engine_threads(engines)
    engine = ["--model", str(model_dir), "--served-model-name", served, "--block-size", str(args.block_size),
              "--kv-cache-memory-mib", str(args.kv_cache_memory_mib),
              "--torch-threads", str(torch_threads),
              "--prefill-threads", str(args.prefill_threads or prefill_threads(torch_threads)),
              "--dtype", args.dtype, "--device", args.device, "--engine-core", args.engine_core,
              "--kernels", args.kernels]  # fmt: skip
    if args.max_model_len:
        engine += ["--max-model-len", str(args.max_model_len)]
    if args.workers is not None:
        for i in range(args.workers):
            specs.append(service(f"worker-{i}", "worker", *engine))
    else:
        policy = ["--policy", args.policy, "--disagg-threshold", str(args.disagg_threshold),
                  "--balancing-threshold", str(args.balancing_threshold), "--block-size", str(args.block_size),
                  "--prefill-stealing" if args.prefill_stealing else "--no-prefill-stealing"]  # fmt: skip
        for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tbt-ms", args.slo_tbt_ms)):
            if value is not None:
                policy += [flag, str(value)]
        conductor = service("conductor", "conductor", *policy)
        if args.admin_token:  # through the environment, not argv (ps shows argv to every user)
            conductor = ChildSpec(conductor.name, conductor.argv, {**env, "YUTU_ADMIN_TOKEN": args.admin_token},
                                  conductor.ready_url, restart=True)  # fmt: skip
        specs.append(conductor)
        for i in range(args.prefill):
            specs.append(service(f"prefill-{i}", "prefill", *engine))
        for i in range(args.decode):
            specs.append(service(f"decode-{i}", "decode", *engine))
    gateway_env = dict(env)
    if args.api_key:  # through the environment, not argv: other users can read a command line in ps
        gateway_env["YUTU_API_KEY"] = args.api_key
    ready_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    gateway = python_module("yutu.cli", "gateway", "--model", str(model_dir), "--served-model-name", served,
                            "--host", args.host, "--port", str(args.port), "--redis-url", args.redis_url)  # fmt: skip
    if args.tool_call_parser:
        gateway += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        gateway += ["--reasoning-parser", args.reasoning_parser]
    if args.trust_request_chat_template:
        gateway += ["--trust-request-chat-template"]
    specs.append(ChildSpec("gateway", tuple(gateway), gateway_env, f"http://{ready_host}:{args.port}/ready"))
    return specs


def engine_processes(args: argparse.Namespace) -> int:
    return int(args.workers) if args.workers is not None else int(args.prefill) + int(args.decode)


def engine_threads(engines: int, cpus: int | None = None) -> int:
    """Torch threads per engine process: the CPUs left after one for the front ends (gateway,
    event loops), shared by the engines, at least one each. Oversubscribing a small machine (torch
    on every core while the event loops need CPU too) doubles the time per token."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, (cpus - 1) // max(1, engines))


def prefill_threads(torch_threads: int, cpus: int | None = None) -> int:
    """The most torch threads an engine process takes for a wide step (a long prompt's chunk):
    every CPU, never fewer than its other steps get. A wide step takes only the CPUs no other engine
    computes on when it starts (yutu.engine.cpus), so a prefill instance computes on the decode instance's core while
    that decode idles and keeps to its own while it decodes; the front ends' core is lent too (they
    have nothing to send while such a step runs). Measured with the demo model on 2 cores: one
    1,024-token prompt 1.6x faster on two threads than on one."""
    cpus = cpus or os.cpu_count() or 1
    return max(torch_threads, cpus)


def _banner(
    url: str, served: str, model_dir: Path, demo: bool, conductor_url: str | None, args: argparse.Namespace
) -> None:
    lines = [f"Yutu is up: {url}  (model: {served})", f"  try: curl {url}/completions -H 'Content-Type: application/json' "
             f"-d '{{\"model\": \"{served}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'"]  # fmt: skip
    if conductor_url is not None:
        lines.append(
            f"  disaggregated: {args.prefill} prefill + {args.decode} decode instance(s); conductor ({args.policy}):"
            f" {conductor_url}/instances, {conductor_url}/placements/recent"
        )
    else:
        lines.append(f"  mixed: {args.workers} worker(s), no conductor")
    if demo:
        lines += [
            f"  NOTE: {served} is the built-in demo model: random weights, so its text is meaningless.",
            "        Serve a real checkpoint with: make run MODEL=/path/to/hf-dir",
        ]
    lines.append("  Ctrl-C stops everything.")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
