"""The worker's settings: built once from the command line in ``main`` and passed down frozen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

from yutu.config import ServiceSettings, add_common_options, add_model_options, option

own = partial(option, scope="worker")  # this service's own options: YUTU_WORKER_<OPTION>


@dataclass(frozen=True)
class WorkerSettings(ServiceSettings):
    model: str | None  # checkpoint dir or hub id; None: the built-in demo model
    served_model_name: str | None  # name clients use; None: derived from the model
    block_size: int  # tokens per KV block (paging, hashing and store objects)
    num_kv_blocks: int | None  # None: as many as kv_cache_memory_mib holds
    kv_cache_memory_mib: int
    max_num_seqs: int  # running sequences per step
    max_num_batched_tokens: int  # token budget of one step (chunked prefill)
    max_model_len: int | None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool
    torch_threads: int  # threads of the model step; 0: torch's default
    zmq_port: int  # 0: any free port
    admin_port: int  # 0: any free port

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerSettings:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_mib"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        return cls(
            **ServiceSettings.common(args, "worker"),
            model=args.model,
            served_model_name=args.served_model_name,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_mib=args.kv_cache_memory_mib,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            torch_threads=args.torch_threads,
            zmq_port=args.zmq_port,
            admin_port=args.admin_port,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    engine = parser.add_argument_group("engine")
    own(engine, "--block-size", type=int, default=16, help="tokens per KV cache block")
    own(
        engine,
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache blocks (overrides --kv-cache-memory-mib)",
    )
    own(engine, "--kv-cache-memory-mib", type=int, default=512, help="memory for the KV cache, in MiB")
    own(engine, "--max-num-seqs", type=int, default=64, help="most sequences batched in one step")
    own(
        engine,
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget of one step (chunked prefill)",
    )
    own(engine, "--max-model-len", type=int, default=None, help="context length limit (default: the model's)")
    own(engine, "--enable-prefix-caching", type=bool, default=True, help="reuse KV blocks of shared prefixes")
    own(engine, "--torch-threads", type=int, default=0, help="threads for the model step (0: torch default)")
    net = parser.add_argument_group("network")
    own(net, "--zmq-port", type=int, default=0, help="port of the generate channel (0: any free port)")
    own(net, "--admin-port", type=int, default=0, help="port of the admin REST app (0: any free port)")
    add_common_options(parser)
