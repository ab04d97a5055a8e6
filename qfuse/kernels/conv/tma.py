"""1x1 stride-1 convolutions as a GEMM over tensor descriptors (TMA), with split-K.

A 1x1, stride 1, pad 0, dilation 1 conv with one group on a channels-last input is exactly a GEMM:

    x  [N, C, H, W] channels-last  ->  [M = N*H*W, C_in]   (contiguous rows, a view)
    W  [O, C_in, 1, 1] packed      ->  [C_out, C_in]        (``conv.pack_weight``)
    out[M, C_out] = conv_epilogue(x @ W^T)                 (channels-last [N, O, H, W])

so both operands load through host-side tensor descriptors as in ``gemm.tma``: one bulk copy
per tile into swizzled shared memory, edges past M, N and K zero-filled by the copy engine, no
address arithmetic or masks in the main loop. The input must already be int8/fp8 in memory
(``implicit.qconv2d`` quantizes a float input in its own pass first). The epilogue is the other
conv kernels' (``epilogue.conv_epilogue``: zero-point correction ``acc - zp * colsum(W)``,
scale, bias, act, a float or quantized residual, post-act, requant), so int8 outputs are
bit-identical to ``ops.reference.qconv2d``.

Split-K: the long-K convs of a ResNet's last stages (2048 -> 512 channels on 7x7 maps) have
fewer output tiles than SMs; then each program sums one K range, parks its partial in a
workspace [SPLIT_K, M, C_out], and the tile's last arriving program adds the partials in split
order (``epilogue.split_k_reduce``: deterministic) and runs the epilogue.

Traced calls (``torch.compile``) cannot build descriptors inside a ``triton_op`` body (see
``gemm.opaque``), so there the launch is the opaque op ``qfuse::tma_conv1x1``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import (
    ACTIVATION_CODES,
    INTERPRETED,
    ConvConfig,
    dot_acc,
    tile_offsets,
)
from qfuse.kernels.conv.call import OP_ARGS, ConvCall, fake_output
from qfuse.kernels.epilogue import (
    column_parts,
    conv_epilogue,
    float_grid,
    k_range,
    output_code,
    split_k_reduce,
)
from qfuse.kernels.gemm.call import OpArg
from qfuse.kernels.grid import sm_count as _cuda_sm_count
from qfuse.kernels.grid import split_k_locks
from qfuse.kernels.layout import empty_nhwc
from qfuse.kernels.schedules import split_for

FP8 = torch.float8_e4m3fn
SMS = 132  # H100/H200 SXM: the schedule rule's default when no GPU is asked


@triton.jit(do_not_specialize=["M"])
def _conv1x1_tma_kernel(
    x_desc, w_desc, scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, res_scale_ptr, res_zp_ptr,
    out_inv_scale_ptr, out_zp_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_rm, stride_om,
    HAS_X_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, RES_Q: tl.constexpr, HAS_RES_ZP: tl.constexpr,
    POST_ACT: tl.constexpr, OUT_Q: tl.constexpr, HAS_OUT_ZP: tl.constexpr,
    OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, FP8_PROMOTE: tl.constexpr, EPI_SPLIT: tl.constexpr = 1,
):
    """Grid (tiles, SPLIT_K). ``FP8_PROMOTE`` as ``implicit._qconv_kernel``'s (fp8 accumulation
    precision: 0 is Triton's sm_90 default). ``EPI_SPLIT`` 2: the epilogue on the tile's two
    column halves one after the other (``epilogue.column_parts``): the residual's and the
    output's pointer tiles (64-bit each) are live for half the tile at a time."""
    pid = tl.program_id(0)
    offs_m, offs_n, pid_m, pid_n = tile_offsets(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_first, k_end = k_range(K, BLOCK_K, SPLIT_K)
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(k_first, k_end):
        a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        acc = dot_acc(a, b.T, acc, FP8_PROMOTE)

    is_last = True
    if SPLIT_K > 1:
        acc, is_last = split_k_reduce(acc, offs_m, offs_n, M, N, ws_ptr, lock_ptr + pid, SPLIT_K)
    if is_last:
        WIDTH: tl.constexpr = BLOCK_N // EPI_SPLIT
        first, second = column_parts(acc, EPI_SPLIT)
        offs_h = pid_n * BLOCK_N + tl.arange(0, WIDTH)
        for part in tl.static_range(EPI_SPLIT):
            conv_epilogue(
                first if part == 0 else second, offs_m, offs_h, offs_m < M, offs_h < N,
                scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, res_scale_ptr, res_zp_ptr,
                out_inv_scale_ptr, out_zp_ptr, out_ptr, stride_rm, stride_om,
                HAS_X_ZP, HAS_BIAS, ACT, HAS_RESIDUAL, RES_Q, HAS_RES_ZP, POST_ACT, OUT_Q,
                HAS_OUT_ZP, OUT_MANT, OUT_EMIN, EXACT,
            )
            offs_h += WIDTH


@dataclass(frozen=True)
class Conv1x1Config(ConvConfig):
    """A schedule of ``_conv1x1_tma_kernel``: ``ConvConfig``'s tile, warps, stages and
    ``fp8_promote``, and ``split_k``: K ranges per output tile (1: none)."""

    split_k: int = 1
    # 2: the epilogue on the tile's two column halves one after the other (fewer registers
    # live beside the residual's and output's pointer tiles; sm_90 ptxas spills less).
    epi_split: int = 1

    def __post_init__(self):
        if self.epi_split not in (1, 2):
            raise UnsupportedError(
                f"Conv1x1Config: epi_split={self.epi_split}; use 1 or 2 (column halves)."
            )
        super().__post_init__()
        if self.split_k < 1 or self.block_k < 16:
            raise UnsupportedError(
                f"Conv1x1Config: split_k={self.split_k}, block_k={self.block_k}; split_k >= 1 "
                "and block_k >= 16 (a descriptor's row is at least 16 bytes)."
            )


# The interpreter's cost grows with the tile: small tiles keep CI fast.
INTERPRETER_CONFIG = Conv1x1Config(32, 32, 32, 4, 1)
# (block_m, block_n, num_warps, num_stages, epi_split): the schedules ``conv1x1_candidates``
# offers; ``pick_conv1x1_config`` chooses among the first three and the fifth.
_TILES = ((128, 128, 8, 3, 1), (128, 64, 4, 4, 1), (64, 128, 4, 4, 1), (128, 128, 4, 4, 1),
          (128, 128, 8, 3, 2), (128, 64, 4, 4, 2))


def _tiles(M: int, N: int, bm: int, bn: int) -> int:
    return -(-M // bm) * -(-N // bn)


def conv1x1_candidates(M: int, N: int, K: int, sms: int = SMS) -> list[Conv1x1Config]:
    """Every schedule worth timing for an [M, K] x [N, K] conv-GEMM, each with the split-K the
    rule gives it (``schedules.split_for``: the smallest power of two that gives every SM a
    program while each split keeps >= 4 K steps)."""
    block_k = 128 if K > 64 else 64 if K > 32 else 32
    k_tiles = -(-K // block_k)
    return [Conv1x1Config(bm, bn, block_k, warps, stages, epi_split=epi,
                          split_k=split_for(_tiles(M, N, bm, bn), k_tiles, sms))
            for bm, bn, warps, stages, epi in _TILES]


def pick_conv1x1_config(M: int, N: int, K: int, sms: int = SMS,
                        residual: bool = False) -> Conv1x1Config:
    """The schedule ``qconv2d`` runs (no autotuning on the call path), from every candidate
    timed at resnet50's 1x1 shapes on an H200:

    - with a residual (a bottleneck's last conv: residual read, add, ReLU, requantize): 128x128
      on 8 warps with the epilogue on column halves (whole tiles spill registers there), the
      fastest candidate at every residual shape;
    - else 128x64 tiles for narrow outputs (C_out <= 64: a 128-wide tile would be half empty),
      128x128 where those tiles alone fill the SMs, else 64x128 (twice the tiles) with split-K
      over the rest.
    ``bench/conv1x1_ab.py`` times every candidate against this choice."""
    if INTERPRETED:
        return INTERPRETER_CONFIG
    cands = conv1x1_candidates(M, N, K, sms)
    if residual:
        return cands[4]
    if N <= 64:
        return cands[1]
    if _tiles(M, N, 128, 128) >= sms:
        return cands[0]
    return cands[2]


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SMS
    return _cuda_sm_count(device)


# Ways to run a 1x1 stride-1 conv: "tma" (this kernel) or "mma" (``implicit._qconv_kernel``).
CONV1X1_PATHS = ("tma", "mma")
# QFUSE_CONV1X1_PATH=mma keeps every 1x1 conv on the implicit GEMM (A/B of whole networks);
# "auto" (default): this kernel wherever it ``fits``.
_ENV = os.environ.get("QFUSE_CONV1X1_PATH", "auto")
if _ENV not in ("auto", "mma"):
    raise UnsupportedError(
        f"QFUSE_CONV1X1_PATH={_ENV!r}; use 'auto' (the TMA GEMM where it fits) or 'mma' (the "
        "implicit GEMM for every 1x1 conv), or leave it unset."
    )
DEFAULT_PATH = None if _ENV == "auto" else _ENV
# A float input takes a quantize pass of its own before this kernel; below this many rows the
# extra launch costs more than quantizing in the implicit GEMM's prologue saves (the GEMMs'
# measurement: ``schedules.candidates``).
FLOAT_X_MIN_M = 128


def default_path(M: int, x_quantized: bool, config) -> str | None:
    """``conv1x1_path`` for a conv that ``fits`` when the caller names none: "tma" for a
    ``Conv1x1Config``; "mma" (the implicit GEMM) for another schedule (a ``ConvConfig`` pins
    the implicit GEMM: tuning, tests), for a float input of fewer than ``FLOAT_X_MIN_M`` rows
    (a squeeze-excitation conv on 1x1 maps), or with ``QFUSE_CONV1X1_PATH=mma``; else None
    (this kernel)."""
    if isinstance(config, Conv1x1Config):
        return "tma"
    if config is not None or (not x_quantized and M < FLOAT_X_MIN_M):
        return "mma"
    return DEFAULT_PATH


def fits(x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, groups: int) -> bool:
    """Whether a conv is a plain GEMM that descriptors can read: one group, a 1x1 kernel,
    stride 1, no padding or dilation, C_in a multiple of 16 (the rows' pitch in bytes), an
    int8/fp8 weight whose [O, C_in] rows are contiguous and a channels-last contiguous input.
    Shapes and strides only (traced calls see fake tensors): a misaligned base is copied at
    launch (``_operands``)."""
    c_out, cg_in, kh, kw = weight.shape
    if not (groups == 1 and kh == 1 and kw == 1 and list(stride) == [1, 1]
            and list(padding) == [0, 0] and list(dilation) == [1, 1]):
        return False
    if cg_in % 16 or weight.dtype not in (torch.int8, FP8):
        return False
    if weight.stride(1) != 1 or (c_out > 1 and weight.stride(0) != cg_in):
        return False
    return x.permute(0, 2, 3, 1).is_contiguous()


def _operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as [M, C_in] and W as [C_out, C_in] rows, copied where a descriptor cannot read them
    (a base not 16-byte aligned, e.g. a view into a larger buffer)."""
    n, c, h, w = x.shape
    x2 = x.permute(0, 2, 3, 1).reshape(n * h * w, c)
    w2 = weight.reshape(weight.shape[0], c)
    if x2.stride() != (c, 1) or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if w2.stride() != (c, 1) or w2.data_ptr() % 16:
        w2 = w2.clone(memory_format=torch.contiguous_format)
    return x2, w2


def _schedule(x: torch.Tensor, call: ConvCall, residual: torch.Tensor | None,
              config: Conv1x1Config | None, fp8_promote: int | None) -> Conv1x1Config:
    """``config`` or ``pick_conv1x1_config``'s, with the fp8 promotion interval asked for."""
    n, c_in, h, w = x.shape
    cfg = config or pick_conv1x1_config(n * h * w, call.weight.shape[0], c_in,
                                         sm_count(x.device), residual is not None)
    if fp8_promote is not None:
        cfg = dataclasses.replace(cfg, fp8_promote=promotion(fp8_promote, cfg.block_k))
    return cfg


def conv1x1(x: torch.Tensor, call: ConvCall, residual: torch.Tensor | None = None,
            weight_sum: torch.Tensor | None = None, config: Conv1x1Config | None = None,
            fp8_promote: int | None = None) -> torch.Tensor:
    """The 1x1 conv ``call`` on quantized channels-last ``x`` [N, C_in, H, W] (int8/fp8, the
    weight's dtype) with the packed ``call.weight`` [C_out, C_in, 1, 1]; returns channels-last
    [N, C_out, H, W] of ``call.out_dtype``. ``weight_sum``: ``colsum(W)`` as int32 [C_out],
    needed with ``call.x_zero_point``. Launches directly (eager or the interpreter); traced
    calls go through ``traced_conv1x1``."""
    weight = call.weight
    if x.dtype not in (torch.int8, FP8) or x.dtype != weight.dtype:
        raise UnsupportedError(
            f"conv.tma.conv1x1: {x.dtype} input to a {weight.dtype} weight; quantize the input "
            "first (implicit.prequantize) to the weight's dtype."
        )
    if call.x_zero_point is not None and weight_sum is None:
        raise UnsupportedError("conv.tma.conv1x1: x_zero_point needs weight_sum (colsum(W)).")
    n, c_in, h, w = x.shape
    c_out = weight.shape[0]
    out = empty_nhwc((n, c_out, h, w), call.out_dtype, x.device)
    M = n * h * w
    if M == 0 or c_out == 0:
        return out
    cfg = _schedule(x, call, residual, config, fp8_promote)
    fp8 = weight.dtype == FP8
    x2, w2 = _operands(x, weight)
    if residual is not None:  # read as [M, C] rows, like the output
        residual = residual.contiguous(memory_format=torch.channels_last)
    res_scale, res_zp = call.residual_qparams(residual)
    tiles = _tiles(M, c_out, cfg.block_m, cfg.block_n)
    ws = locks = call.scale  # never read without split-K
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, M, c_out), device=x.device,
                         dtype=torch.float32 if fp8 else torch.int32)
        # A graph being captured owns its buffers: fresh counters (the kernel re-zeroes them).
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        locks = split_k_locks(x.device, tiles, capturing)
    opt = lambda t: t if t is not None else call.scale  # noqa: E731 - absent: never read
    grid_bits = float_grid(call.out_dtype)
    _conv1x1_tma_kernel[(tiles, cfg.split_k)](
        TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(w2, [cfg.block_n, cfg.block_k]),
        call.scale, opt(call.bias), opt(call.x_zero_point), opt(weight_sum), opt(residual),
        opt(res_scale), opt(res_zp), opt(call.out_inv_scale), opt(call.out_zero_point),
        out, ws, locks,
        M, c_out, c_in, c_out, c_out,
        HAS_X_ZP=call.x_zero_point is not None, HAS_BIAS=call.bias is not None,
        ACT=ACTIVATION_CODES[call.act], HAS_RESIDUAL=residual is not None,
        RES_Q=residual is not None and residual.dtype in (torch.int8, FP8),
        HAS_RES_ZP=res_zp is not None, POST_ACT=ACTIVATION_CODES[call.post_act],
        OUT_Q=output_code(call.out_dtype), HAS_OUT_ZP=call.out_zero_point is not None,
        OUT_MANT=grid_bits[0], OUT_EMIN=grid_bits[1], EXACT=INTERPRETED, FP8=fp8,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLIT_K=cfg.split_k, FP8_PROMOTE=cfg.fp8_promote if fp8 else 0, EPI_SPLIT=cfg.epi_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )
    return out


# The schedule as ``qfuse::tma_conv1x1``'s integer list, in the order the op has always taken it
# (a traced graph holds the list); not the dataclass's, whose own fields follow ConvConfig's.
_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k", "group_m",
           "fp8_promote", "epi_split")


def _tma_op(*args) -> torch.Tensor:
    """``conv1x1`` as an opaque op: Inductor calls it like an extern kernel (CUDA graphs
    capture its launch) and it builds the descriptors from the real tensors. Its schema is
    ``qfuse::qconv2d``'s (no defaults) plus the weight's column sums and the schedule."""
    x, call, residual = ConvCall.from_op_args(*args)
    weight_sum, config = args[len(OP_ARGS.args):]
    if not x.permute(0, 2, 3, 1).is_contiguous():  # the graph may hand over another layout
        x = x.contiguous(memory_format=torch.channels_last)
    cfg = Conv1x1Config(**dict(zip(_FIELDS, config, strict=True)))
    return conv1x1(x, call, residual, weight_sum, cfg)


_tma_op.__signature__ = OP_ARGS.signature(OpArg("weight_sum", "Tensor?"),
                                          OpArg("config", "SymInt[]"), defaults=False)
tma_conv1x1 = torch.library.custom_op("qfuse::tma_conv1x1", _tma_op, mutates_args=())
tma_conv1x1.register_fake(fake_output)


# The longest fp8 promotion interval a requested one is held to: promoting every 128
# K-elements missed the float32-accumulation bound ``tests/kernels/test_conv.py`` holds a
# promoted conv to (``test_gpu_real_shapes_promoted_fp8``); every 64, what the implicit GEMM's
# 64-deep tiles give, meets it.
MAX_PROMOTE = 64


def promotion(fp8_promote: int, block_k: int) -> int:
    """The promotion interval a schedule with ``block_k`` runs for a requested one."""
    return min(fp8_promote, block_k, MAX_PROMOTE) if fp8_promote else 0


def traced_conv1x1(x: torch.Tensor, call: ConvCall, residual: torch.Tensor | None = None,
                   weight_sum: torch.Tensor | None = None, config: Conv1x1Config | None = None,
                   fp8_promote: int | None = None) -> torch.Tensor:
    """``conv1x1`` from a traced ``qfuse::qconv2d`` body: the schedule is chosen here (shapes
    are concrete there) and passed to the op as integers."""
    cfg = _schedule(x, call, residual, config, fp8_promote)
    return torch.ops.qfuse.tma_conv1x1(*call.op_args(x, residual), weight_sum,
                                       [int(getattr(cfg, name)) for name in _FIELDS])
