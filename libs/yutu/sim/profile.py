"""Profiles: the service times and capacities of one simulated instance type.

A profile is the *truth* of the simulated machine -- what a prefill, a decode step and a transfer
really take there -- in the very functional forms of the conductor's cost models
(:mod:`yutu.sched.costs`), so the policies can be handed the same numbers as trusted priors:

- prefill of tokens ``[p, L)``: ``a + b*n + c*n*(L + p)`` seconds, ``n = L - p``;
- one decode step: ``a + b*batch + c*kv_tokens`` seconds;
- a transfer of ``x`` bytes: ``latency + x / network_bps`` seconds.

Two sources:

``paper-llama3-70b-a800`` (:func:`paper_profile`): the Mooncake paper's own parameters (Table 1:
LLaMA3-70B on 8xA800; l = 80 layers, d = 8192, GQA 8, BF16, G = 8 x 312 TFLOPS, an 800 Gbps NIC)
and its Eq. 1, ``flops(n) = l * (a*n^2*d + b*n*d^2)`` with ``a = 4, b = 22``. Reusing a prefix of
``p`` tokens saves ``flops(p)``, so computing ``[p, L)`` costs ``l*a*d*(L^2 - p^2) + l*b*d^2*(L - p)``
FLOPs; at ``G`` that is ``b = l*b*d^2/G`` s/token and ``c = l*a*d/G`` s/token^2 (``n*(L+p) = L^2-p^2``).
KV per token is ``l * 2*d/gqa * 2 B = 320 KiB``. The paper gives no decode model: the step is
memory-bound, so ours reads the weights (70.6e9 BF16 parameters) and every KV byte once per step at
8 x 2.039 TB/s (the A800's HBM, its datasheet), plus ``2 * params`` FLOPs per sequence at ``G``.

A calibrated profile (``yutu calibrate``): the same three forms fitted to our real engine on this
machine, written as JSON (:meth:`Profile.to_json`) and loaded by path.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from yutu.sched import CostModels, DecodeCostModel, PrefillCostModel, TransferCostModel

PAPER_PROFILE = "paper-llama3-70b-a800"

# Mooncake FAST'25, Table 1 and Eq. 1.
PAPER_LAYERS = 80
PAPER_D = 8192
PAPER_GQA = 8
PAPER_ELEMENT_BYTES = 2
PAPER_A, PAPER_B = 4.0, 22.0
PAPER_G_FLOPS = 8 * 312e12
PAPER_NIC_BPS = 800e9 / 8  # bytes/s
# Ours (the paper gives no decode model): LLaMA3-70B's parameters and the A800's HBM bandwidth.
LLAMA3_70B_PARAMS = 70.6e9
A800_HBM_BPS = 8 * 2.039e12
# Capacities: 80 GB per GPU less the weights; the paper's ~3M-token DRAM prefix cache per node.
NODE_HBM_BYTES = 8 * 80e9
PAPER_LOCAL_CACHE_TOKENS = 3_000_000
TRACE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces


def _positive(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"profile field {name} must be a finite number > 0, got {value!r}")


def _coefficients(name: str, value: tuple[float, ...]) -> None:
    ok = len(value) == 3 and all(isinstance(c, int | float) and math.isfinite(c) and c >= 0 for c in value)
    if not ok or not any(c > 0 for c in value):
        raise ValueError(f"profile field {name} must be 3 finite coefficients >= 0, not all 0, got {value!r}")


@dataclass(frozen=True)
class Profile:
    """One instance type: service-time coefficients and capacities (see the module docstring)."""

    name: str
    block_size: int  # tokens per KV block (the trace's hash-id granularity)
    kv_bytes_per_token: int
    prefill: tuple[float, float, float]  # s, s/token, s/token^2 (PrefillCostModel)
    decode: tuple[float, float, float]  # s, s/sequence, s/KV token (DecodeCostModel)
    network_bps: float  # bytes/s between any two instances and the store
    transfer_latency_s: float
    prefill_kv_blocks: int  # accelerator KV blocks of a prefill instance (its running queue's prompts)
    cache_blocks: int  # local prefix cache (host DRAM) of a prefill instance, in blocks
    decode_kv_blocks: int  # accelerator KV blocks of a decode instance
    max_batch: int  # sequences a decode instance runs in one step
    source: str = ""  # how the numbers were obtained

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(float(c) for c in self.prefill))
        object.__setattr__(self, "decode", tuple(float(c) for c in self.decode))
        _coefficients("prefill", self.prefill)
        _coefficients("decode", self.decode)
        for name in ("block_size", "kv_bytes_per_token", "prefill_kv_blocks", "cache_blocks",
                     "decode_kv_blocks", "max_batch"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"profile field {name} must be an integer >= 1, got {value!r}")
        _positive("network_bps", self.network_bps)
        if not (math.isfinite(self.transfer_latency_s) and self.transfer_latency_s >= 0):
            raise ValueError(
                f"profile field transfer_latency_s must be >= 0, got {self.transfer_latency_s!r}"
            )

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    # -- the truth ----------------------------------------------------------------------------------

    def prefill_s(self, prompt_len: int, reused_tokens: int) -> float:
        """Seconds to compute tokens ``[reused_tokens, prompt_len)``."""
        a, b, c = self.prefill
        n = prompt_len - reused_tokens
        if prompt_len < 1 or not 0 <= reused_tokens < prompt_len:
            raise ValueError(f"need 0 <= reused_tokens < prompt_len, got {reused_tokens}, {prompt_len}")
        return a + b * n + c * n * (prompt_len + reused_tokens)

    def step_s(self, batch_size: int, kv_tokens: int) -> float:
        """Seconds of one decode step over ``batch_size`` sequences holding ``kv_tokens``."""
        a, b, c = self.decode
        return a + b * batch_size + c * kv_tokens

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` (0 for nothing)."""
        return 0.0 if nbytes <= 0 else self.transfer_latency_s + nbytes / self.network_bps

    def cost_models(self) -> CostModels:
        """The policies' cost models: this profile as trusted priors (a measured machine)."""
        return CostModels(
            prefill=PrefillCostModel(self.prefill, trusted=True),
            transfer=TransferCostModel(self.network_bps, latency_s=self.transfer_latency_s),
            decode=DecodeCostModel(self.decode, trusted=True),
        )

    # -- files --------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names - set(data) if n != "source")
        unknown = sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(f"profile: missing fields {missing}, unknown fields {unknown}")
        return cls(**{**data, "prefill": tuple(data["prefill"]), "decode": tuple(data["decode"])})


def paper_profile() -> Profile:
    """LLaMA3-70B on 8xA800 from the paper's Table 1 and Eq. 1 (module docstring)."""
    layers, d, g = PAPER_LAYERS, PAPER_D, PAPER_G_FLOPS
    kv_per_token = layers * 2 * (d // PAPER_GQA) * PAPER_ELEMENT_BYTES  # 327,680 B = 320 KiB
    weights = LLAMA3_70B_PARAMS * PAPER_ELEMENT_BYTES
    hbm_blocks = int((NODE_HBM_BYTES - weights) // (kv_per_token * TRACE_BLOCK_SIZE))
    return Profile(
        name=PAPER_PROFILE,
        block_size=TRACE_BLOCK_SIZE,
        kv_bytes_per_token=kv_per_token,
        prefill=(0.0, layers * PAPER_B * d * d / g, layers * PAPER_A * d / g),
        decode=(weights / A800_HBM_BPS, 2 * LLAMA3_70B_PARAMS / g, kv_per_token / A800_HBM_BPS),
        network_bps=PAPER_NIC_BPS,
        transfer_latency_s=1e-3,
        prefill_kv_blocks=hbm_blocks,
        cache_blocks=PAPER_LOCAL_CACHE_TOKENS // TRACE_BLOCK_SIZE,
        decode_kv_blocks=hbm_blocks,
        max_batch=128,
        source="Mooncake FAST'25 Table 1 and Eq. 1 (LLaMA3-70B, 8xA800, 800 Gbps); decode: HBM-bound model",
    )


def load_profile(spec: str) -> Profile:
    """``paper-llama3-70b-a800``, or the path of a profile JSON (``yutu calibrate`` writes one)."""
    if spec == PAPER_PROFILE:
        return paper_profile()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"--profile: {spec!r} is neither {PAPER_PROFILE} nor a profile file (yutu calibrate)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: expected a JSON object")
    return Profile.from_dict(data)
