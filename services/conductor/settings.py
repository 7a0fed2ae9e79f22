"""The conductor's settings: built once from the command line in ``main`` and passed down frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

from yutu.config import ServiceSettings, add_common_options, add_policy_options, option
from yutu.sched import POLICIES, PolicyOptions

own = partial(option, scope="conductor")  # this service's own options: YUTU_CONDUCTOR_<OPTION>


@dataclass(frozen=True)
class ConductorSettings(ServiceSettings):
    port: int  # RPC port of the conductor channel (0: any free port)
    stream_port: int | None  # the same RPC over a plain TCP stream (yutu.rpc.stream); 0: any; None: off
    admin_port: int
    policy: str
    options: PolicyOptions
    admin_token: str | None  # needed to change the policy at run time (PUT /policy); None: refused
    registry_poll_s: float
    report_stale_s: float  # an instance whose last load report is older is not placed on
    block_size: int
    recent: int  # placements kept for /placements/recent

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConductorSettings:
        if args.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(sorted(POLICIES))}, got {args.policy!r}")
        for name in ("registry_poll", "report_stale"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        if args.block_size < 1 or args.recent < 1:
            raise ValueError("--block-size and --recent must be positive")
        options = PolicyOptions(
            balancing_threshold=args.balancing_threshold,
            disagg_threshold=args.disagg_threshold,
            prefill_stealing=args.prefill_stealing,
            slo_ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000.0,
            slo_tbt_s=None if args.slo_tbt_ms is None else args.slo_tbt_ms / 1000.0,
        )
        return cls(
            **ServiceSettings.common(args, "conductor"),
            port=args.port,
            stream_port=None if args.stream_port < 0 else args.stream_port,
            admin_port=args.admin_port,
            policy=args.policy,
            options=options,
            admin_token=args.admin_token or None,
            registry_poll_s=args.registry_poll,
            report_stale_s=args.report_stale,
            block_size=args.block_size,
            recent=args.recent,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("conductor")
    own(g, "--port", type=int, default=0, help="port of the conductor channel (ZeroMQ); 0: any free port")
    own(
        g,
        "--stream-port",
        type=int,
        default=0,
        help="the same channel over a plain TCP stream, what gateways use when advertised (0: any free port; -1: off)",
    )
    own(g, "--admin-port", type=int, default=0, help="admin REST port; 0: any free port")
    add_policy_options(g, "conductor")
    option(g, "--admin-token", default=None, help="bearer token for PUT /policy (none: the policy is fixed)")
    own(g, "--registry-poll", type=float, default=1.0, help="seconds between registry scans")
    own(
        g,
        "--report-stale",
        type=float,
        default=5.0,
        help="seconds after which an instance without a load report is skipped",
    )
    own(g, "--block-size", type=int, default=16, help="tokens per KV block (must match the workers)")
    own(g, "--recent", type=int, default=512, help="placements kept for /placements/recent")
    add_common_options(parser)
