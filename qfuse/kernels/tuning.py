"""Choosing a schedule of the fused GEMM (candidates: ``schedules``): lookup, autotune, and an
on-disk cache.

A schedule is chosen per (GPU name, kernel kind, M bucket, N, K). M is rounded up to a power of
two (1, 2, 4 ... 8192, then one bucket for everything larger), so a server whose batch size varies
tunes once per bucket, never per exact M; the kernel does not specialize on M either
(``do_not_specialize``), so a new M never recompiles.

Lookup order: this process's memory -> the user cache file (``$QFUSE_CACHE_DIR/tuning.json``,
default ``~/.cache/qfuse``) -> the shipped table (``tuned_configs.TUNED``, measured on the GPUs
it names) -> autotune over ``candidates()`` on the first call, then written to the cache file so
a second process does not retune. ``QFUSE_AUTOTUNE=0`` skips autotuning (first candidate wins).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable

import torch
import triton

from qfuse.fileio import atomic_write_text, cache_dir
from qfuse.kernels.schedules import (
    INTERPRETER_CONFIG,
    WEIGHT_STREAMING,
    GemmConfig,
    for_epilogue,
    m_bucket,
    runnable_candidates,
)
from qfuse.kernels.tuned_configs import TUNED

# A list to collect every autotune's timings in (benchmarks set it; None: not kept).
REPORTS: list[dict] | None = None

_memory: dict[tuple[str, bool], GemmConfig] = {}


@functools.cache
def _gpu_name(device: torch.device) -> str:
    # Cached: a driver query per call is host time on a path whose kernels are short at
    # decode sizes.
    return torch.cuda.get_device_name(device)


def cache_key(gpu: str, kind: str, M: int, N: int, K: int, epilogue: str = "") -> str:
    """``epilogue``: the activation of a heavy epilogue ("" for a light one), so a GELU layer's
    pick (timed with its epilogue) never serves a plain layer of the same shape, or back."""
    return f"{gpu}|{kind}|M{m_bucket(M)}|N{N}|K{K}" + (f"|{epilogue}" if epilogue else "")


def _cache_path() -> str:
    return os.path.join(cache_dir(), "tuning.json")


def _read_cache() -> dict[str, dict]:
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, cfg: GemmConfig) -> None:
    """Merge one entry into the cache file (atomic replace, so readers never see half a file)."""
    data = _read_cache()
    data[key] = dataclasses.asdict(cfg)
    try:
        atomic_write_text(_cache_path(), json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home is not an error: the process keeps its in-memory choice


def device_time_ms(fn: Callable[[], object], calls: int = 8, replays: int = 9,
                   cold: bool = False) -> float:
    """GPU time of one ``fn()`` in ms: ``calls`` calls captured in one CUDA graph, the median of
    ``replays`` timed replays divided by ``calls``.

    Not ``do_bench``: it times one eager call between two events, and an eager Triton launch
    costs more host time than a short kernel runs, so such a kernel measures the launch instead —
    on the H200 every schedule of MiniLM's 4096x384x384 GEMM "took" the same time within 7%,
    and autotune picked among them by noise. A graph replays the kernels back to back with no
    host work. Weights stay in L2 between calls (no flush), as a model's small layers mostly do.

    ``cold=True``: L2 is flushed (a buffer of twice its size zeroed) before each call and the
    flushes' own time subtracted: what a decode step sees, where every GEMM streams weights
    that the ~1 GB of other layers evicted. Hot, a 4 MB decode weight reads at L2 speed and
    ranks schedules by how they run from L2, not from HBM.
    """
    fn()  # compile and allocate (split-K locks, caches) outside the capture
    torch.cuda.synchronize()
    if cold:
        flush = _flush_buffer()
        both = _graph_ms(lambda: (flush.zero_(), fn()), calls, replays)
        return max(both - _graph_ms(flush.zero_, calls, replays), 0.0)
    return _graph_ms(fn, calls, replays)


@functools.cache
def _flush_bytes(index: int) -> int:
    return 2 * torch.cuda.get_device_properties(index).L2_cache_size


def _flush_buffer() -> torch.Tensor:
    size = _flush_bytes(torch.cuda.current_device())
    buf = _FLUSH.get(size)
    if buf is None:
        buf = _FLUSH[size] = torch.empty(size, dtype=torch.uint8, device="cuda")
    return buf


_FLUSH: dict[int, torch.Tensor] = {}


def _graph_ms(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Median over ``replays`` of one CUDA-graph replay of ``calls`` calls, per call (ms)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    del graph
    return times[len(times) // 2] / calls


def _time_ms(fn: Callable[[], object], cold: bool = False) -> float:
    """``device_time_ms``, or ``do_bench``'s median where ``fn`` cannot be graph-captured."""
    fn()  # a schedule that cannot launch raises here, before any capture
    try:
        return device_time_ms(fn, cold=cold)
    except Exception:  # noqa: BLE001 — e.g. a backend that refuses capture: time it eagerly
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def autotune(
    run: Callable[[GemmConfig], object],
    configs: list[GemmConfig],
    report: list | None = None,
    cold: bool = False,
) -> GemmConfig:
    """The fastest of ``configs`` by GPU time of ``run(cfg)`` (``device_time_ms``, with a cold
    L2 if ``cold``; configs that fail to launch, e.g. out of shared memory, are skipped).
    ``report`` collects ``(cfg, ms or error)``.
    Raises ``BackendError`` with every failure when none launched (returning one of them would
    only fail again at the real call, as MiniLM's did in a sweep on the H200)."""
    best, best_us = None, float("inf")
    errors = []
    try:
        for cfg in configs:
            try:
                us = _time_ms(lambda c=cfg: run(c), cold)
            except Exception as exc:  # noqa: BLE001 — resource limits show up only at launch
                errors.append((cfg, f"{type(exc).__name__}: {str(exc)[:100]}"))
                if report is not None:
                    report.append(errors[-1])
                continue
            if report is not None:
                report.append((cfg, us))
            if us < best_us:
                best, best_us = cfg, us
    finally:
        _FLUSH.clear()  # the cold timings' 2x-L2 buffer (~100 MB on an H200) is not kept
    if best is None:
        from qfuse.errors import BackendError

        raise BackendError(
            "no GEMM schedule could launch on this GPU: "
            + "; ".join(f"{c.block_m}x{c.block_n}x{c.block_k}/{c.num_stages} stages: {e}"
                        for c, e in errors[:4])
            + ". Set QFUSE_AUTOTUNE=0 to take the first candidate, or report the shape."
        )
    return best


def pick_config(
    M: int,
    N: int,
    K: int,
    kind: str,
    device: torch.device,
    interpreted: bool,
    run: Callable[[GemmConfig], object] | None = None,
    heavy_epilogue: bool = False,
    x_bytes: int = 2,
    epilogue: str = "",
) -> GemmConfig:
    """The schedule for this call; see the module docstring for the lookup order.

    ``epilogue`` names a heavy epilogue's activation (part of the cache key).
    ``heavy_epilogue`` (GELU, SiLU: ~40 float ops per element from IEEE-exact polynomials) caps
    the tile at 128x128 (``for_epilogue``): with 128x256 tiles the d=4096/h=14336 MLP at
    M=16384 ran nearly twice as long as its two GEMMs with ReLU.
    """
    if interpreted:
        return INTERPRETER_CONFIG
    gpu = _gpu_name(device)
    key = cache_key(gpu, kind, M, N, K, epilogue if heavy_epilogue else "")
    cfg = _memory.get((key, heavy_epilogue))
    if cfg is not None:
        return cfg
    # The shipped table was measured per shape alone: a heavy epilogue takes its pick, capped.
    stored = _read_cache().get(key) or TUNED.get(key) or TUNED.get(cache_key(gpu, kind, M, N, K))
    if stored is not None:
        cfg = GemmConfig(**stored)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        cands = runnable_candidates(M, N, K, kind, sms, heavy_epilogue, x_bytes)
        tune = (
            run is not None
            and os.environ.get("QFUSE_AUTOTUNE", "1") != "0"
            and not torch.cuda.is_current_stream_capturing()
        )
        # Weight-streaming buckets (decode) are timed with a cold L2: see device_time_ms.
        cold = m_bucket(M) <= WEIGHT_STREAMING
        report: list | None = [] if REPORTS is not None else None
        cfg = autotune(run, cands, report, cold=cold) if tune else cands[0]
        if tune:
            _write_cache(key, cfg)
        if report is not None:
            REPORTS.append(dict(key=key, heavy=heavy_epilogue, cold=cold, tuned=tune,
                                times_ms=[(dataclasses.asdict(c), t) for c, t in report]))
    cfg = for_epilogue(cfg, heavy_epilogue)
    _memory[(key, heavy_epilogue)] = cfg
    return cfg
