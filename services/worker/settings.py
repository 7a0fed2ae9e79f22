"""The settings of an engine instance (``yutu worker | prefill | decode``): built once from the
command line in ``main`` and passed down frozen. One worker core serves the three roles:

- ``mixed`` (``yutu worker``): prefill and decode on the generate channel, as a single process;
- ``prefill`` (``yutu prefill``): first tokens on the prefill channel; the KV stays held for a decode;
- ``decode`` (``yutu decode``): the generate channel, pulling each request's KV from its prefill
  instance (or prefilling a short request itself).

Each role reads its own options from ``YUTU_<ROLE>_<OPTION>`` (``YUTU_WORKER_*`` for the mixed one).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

from yutu.busypoll import SPIN_US
from yutu.config import (
    DEVICES,
    DTYPES,
    KERNEL_CHOICES,
    ServiceSettings,
    add_common_options,
    add_model_options,
    option,
)
from yutu.transfer.tcp_wire import (
    CONGESTION_HELP,
    DEFAULT_CONGESTION,
    check_congestion,
    congestion_flag,
    parse_congestion,
)

ROLES = ("mixed", "prefill", "decode")
SCOPES = {"mixed": "worker", "prefill": "prefill", "decode": "decode"}  # role -> registry kind, env scope


ENGINE_CORES = ("process", "thread")
# Token budget of a step. Decoding sequences wait for the whole step, so a mixed or decode
# instance keeps it small; a prefill instance decodes nothing and computes a prompt of up to
# PREFILL_STEP_TOKENS in one step: no prefix re-read per chunk, no mask over it (the demo model,
# 1,024 tokens on 2 cores: 6-8% faster than two chunks of 512), and its blocks go to the store
# once the prompt is done rather than while its second chunk computes. A mixed or decode instance
# takes that larger budget too in a step where nothing decodes (--max-prefill-step-tokens): one
# request's prompt arriving at an idle instance, a burst's first step.
STEP_TOKENS = 512
PREFILL_STEP_TOKENS = 2048


@dataclass(frozen=True)
class WorkerSettings(ServiceSettings):
    role: str  # "mixed" | "prefill" | "decode"
    model: str | None  # checkpoint dir or hub id; None: the built-in demo model
    served_model_name: str | None  # name clients use; None: derived from the model
    block_size: int  # tokens per KV block (paging, hashing and store objects)
    num_kv_blocks: int | None  # None: as many as kv_cache_memory_mib holds
    kv_cache_memory_mib: int
    prefault: bool  # fault the KV cache's pages in at start (Region.populate)
    max_num_seqs: int  # running sequences per step
    max_num_batched_tokens: int  # token budget of one step (chunked prefill)
    max_prefill_step_tokens: int  # token budget of a step that decodes nothing (at least the above)
    max_model_len: int | None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool
    torch_threads: int  # threads of the model step; 0: torch's default
    prefill_threads: int  # threads of a step of >= 256 tokens (a prompt chunk); 0: torch_threads
    device: str  # "cpu" | "cuda": where the engine computes (--device resolved; on CUDA the KV region is
    # the cache's host mirror, yutu.engine.kv_mirror)
    dtype: str  # "auto" | "float32" | "bfloat16" | "float16" (weights, activations and KV cache)
    engine_core: str  # "process" (the engine in a child process) | "thread" (in this process)
    kernels: str  # "auto" | "native" | "torch": the engine's CPU kernels (yutu.engine.native)
    zmq_port: int  # the generate (mixed, decode) or prefill channel; 0: any free port
    admin_port: int  # 0: any free port
    kv_store: bool  # use the KV store (write-behind, fetches) when a store master is registered
    kv_lease_s: float  # prefill: how long a request's KV stays held for its decode
    write_behind_blocks: int  # most blocks being written to the store at once (0: no write-behind)
    write_behind_defer_s: float  # how long write-behind may wait while this instance prefills
    transfer_port: int  # the transfer engine's TCP data server (peers read the KV cache there)
    busy_poll_us: int  # wait this long awake for a store master's reply or a small TCP transfer's
    # the KV data connections' TCP congestion control (yutu.transfer.tcp_wire); None: the host's default
    tcp_congestion: str | None = DEFAULT_CONGESTION

    @property
    def kind(self) -> str:
        """The registry kind of this instance."""
        return SCOPES[self.role]

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str = "mixed") -> WorkerSettings:
        from yutu.engine.loader import resolve_device  # imports torch: the flags parse without it

        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_step_tokens",
                     "kv_cache_memory_mib"):  # fmt: skip
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        if args.prefill_threads < 0:
            raise ValueError(f"--prefill-threads must be 0 or more, got {args.prefill_threads}")
        if args.kv_lease <= 0:
            raise ValueError(f"--kv-lease must be positive, got {args.kv_lease}")
        if args.write_behind_blocks < 0:
            raise ValueError(f"--write-behind-blocks must be 0 or more, got {args.write_behind_blocks}")
        if args.write_behind_defer < 0:
            raise ValueError(f"--write-behind-defer must be 0 or more, got {args.write_behind_defer}")
        if args.busy_poll_us < 0:
            raise ValueError(f"--busy-poll-us must be 0 or more, got {args.busy_poll_us}")
        check_congestion(parse_congestion(args.tcp_congestion))
        return cls(
            **ServiceSettings.common(args, SCOPES[role]),
            role=role,
            model=args.model,
            served_model_name=args.served_model_name,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_mib=args.kv_cache_memory_mib,
            prefault=args.prefault,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_step_tokens=args.max_prefill_step_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
            torch_threads=args.torch_threads,
            prefill_threads=args.prefill_threads,
            device=resolve_device(args.device),
            dtype=args.dtype,
            engine_core=args.engine_core,
            kernels=args.kernels,
            zmq_port=args.zmq_port,
            admin_port=args.admin_port,
            kv_store=args.kv_store,
            kv_lease_s=args.kv_lease,
            write_behind_blocks=args.write_behind_blocks,
            write_behind_defer_s=args.write_behind_defer,
            transfer_port=args.transfer_port,
            busy_poll_us=args.busy_poll_us,
            tcp_congestion=parse_congestion(args.tcp_congestion),
        )


def add_arguments(parser: argparse.ArgumentParser, role: str = "mixed") -> None:
    own = partial(option, scope=SCOPES[role])
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
    own(engine, "--prefault", type=bool, default=True,
        help="fault the whole KV cache in at start (commits its memory, as vLLM's zeroed cache does), so no "
             "prefill or KV pull pays a page fault on a block's first use, and a /dev/shm too small for it "
             "shows at start")  # fmt: skip
    own(engine, "--max-num-seqs", type=int, default=64, help="most sequences batched in one step")
    own(
        engine,
        "--max-num-batched-tokens",
        type=int,
        default=PREFILL_STEP_TOKENS if role == "prefill" else STEP_TOKENS,
        help="token budget of one step (chunked prefill); a prefill instance has no decodes to keep"
        f" flowing, so its default is larger ({PREFILL_STEP_TOKENS} against {STEP_TOKENS})",
    )
    own(
        engine,
        "--max-prefill-step-tokens",
        type=int,
        default=PREFILL_STEP_TOKENS,
        help="token budget of a step in which nothing decodes (a prompt reaching an idle instance): no"
        " decode waits for it, so a prompt of up to this many tokens is one step (never below"
        " --max-num-batched-tokens)",
    )
    own(
        engine,
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's; a LongRoPE model's pretraining length, past which "
        "every sequence is rotated by its long factors)",
    )
    own(engine, "--enable-prefix-caching", type=bool, default=True, help="reuse KV blocks of shared prefixes")
    own(engine, "--torch-threads", type=int, default=0, help="threads for the model step (0: torch default)")
    own(
        engine,
        "--prefill-threads",
        type=int,
        default=0,
        help="most threads for a step of 256 tokens or more -- a long prompt's chunk -- on CPU: it takes"
        " the CPUs no other engine computes on when it starts, never fewer than --torch-threads"
        " (0: as --torch-threads)",
    )
    own(
        engine,
        "--device",
        default="auto",
        choices=DEVICES,
        help="where the engine computes: cpu, or cuda (the current CUDA device; the KV cache in GPU memory,"
        " its host copy in the region peers and the store read); auto: cuda where torch sees a GPU",
    )
    own(
        engine,
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights, activations and KV cache; auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX,"
        " else float32 (every instance sharing KV must use the same)",
    )
    own(
        engine,
        "--kernels",
        default="auto",
        choices=KERNEL_CHOICES,
        help="CPU kernels: native (C++ built once per machine, `make` builds it: decode attention 2-3x"
        " torch's SDPA on a batch of decodes, and each layer's norms, rotary and SwiGLU as one call each),"
        " torch (torch's operations, the reference) or auto (native where they build, else torch, with a"
        " warning)",
    )
    own(
        engine,
        "--engine-core",
        default="process",
        choices=ENGINE_CORES,
        help="where the model runs: process (a child process, so the worker's event loop never holds"
        " the model step's GIL) or thread (a thread of the worker process: the plain reference)",
    )
    kv = parser.add_argument_group("KV cache sharing")
    own(
        kv,
        "--kv-store",
        type=bool,
        default=True,
        help="use the KV store when a store master is registered: new full blocks are written behind"
        " the requests, planned prefixes are fetched from it",
    )
    own(
        kv,
        "--write-behind-blocks",
        type=int,
        default=512,
        help="most KV blocks being written to the store at once",
    )
    own(
        kv,
        "--write-behind-defer",
        type=float,
        default=1.0,
        help="seconds new blocks may wait to be written while this instance has prompts to prefill"
        " (the write's CPU then goes to the prompts; it waits no longer once half of"
        " --write-behind-blocks are waiting); 0: write them 20 ms after the step that filled them",
    )
    if role == "prefill":
        own(
            kv,
            "--kv-lease",
            type=float,
            default=30.0,
            help="seconds a request's KV stays held for its decode",
        )
    else:
        parser.set_defaults(kv_lease=30.0)
    net = parser.add_argument_group("network")
    channel = "prefill" if role == "prefill" else "generate"
    own(net, "--zmq-port", type=int, default=0, help=f"port of the {channel} channel (0: any free port)")
    own(net, "--admin-port", type=int, default=0, help="port of the admin REST app (0: any free port)")
    own(
        net,
        "--transfer-port",
        type=int,
        default=0,
        help="port peers read this instance's KV cache on (0: any)",
    )
    own(
        net,
        "--busy-poll-us",
        type=int,
        default=SPIN_US,
        help="after a request to the store master, or a KV transfer over TCP of up to 2 MiB, wait for"
        " the answer awake (polling) for up to this many microseconds before sleeping: on a VM being"
        " woken costs ~50 us a round trip; polling costs that CPU (0: sleep at once)",
    )
    own(
        net,
        "--tcp-congestion",
        default=congestion_flag(DEFAULT_CONGESTION),
        help=CONGESTION_HELP,
    )
    add_common_options(parser)
