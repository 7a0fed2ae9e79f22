"""The native attention kernels (yutu.engine.native), decode and prefill, against torch's SDPA,
their reference (the layer kernels: test_engine_layer_ops.py).

Random slots as the dense decode cache holds them (views into larger buffers, holes of one key,
sliding windows), in each dtype and several head dims and query groups: the kernel computes in
float32 and rounds once, so it is held to SDPA-in-float32 within the dtype's rounding. The engine
picks the kernel as ``kernels`` says and says which it took.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_support import make_engine
from yutu.engine import native
from yutu.engine.attention import sdpa as reference
from yutu.engine.engine import torch_threads
from yutu.engine.loader import cpu_flags
from yutu.engine.sampling import SamplingParams

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernels() -> object:
    return native.load()  # built by `make test` before the tests; ~40 s here otherwise


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
         scale: float) -> torch.Tensor:  # fmt: skip
    """torch's SDPA with a mask of each slot's keys first .. last-1: (n, kvh, G, hd)."""
    pos = torch.arange(k.shape[2])[None, :]  # (1, span)
    seen = (pos >= first[:, None]) & (pos < last[:, None])  # (n, span)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None, None, :], scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "groups"), [(16, 1), (32, 2), (64, 4), (48, 2), (128, 8)])
def test_the_kernel_matches_sdpa(kernels: object, dtype: torch.dtype, head_dim: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(head_dim * 10 + groups)
    n, kvh, capacity = 7, 2, 96
    k_buf = torch.randn(n + 1, kvh, capacity, head_dim, generator=gen).to(dtype)  # the cache's buffers,
    v_buf = torch.randn(n + 1, kvh, capacity, head_dim, generator=gen).to(dtype)  # larger than attended
    span = 80
    k, v = k_buf[:n, :, :span], v_buf[:n, :, :span]  # views, as DenseStep.attend passes them
    rows = torch.randn(n + 3, kvh * groups + 5, head_dim, generator=gen).to(dtype)
    q = rows[:n, : kvh * groups].view(n, kvh, groups, head_dim)  # a view of the step's q rows
    last = torch.tensor([80, 1, 17, 64, 2, 80, 33])  # slot 1: a hole (one stale key)
    first = torch.tensor([0, 0, 0, 40, 1, 71, 0])  # windows: slots 3, 4, 5 start later
    scale = head_dim**-0.5
    out = kernels.dense_decode_attention(q, k, v, first, last, scale)  # type: ignore[attr-defined]
    assert out.shape == q.shape and out.dtype == dtype
    want = sdpa(q.float(), k.float(), v.float(), first, last, scale)  # the reference, in float32
    error = (out.float() - want).abs().max().item()
    assert error <= TOLERANCE[dtype]
    torch_error = (sdpa(q, k, v, first, last, scale).float() - want).abs().max().item()  # SDPA in `dtype`
    assert error <= max(torch_error, TOLERANCE[dtype] / 10)  # no further from it than torch is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 48])
def test_the_kernels_cap_the_scores_as_gemma_2_does(
    kernels: object, dtype: torch.dtype, head_dim: int
) -> None:
    """With a softcap, decode and prefill against the engine's written-out reference in float32
    (yutu.engine.attention.sdpa), on scores large enough that the cap changes the answer."""
    gen = torch.Generator().manual_seed(head_dim)
    n, kvh, groups, span, cap = 5, 2, 2, 40, 2.0
    q = (4 * torch.randn(n, kvh, groups, head_dim, generator=gen)).to(dtype)
    k = torch.randn(n, kvh, span, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kvh, span, head_dim, generator=gen).to(dtype)
    first, last = torch.tensor([0, 0, 10, 3, 0]), torch.tensor([40, 1, 40, 20, 7])
    scale = head_dim**-0.5
    seen = (torch.arange(span)[None, :] >= first[:, None]) & (torch.arange(span)[None, :] < last[:, None])
    want = reference(
        q.float(), k.float(), v.float(), scale=scale, attn_mask=seen[:, None, None, :], softcap=cap
    )
    out = kernels.dense_decode_attention(q, k, v, first, last, scale, cap)  # type: ignore[attr-defined]
    assert (out.float() - want).abs().max().item() <= TOLERANCE[dtype]
    uncapped = kernels.dense_decode_attention(q, k, v, first, last, scale)  # type: ignore[attr-defined]
    assert (uncapped.float() - want).abs().max().item() > 100 * TOLERANCE[dtype]
    m, rows = 37, 29  # a chunk of 29 rows after 8 cached positions
    q = (4 * torch.randn(rows, kvh * groups, head_dim, generator=gen)).to(dtype)
    k = torch.randn(m, kvh, head_dim, generator=gen).to(dtype)
    v = torch.randn(m, kvh, head_dim, generator=gen).to(dtype)
    want = reference(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
                     scale=scale, is_causal=True, enable_gqa=True, softcap=cap)[0].transpose(0, 1)  # fmt: skip
    out = kernels.prefill_attention(q, k, v, scale, cap)  # type: ignore[attr-defined]
    assert (out.float() - want).abs().max().item() <= TOLERANCE[dtype]
    uncapped = kernels.prefill_attention(q, k, v, scale)  # type: ignore[attr-defined]
    assert (uncapped.float() - want).abs().max().item() > 100 * TOLERANCE[dtype]
    with pytest.raises(RuntimeError, match="softcap"):
        kernels.prefill_attention(q, k, v, scale, -1.0)  # type: ignore[attr-defined]


def test_a_slot_with_no_keys_or_keys_past_the_buffer_is_refused(kernels: object) -> None:
    q = torch.zeros(2, 1, 1, 16)
    k = v = torch.zeros(2, 1, 8, 16)
    for first, last in (([0, 3], [4, 3]), ([0, 0], [4, 9]), ([-1, 0], [4, 4])):
        with pytest.raises(RuntimeError, match="non-empty range"):
            kernels.dense_decode_attention(q, k, v, torch.tensor(first), torch.tensor(last), 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="int64"):
        kernels.dense_decode_attention(
            q, k, v, torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1, 1]), 1.0
        )  # type: ignore[attr-defined]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's SDPA with the n query rows at the last n of the m key positions: (n, heads, hd)."""
    n, m = q.shape[0], k.shape[0]
    seen = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]  # (n, m)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=seen, scale=scale, enable_gqa=True)  # fmt: skip
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "m", "heads", "kv_heads", "head_dim"),
    [(1024, 1024, 8, 2, 32), (7, 7, 8, 2, 32), (100, 900, 8, 2, 32), (1, 300, 4, 4, 64), (33, 80, 6, 3, 48),
     (50, 50, 8, 1, 128), (17, 40, 4, 2, 16)],
)  # fmt: skip
def test_the_prefill_kernel_matches_sdpa(
    kernels: object, dtype: torch.dtype, n: int, m: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Whole prompts and chunks after a cached prefix (rows at the last n of m positions), tiles
    that end mid-block, one query row, grouped and multi-query heads, head dims with and without
    the vectorized path (and for bfloat16 at 32, 64 and 128, the bfloat16 pair products where the
    build has them, with an odd key count: a zero key pads the last pair); q a view of the step's
    rows, as paged_attention passes it."""
    gen = torch.Generator().manual_seed(n * 7 + m)
    rows = torch.randn(n + 2, heads + 3, head_dim, generator=gen).to(dtype)
    q = rows[1 : n + 1, :heads]
    k = torch.randn(m, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(m, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = kernels.prefill_attention(q, k, v, scale)  # type: ignore[attr-defined]
    assert out.shape == q.shape and out.dtype == dtype
    want = causal_sdpa(q.float(), k.float(), v.float(), scale)  # the reference, in float32
    error = (out.float() - want).abs().max().item()
    assert error <= TOLERANCE[dtype]
    torch_error = (causal_sdpa(q, k, v, scale).float() - want).abs().max().item()  # SDPA in `dtype`
    assert error <= max(torch_error, TOLERANCE[dtype] / 5)  # no further from it than torch is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "m", "window", "head_dim"), [(300, 300, 64, 32), (100, 900, 200, 64), (33, 80, 7, 48),
                                                            (50, 50, 1, 128), (40, 300, 16, 64)])  # fmt: skip
def test_the_prefill_kernel_attends_a_sliding_window(
    kernels: object, dtype: torch.dtype, n: int, m: int, window: int, head_dim: int
) -> None:
    """Each row its last ``window`` keys (windows shorter than a tile, than a block of keys, of one
    key; chunks after a prefix), against torch's SDPA with that mask in float32."""
    gen = torch.Generator().manual_seed(n + m + window)
    q = torch.randn(n, 8, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(m, 2, head_dim, generator=gen).to(dtype) for _ in range(2))
    scale = head_dim**-0.5
    pos, keys = torch.arange(m - n, m)[:, None], torch.arange(m)[None, :]
    seen = (keys <= pos) & (keys > pos - window)  # (n, m)
    want = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                          v.float().transpose(0, 1)[None], attn_mask=seen, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)  # fmt: skip
    out = kernels.prefill_attention(q, k, v, scale, 0.0, window)  # type: ignore[attr-defined]
    assert (out.float() - want).abs().max().item() <= TOLERANCE[dtype]
    if window < m:  # the window changed the answer
        uncut = kernels.prefill_attention(q, k, v, scale)  # type: ignore[attr-defined]
        assert (uncut.float() - want).abs().max().item() > 0.1


def test_the_prefill_kernel_uses_bfloat16_pairs_where_the_cpu_multiplies_them(kernels: object) -> None:
    """The build's -march=native turns the pair products on exactly where the CPU has AVX512-BF16."""
    assert kernels.prefill_bf16_pairs() == ("avx512_bf16" in cpu_flags())  # type: ignore[attr-defined]


def test_the_prefill_kernel_refuses_misshapen_inputs(kernels: object) -> None:
    q, k = torch.zeros(4, 8, 32), torch.zeros(6, 2, 32)
    cases = [
        ((torch.zeros(8, 8, 32), k, k), "more queries"),
        ((torch.zeros(4, 6, 32), torch.zeros(6, 4, 32), torch.zeros(6, 4, 32)), "multiple of KV heads"),
        ((q, k, torch.zeros(6, 2, 16)), "differ in shape"),
        ((q, k, k.to(torch.bfloat16)), "differ in dtype"),
        ((q, torch.zeros(6, 2, 64)[..., ::2], torch.zeros(6, 2, 64)[..., ::2]), "unit stride"),
        ((q[0], k, k), "3-D"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernels.prefill_attention(*args, 1.0)  # type: ignore[attr-defined]
    empty = kernels.prefill_attention(torch.zeros(0, 8, 32), k, k, 1.0)  # type: ignore[attr-defined]
    assert empty.shape == (0, 8, 32)


def test_loading_the_kernels_leaves_the_process_float_modes_alone(kernels: object) -> None:
    # Built with -ffast-math: had its startup code been linked in, it would set flush-to-zero for
    # the whole process and subnormal floats everywhere else would turn into zeros.
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


def test_the_engine_takes_the_kernel_it_is_told(ckpt: Path, kernels: object) -> None:
    assert make_engine(ckpt, kernels="native").kernels == "native"
    assert make_engine(ckpt, kernels="torch").kernels == "torch"
    assert make_engine(ckpt).kernels == "native"  # auto, where it builds
    without_dense = make_engine(ckpt, dense_decode_bytes=0)  # no dense path: the layer kernels still
    assert without_dense.kernels == "native" and without_dense.runner.model.ops is not None
    assert make_engine(ckpt, kernels="torch").runner.model.ops is None
    with pytest.raises(ValueError, match="kernels must be one of auto, native, torch"):
        make_engine(ckpt, kernels="fast")


def test_auto_says_why_it_decodes_on_torch_when_the_kernels_cannot_be_built(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the state a failed build leaves (no compiler here to take away, so set it)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_failure", "the native kernels could not be built in /x: no g++")
    with caplog.at_level(logging.WARNING, logger="yutu.engine.native"):
        assert make_engine(ckpt).kernels == "torch"
    assert "no g++" in caplog.text and "torch's operations" in caplog.text
    with pytest.raises(RuntimeError, match="no g\\+\\+"):
        make_engine(ckpt, kernels="native")


def test_the_kernels_run_on_torchs_openmp_runtime(kernels: object) -> None:
    # Compiled with -fopenmp so that their loops split over torch's threads, but linked to no
    # runtime of their own: a second one would bring a second pool of threads into the process.
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes


def test_each_torch_installation_builds_in_its_own_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's builder rebuilds when its include paths change: two virtualenvs sharing one directory
    # took turns rebuilding, so the torch installation built against is part of the name
    here = native.build_directory()
    assert here == native.build_directory()  # stable
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert native.build_directory() != here
    assert native.build_directory().parent == here.parent


def test_where_nothing_compiles_the_portable_build_is_loaded(
    kernels: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The selection (what a container image does): no machine build, no compiler, a portable build
    this CPU can run -> that one, said in the log; a machine build, where there is one, wins; a CPU
    without the portable build's extensions gets none. (The portable build itself is compiled and
    served by the image: `make compose-test` checks that its engines load it.)"""
    library = Path(kernels.__file__)  # type: ignore[attr-defined]  # a loadable build stands in for it
    machine_dir = native.build_directory()
    portable_dir = tmp_path / "portable"
    portable_dir.mkdir()
    (portable_dir / "yutu_native.so").symlink_to(library)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    for machine, portable_used in ((tmp_path / "none", True), (machine_dir, False)):
        monkeypatch.setattr(
            native, "build_directory", lambda portable=False, m=machine: portable_dir if portable else m
        )
        monkeypatch.setattr(native, "_loaded", None)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="yutu.engine.native"):
            assert native.load() is kernels  # the same library: one module per process
        assert ("portable native kernels (x86-64-v3" in caplog.text) == portable_used
    assert native.portable_build() == portable_dir / "yutu_native.so"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    assert native.portable_build() is None  # this CPU could not run it


def _cpu_masks() -> dict[str, str]:
    """Each thread of this process -> its allowed CPUs (as /proc lists them)."""
    masks = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        status = (task / "status").read_text()
        masks[task.name] = next(line.split(":")[1].strip() for line in status.splitlines()
                                if line.startswith("Cpus_allowed_list"))  # fmt: skip
    return masks


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_wide_steps_threads_are_spread_over_cpus_and_given_back(kernels: object, ckpt: Path) -> None:
    """Two threads of a wide step that start on one CPU stay there (csrc/threads.cpp): bound each to
    its own CPU for the step, then given back what they had; the engine does it around wide steps."""
    before = _cpu_masks()
    with torch_threads(2):
        torch.ones(256, 256) @ torch.ones(256, 256)  # the intra-op team exists
        assert kernels.spread_threads(True)  # type: ignore[attr-defined]
        during = _cpu_masks()
        assert kernels.spread_threads(False)  # type: ignore[attr-defined]
    main = str(threading.get_native_id())
    assert during[main].isdigit()  # one CPU: the one it was on
    bound = {m for t, m in during.items() if m.isdigit() and m != before.get(t)}
    assert len(bound) == 2  # the team's two threads, on two CPUs
    assert all(_cpu_masks().get(t, m) == m for t, m in before.items())  # all given back
    engine = make_engine(ckpt, prefill_threads=2, max_model_len=512)
    engine.add_request("long", list(range(1, 400)), SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():  # a wide step (399 tokens), spread or not (other engines)
        engine.step()
    assert all(_cpu_masks().get(t, m) == m for t, m in before.items())
