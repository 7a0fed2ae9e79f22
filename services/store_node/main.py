"""Entry point of ``yutu store-node``: contributes a DRAM segment (and optionally a disk tier) to
the distributed KV store."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from yutu.config import ServiceSettings, add_common_options, option
from yutu.service import HttpServer, admin_app, run_main, serve
from yutu.store.types import parse_size
from yutu.transfer.tcp_wire import CONGESTION_HELP, DEFAULT_CONGESTION, congestion_flag, parse_congestion

from services.store_node.settings import NodeSettings

own = partial(option, scope="store-node")  # this service's own options: YUTU_STORE_NODE_<OPTION>


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    g = parser.add_argument_group("store node")
    own(g, "--segment-size", default="256MiB", help="DRAM contributed to the pool (e.g. 4GiB)")
    own(g, "--segment-name", default=None, help="transfer segment name (default: the instance id)")
    own(g, "--master", default=None, help="store master RPC endpoint (default: find it in the registry)")
    own(g, "--transfer-port", default=0, type=int, help="TCP port of the transfer data server; 0: any")
    own(g, "--transports", default="shm,tcp", help="comma-separated transports to serve: shm, tcp")
    own(g, "--tcp-connections", default=4, type=int, help="TCP connections per peer")
    own(g, "--tcp-congestion", default=congestion_flag(DEFAULT_CONGESTION), help=CONGESTION_HELP)
    own(g, "--admin-port", default=0, type=int, help="admin REST port; 0 picks a free port")
    own(g, "--heartbeat-interval", default=1.0, type=float, help="seconds between heartbeats to the master")
    own(g, "--prefault", default=True, type=bool,
        help="fault the whole segment in at start, so no put pays a page fault per page (commits its memory)")  # fmt: skip
    own(g, "--disk-dir", default=None, help="directory of a disk tier for evicted objects (default: none)")
    own(g, "--disk-capacity", default="1GiB", help="bytes the disk tier may hold")


def settings_from_args(args: argparse.Namespace) -> NodeSettings:
    common = ServiceSettings.common(args, "store-node")
    return NodeSettings(
        **common,
        segment_name=args.segment_name or common["instance_id"],
        segment_size=parse_size(args.segment_size),
        master=args.master,
        transfer_port=args.transfer_port,
        transports=tuple(t.strip() for t in args.transports.split(",") if t.strip()),
        tcp_connections=args.tcp_connections,
        tcp_congestion=parse_congestion(args.tcp_congestion),
        admin_port=args.admin_port,
        heartbeat_interval_s=args.heartbeat_interval,
        disk_dir=args.disk_dir,
        disk_capacity=parse_size(args.disk_capacity) if args.disk_dir else 0,
        prefault=args.prefault,
    )


async def _main(settings: NodeSettings) -> int:
    from services.store_node.service import StoreNodeService

    service = StoreNodeService(settings)
    await serve(
        service, HttpServer(admin_app(service), settings.host, settings.admin_port, settings.advertise_host)
    )
    return 0


def run(args: argparse.Namespace) -> int:
    return run_main(args, settings_from_args, _main)


if __name__ == "__main__":  # python -m services.store_node.main: the same as `yutu store-node`
    from yutu.cli import main

    raise SystemExit(main(["store-node", *sys.argv[1:]]))
