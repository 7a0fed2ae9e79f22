"""Entry point of ``yutu store-master``: the metadata service of the distributed KV store."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from yutu.config import ServiceSettings, add_common_options, option
from yutu.evict import POLICIES
from yutu.service import HttpServer, admin_app, run_main, serve

from services.store_master.settings import MasterSettings
from services.store_master.state import StatePolicy

own = partial(option, scope="store-master")  # this service's own options: YUTU_STORE_MASTER_<OPTION>


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    g = parser.add_argument_group("store master")
    own(g, "--port", default=0, type=int, help="RPC port (ZeroMQ); 0 picks a free port")
    own(
        g,
        "--stream-port",
        default=0,
        type=int,
        help="the same RPC over a plain TCP stream, what clients use when advertised (0: any free port; -1: off)",
    )
    own(
        g,
        "--spin-us",
        default=0,
        type=int,
        help="while clients call back to back, the stream RPC keeps polling this many microseconds after "
        "each reply before it sleeps, so the next call does not pay for waking it: at most this much CPU "
        "a call, for a master with a core to itself (on a 2-core host shared with a store node, 200 cut a "
        "64 KiB shared-memory get's lookup from ~100 to ~40 us but slowed TCP transfers, which then "
        "wait for a core); a master called now and then never polls (default 0: off)",
    )
    own(g, "--admin-port", default=0, type=int, help="admin REST port; 0 picks a free port")
    own(g, "--kv-events", default=True, type=bool, help="publish BlockStored/BlockRemoved KV events")
    own(g, "--kv-events-port", default=0, type=int, help="KV events PUB port; 0 picks a free port")
    own(
        g,
        "--kv-events-replay-port",
        default=0,
        type=int,
        help="KV events replay ROUTER port, for subscribers that start late (0: any free port; -1: off)",
    )
    own(g, "--kv-events-topic", default="", help="topic frame of every KV event message")
    own(g, "--data-parallel-rank", default=0, type=int, help="rank written into KV event batches")
    own(g, "--lease-ttl", default=5.0, type=float, help="seconds a read lease protects replicas")
    own(g, "--soft-pin-ttl", default=1800.0, type=float, help="seconds a soft pin protects an object")
    own(g, "--put-timeout", default=30.0, type=float, help="seconds before an unfinished put is reclaimed")
    own(
        g,
        "--node-ttl",
        default=10.0,
        type=float,
        help="seconds of node silence before its replicas are dropped",
    )
    own(
        g, "--eviction-high-watermark", default=0.90, type=float, help="usage fraction that triggers eviction"
    )
    own(g, "--eviction-ratio", default=0.05, type=float, help="fraction of capacity evicted per round")
    own(
        g,
        "--eviction-policy",
        default="lru",
        choices=POLICIES,
        help="which objects leave DRAM first: lru (least recently used), lfu (least frequently used) or "
        "adaptive (an ARC-like LRU/LFU split that follows whichever part is hitting)",
    )
    own(g, "--alignment", default=64, type=int, help="allocation granularity in bytes (power of two)")
    own(g, "--block-size", default=16, type=int, help="tokens per KV block, published in BlockStored events")
    own(g, "--sweep-interval", default=0.5, type=float, help="seconds between housekeeping passes")
    own(g, "--persist", default=True, type=bool, help="keep metadata in Redis and recover it on start")


def settings_from_args(args: argparse.Namespace) -> MasterSettings:
    policy = StatePolicy(
        lease_ttl_s=args.lease_ttl,
        soft_pin_ttl_s=args.soft_pin_ttl,
        put_timeout_s=args.put_timeout,
        node_ttl_s=args.node_ttl,
        high_watermark=args.eviction_high_watermark,
        eviction_ratio=args.eviction_ratio,
        alignment=args.alignment,
        block_size=args.block_size,
        eviction_policy=args.eviction_policy,
    )
    return MasterSettings(
        **ServiceSettings.common(args, "store-master"),
        port=args.port,
        admin_port=args.admin_port,
        kv_events=args.kv_events,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=None if args.kv_events_replay_port < 0 else args.kv_events_replay_port,
        kv_events_topic=args.kv_events_topic,
        data_parallel_rank=args.data_parallel_rank,
        policy=policy,
        sweep_interval_s=args.sweep_interval,
        persist=args.persist,
        stream_port=None if args.stream_port < 0 else args.stream_port,
        spin_us=args.spin_us,
    )


async def _main(settings: MasterSettings) -> int:
    from services.store_master.service import StoreMasterService

    service = StoreMasterService(settings)
    await serve(
        service, HttpServer(admin_app(service), settings.host, settings.admin_port, settings.advertise_host)
    )
    return 0


def run(args: argparse.Namespace) -> int:
    return run_main(args, settings_from_args, _main)


if __name__ == "__main__":  # python -m services.store_master.main: the same as `yutu store-master`
    from yutu.cli import main

    raise SystemExit(main(["store-master", *sys.argv[1:]]))
