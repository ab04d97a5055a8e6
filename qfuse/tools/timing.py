"""Forward latency of a model on its device: medians after warm-up, per execution mode.

CPU: ``time.perf_counter`` around each call (the fused ops run their PyTorch reference there, so
CPU numbers time the reference path, not a kernel). CUDA: ``triton.testing.do_bench`` medians;
``compiled`` wraps the model in ``torch.compile``; ``graph`` captures one eager forward in a CUDA
graph and times its replays (no host launch cost). Launches are counted with ``torch.profiler``:
GPU kernels (and copies) on CUDA, top-level operator calls on CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qfuse.analysis.sensitivity import call

MODES = ("eager", "compiled", "graph")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10
) -> float:
    """Median wall time of ``fn()`` in ms (do_bench on CUDA, perf_counter on CPU).

    Example:
        >>> ms = median_ms(lambda: sum(range(1000)), torch.device("cpu"), warmup=1, repeats=3)
        >>> ms > 0
        True
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Callable[[], object], device: torch.device) -> int:
    """Kernels one call of ``fn`` puts on the GPU (torch.profiler: kernels, copies, memsets); on
    CPU, the operators it dispatches (what would each be a launch on a GPU).

    Example:
        >>> x = torch.randn(4, 4)
        >>> count_launches(lambda: torch.relu(x @ x), torch.device("cpu"))
        2
    """
    fn()
    sync(device)
    if device.type != "cuda":
        with _OpCounter() as counter:
            fn()
        return counter.ops
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph; the returned callable replays it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up on a side stream, as CUDA graph capture requires
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.no_grad()
def latency(
    model: torch.nn.Module,
    batch,
    device: torch.device,
    modes: tuple[str, ...] = MODES,
    repeats: int = 10,
) -> tuple[dict[str, float], dict[str, str], dict[str, int]]:
    """Per mode: median ms, or the error that stopped it; and launches per mode.

    Modes other than ``eager`` need CUDA; on CPU they are skipped (not an error).
    """
    times: dict[str, float] = {}
    errors: dict[str, str] = {}
    launches: dict[str, int] = {}
    eager = lambda: call(model, batch)  # noqa: E731
    for mode in modes:
        if mode != "eager" and device.type != "cuda":
            continue
        try:
            if mode == "eager":
                fn = eager
            elif mode == "compiled":
                compiled = torch.compile(model)
                fn = lambda c=compiled: call(c, batch)  # noqa: E731
                fn()  # compile outside the timed region
            elif mode == "graph":
                fn = graphed(eager, device)
            else:
                raise ValueError(f"unknown timing mode {mode!r}; choose from {MODES}")
            times[mode] = median_ms(fn, device, warmup=max(1, repeats // 3), repeats=repeats)
            if mode != "graph":  # a replay is one graph launch by construction
                launches[mode] = count_launches(fn, device)
        except Exception as exc:  # noqa: BLE001 — a mode that cannot run is a result
            errors[mode] = error_text(exc)
        finally:
            if mode == "compiled":
                torch._dynamo.reset()
    return times, errors, launches


def error_text(exc: BaseException) -> str:
    """Type and the first and last line of an exception (Inductor puts the cause last)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text[:300]}"


# Two configs whose medians differ by less than this are a tie on a shared machine: repeated
# CPU medians of one model on the 2-core CI machine spread by several percent under load.
NOISE_MARGIN = 0.05


def repeated_ms(
    fns: dict[str, Callable[[], float]], rounds: int = 3
) -> dict[str, float]:
    """Median over ``rounds`` of each ``fns[name]()`` (a timing in ms), the candidates
    interleaved round by round so that a slow spell of the machine hits them all alike.

    Example:
        >>> t = repeated_ms({"a": lambda: 2.0, "b": lambda: 1.0})
        >>> t["a"], t["b"]
        (2.0, 1.0)
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name in sorted(fns):
            samples[name].append(float(fns[name]()))
    return {name: statistics.median(v) for name, v in samples.items()}


def fastest(times: dict[str, float], rank: dict[str, tuple], margin: float = NOISE_MARGIN) -> str:
    """The name with the lowest time, where times within ``margin`` of the lowest tie and the
    tie goes to the lowest ``rank`` (e.g. better metric, then a fixed order): the same
    measurements up to noise give the same choice.

    Example:
        >>> fastest({"int8": 1.00, "fp8": 0.98, "bf16": 2.0}, {"int8": (0,), "fp8": (1,),
        ...                                                    "bf16": (2,)})
        'int8'
    """
    low = min(times.values())
    tied = [n for n, t in times.items() if t <= low * (1.0 + margin)]
    return min(tied, key=lambda n: (rank[n], n))
