"""What every qfuse benchmark shares: timing, launch counting, error, and the result file.

Timing is ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call, median). Every
implementation is checked against a float64 reference before it is timed; one that fails to run
is recorded with its error instead of a time, so a row never silently disappears.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

# Where the benchmarks allocate; "cpu" only for smoke-testing the scripts themselves.
DEVICE = "cuda"
# Where a script writes when neither ``--out`` nor ``$OUT`` says otherwise.
RESULTS = Path(__file__).resolve().parent / "results"


def ints(text: str) -> list[int]:
    """``"1,32,128"`` -> ``[1, 32, 128]`` (an argparse ``type``)."""
    return [int(v) for v in text.split(",")]


def shapes(text: str) -> list[tuple[int, ...]]:
    """``"768x3072,4096x4096"`` -> ``[(768, 3072), (4096, 4096)]`` (an argparse ``type``)."""
    return [tuple(int(d) for d in shape.split("x")) for shape in text.split(",")]


def call_args(kind: type, flat: dict) -> dict:
    """A case written as one flat dict of a fused op's arguments by name, as the kernels and
    ``ops.reference`` take it: the call description's fields built into ``call`` (``kind``:
    ``GemmCall`` or ``ConvCall``, once per layer as ``qfuse.nn`` does), the per-call tensors
    (``x``, ``x_scale``, ``residual``) left beside it, so that ``dispatch.qlinear(**args)``,
    ``implicit.qconv2d(**args)`` and their references take it as it is."""
    fields = {f.name for f in dataclasses.fields(kind)}
    return {"call": kind(**{k: v for k, v in flat.items() if k in fields}),
            **{k: v for k, v in flat.items() if k not in fields}}


def map_tensors(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` applied to a tensor, or to each tensor field of a call description (a new one:
    they are frozen); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: fn(getattr(value, f.name)) for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), torch.Tensor)})
    return value


def to_device(args: dict, device) -> dict:
    """``call_args``' dict (or any dict of arguments) with every tensor on ``device``, the
    call's included: a GPU case checked against the CPU reference."""
    return {k: map_tensors(v, lambda t: t.to(device)) for k, v in args.items()}


# torchao's quantize_ (``set_inductor_config=True``, its default) sets these Inductor options for
# the whole process (torchao.quantization.utils.recommended_inductor_config_setter): every model
# compiled afterwards, bf16 and qfuse included, then ran coordinate-descent tuning over all
# directions (on an H100 one bf16 decode layer had not finished compiling after 6 minutes). The
# benchmarks quantize without them and compile torchao's rows, and only those, under them
# (``torchao_inductor``): each toolkit as its users get it.
TORCHAO_INDUCTOR = {
    "coordinate_descent_tuning": True,
    "coordinate_descent_check_all_directions": True,
    "force_fuse_int_mm_with_mul": True,
}


def torchao_quantize(model: torch.nn.Module, config) -> None:
    """``torchao.quantization.quantize_(model, config)``, Inductor's settings left as they were."""
    import dataclasses

    import torch._inductor.config as ic
    from torchao.quantization import quantize_

    if dataclasses.is_dataclass(config) and any(
        f.name == "set_inductor_config" for f in dataclasses.fields(config)
    ):
        config = dataclasses.replace(config, set_inductor_config=False)
    keys = [k for k in (*TORCHAO_INDUCTOR, "fx_graph_cache") if hasattr(ic, k)]
    before = {k: getattr(ic, k) for k in keys}
    quantize_(model, config)
    for k, v in before.items():  # in case a config without the flag set them anyway
        setattr(ic, k, v)


def torchao_inductor():
    """A context in which ``torch.compile`` compiles with torchao's recommended Inductor settings
    (compilation happens at the first call: run that inside)."""
    import torch._inductor.config as ic

    return ic.patch({k: v for k, v in TORCHAO_INDUCTOR.items() if hasattr(ic, k)})


def environment() -> dict:
    """Device, library versions and the commit the numbers belong to (``QFUSE_COMMIT`` wins: the
    device machine's copy of the tree may carry a stale .git)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    if len(commit) != 40:  # the device machine's copy of the tree has no .git
        commit = ""
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("QFUSE_COMMIT") or commit or "unknown",
        "date": time.strftime("%Y-%m-%d"),
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/Inf in ``out`` gives inf."""
    out64 = out.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref).norm() / ref.norm()).item()


def count_launches(fn: Callable[[], object]) -> int:
    """GPU kernels (and memcpy/memset) one call of ``fn`` puts on the device, by torch.profiler."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def classify(name: str, classes, other: str) -> str:
    """The first class of ``classes`` (``(class, (name substrings, ...))`` pairs) whose
    substring is in the kernel's ``name`` (case-insensitive), else ``other``."""
    low = name.lower()
    for cls, keys in classes:
        if any(k in low for k in keys):
            return cls
    return other


def profiled(fn: Callable[[], object], calls: int = 1) -> torch.profiler.profile:
    """The CUDA-activity profile of ``calls`` calls of ``fn`` (one warm-up call first)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def cuda_kernels(fn: Callable[[], object], calls: int = 1) -> list[tuple[str, float]]:
    """``(kernel name, GPU us)`` of every kernel ``calls`` calls of ``fn`` launch
    (torch.profiler), in the order they ran. Breakdowns divide by ``calls``."""
    events = [e for e in profiled(fn, calls).events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.device_time) for e in events]


def host_us(fn: Callable[[], object], calls: int = 20) -> float:
    """CPU time to issue one call, measured while the GPU is held busy (so nothing waits on it):
    above the GPU time, a forward is launch-bound and CUDA graphs would pay off."""
    torch.cuda._sleep(int(5e7))  # ~25 ms of GPU spin at ~2 GHz; the calls below only queue
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return elapsed * 1e6


def median_us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def wall_us(fn: Callable[[], object], calls: int = 20, warmup: int = 1) -> float:
    """Wall microseconds per call of ``fn``, host and GPU together (synchronized at both ends)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (static inputs); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return lambda: (graph.replay(), out)[1]


def calibrated(
    model: torch.nn.Module,
    config,
    batches: Sequence[dict],
    example: dict | None = None,
    output: str = "graph",
    **prepare_kwargs,
) -> torch.nn.Module:
    """``qfuse.prepare`` on ``example`` (default: the first batch; keyword inputs), one
    calibration forward per batch, ``qfuse.convert(..., output=output)``."""
    import qfuse

    example = batches[0] if example is None else example
    prepared = qfuse.prepare(model, config, (), example_kwargs=example, **prepare_kwargs)
    with torch.no_grad():
        for batch in batches:
            prepared(**batch)
    return qfuse.convert(prepared, output=output)


def measure(
    row: dict,
    fn: Callable[[], torch.Tensor],
    ref: torch.Tensor,
    flops: float,
    max_err: float,
    launches: bool = True,
    to_float: Callable[[torch.Tensor], torch.Tensor] | None = None,
    graph: bool = False,
) -> dict:
    """Fill ``row`` with median_us, tflops, launches and max_rel_err, or with ``error``.

    ``max_err`` is the correctness gate: an implementation whose output is further than that from
    the float64 reference is recorded as wrong and not timed. ``to_float`` turns a quantized
    output back into real values for that check (it is not timed). ``graph`` adds
    ``graph_us``: the median of CUDA-graph replays, i.e. GPU time without host launch cost
    (no L2 flush between replays, so weights that fit in L2 read faster than from HBM).
    """
    try:
        out = fn()
        err = rel_err(to_float(out) if to_float else out.float(), ref)
        row["max_rel_err"] = err
        if not err <= max_err:
            row["error"] = f"wrong result: rel err {err:.3g} > {max_err}"
            return row
        row["median_us"] = median_us(fn)
        row["tflops"] = flops / (row["median_us"] * 1e-6) / 1e12
        if launches:
            row["launches"] = count_launches(fn)
            row["host_us"] = host_us(fn)
        if graph:
            try:
                ms = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
                row["graph_us"] = ms * 1e3
            except Exception as exc:  # noqa: BLE001 — not every baseline can be captured
                row["graph_error"] = error_text(exc)
    except Exception as exc:  # noqa: BLE001 — a failing baseline is a result, not a crash
        row["error"] = error_text(exc)
        if os.environ.get("QFUSE_BENCH_TRACEBACK"):
            traceback.print_exc()
    finally:
        torch.cuda.synchronize()
    return row


def error_text(exc: Exception) -> str:
    """First and last line of an exception (Inductor puts the cause on the last one)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text[:300]}"


def write_results(path: str, rows: list[dict], extra: dict | None = None) -> None:
    """``{device, torch, triton, commit, date, **extra, rows}`` as JSON at ``path``, written to a
    temporary file and renamed: a run killed while writing leaves the previous file whole."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**environment(), **(extra or {}), "rows": rows}, f, indent=1)
    os.replace(tmp, path)


def add_ratios(rows: list[dict], key: tuple[str, ...]) -> None:
    """Per group of rows with the same ``key`` fields: speedup over bf16 eager and best baseline.

    The best baseline is the fastest non-qfuse implementation of the same dtype as the row (or of
    any dtype for bf16 rows), so each qfuse row is compared with what a user has today.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r)
    for group in groups.values():
        eager = [r for r in group if r["impl"] == "bf16_eager" and "median_us" in r]
        for r in group:
            if "median_us" not in r:
                continue
            if eager:
                r["x_bf16_eager"] = eager[0]["median_us"] / r["median_us"]
            base = [
                b["median_us"] for b in group
                if "median_us" in b and not b["impl"].startswith("qfuse")
                and b["dtype"] in (r["dtype"], "bf16")
            ]
            if base:
                r["x_best_baseline"] = min(base) / r["median_us"]


def print_table(rows: list[dict], shape_keys: tuple[str, ...]) -> None:
    head = f"{'shape':>22} {'dtype':>5} {'impl':>18} {'us':>9} {'TF/s':>7} {'xeager':>7} "
    print(head + f"{'xbest':>6} {'launch':>6} {'host_us':>7} {'graph':>7} {'relerr':>8}")
    for r in rows:
        shape = "x".join(str(r[k]) for k in shape_keys)
        if "median_us" not in r:
            print(f"{shape:>22} {r['dtype']:>5} {r['impl']:>18}  {r.get('error', '')[:70]}")
            continue
        print(
            f"{shape:>22} {r['dtype']:>5} {r['impl']:>18} {r['median_us']:9.1f} "
            f"{r['tflops']:7.1f} {r.get('x_bf16_eager', 0):7.2f} {r.get('x_best_baseline', 0):6.2f}"
            f" {r.get('launches', -1):6d} {r.get('host_us', 0):7.1f} {r.get('graph_us', 0):7.1f}"
            f" {r['max_rel_err']:8.2e}"
        )
