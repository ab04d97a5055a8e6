"""Fused quantized Conv2d, int8 or fp8 e4m3: implicit GEMM on channels-last activations.

    out[m, n] = sum_k x_q[pixel(m) + tap(k), channel(k)] * W_q[n, k]    m = (batch, oh, ow)
    y = (acc - zp_x * colsum(W)) * scale[n] + bias[n]                    k = (kh, kw, c)
    out = requant?( post_act( (+ residual)( act(y) ) ) )

No im2col buffer: each K step loads an A tile straight from the NHWC input (a (kh, kw) tap and a
block of channels; zero padding by masks), quantized in the prologue when the input is float or
read as int8/fp8 when the previous fused conv handed it over. A padded tap of an int8 input with a
zero point reads the zero point, so ``acc - zp * colsum(W)`` gives the reference's
``conv(q - zp)`` exactly. Weights come packed channels-last (``[O, KH, KW, I]`` in memory, see
``pack_weight``): the B tile of one tap is a contiguous run of input channels, and the whole of
K is contiguous for the small-channel stem path (``FLAT_K``), where one K block spans several taps.

A layer's call is described once (``call.ConvCall``). Depthwise convolutions (one input channel
per group) run a direct kernel instead (``depthwise``), and stems (few input channels) a gather
kernel whose K loop spans all taps (``stem``), and 1x1 stride-1 convs on a channels-last input a
GEMM over tensor descriptors with split-K (``tma``); ``qconv2d`` chooses (``conv_path``). All end in
``epilogue.conv_epilogue``, which repeats ``ops.reference.epilogue`` operation by operation
(IEEE-exact ops only, ``enable_fp_fusion=False``), so int8 outputs are bit-identical to the
reference.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import (
    ACTIVATION_CODES,
    INTERPRETED,
    ConvConfig,
    dot_acc,
    input_qparams,
    load_quantized,
    pixel_coords,
    tile_offsets,
)
from qfuse.kernels.conv import tma as conv_tma
from qfuse.kernels.conv.call import ConvCall
from qfuse.kernels.conv.depthwise import dwconv
from qfuse.kernels.conv.im2col import im2col
from qfuse.kernels.conv.stem import StemConfig, pick_stem_config, stem_conv
from qfuse.kernels.epilogue import conv_epilogue, float_grid, output_code
from qfuse.kernels.layout import empty_nhwc

FP8 = torch.float8_e4m3fn


@triton.jit(do_not_specialize=["M"])
def _qconv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, x_inv_scale_ptr, x_zp_ptr, wsum_ptr, res_ptr,
    res_scale_ptr, res_zp_ptr, out_inv_scale_ptr, out_zp_ptr, out_ptr,
    M, H, W, OH, OW, CG_IN, CG_OUT, K_W,
    sxn, sxh, sxw, sxc, swo, swh, sww, swc, stride_rm, stride_om,
    SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    FLAT_K: tl.constexpr,
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, HAS_X_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RES_Q: tl.constexpr, HAS_RES_ZP: tl.constexpr,
    POST_ACT: tl.constexpr, OUT_Q: tl.constexpr,
    HAS_OUT_ZP: tl.constexpr, OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FP8_PROMOTE: tl.constexpr = 0,
):
    """``FP8_PROMOTE`` (fp8 only): 0 leaves ``tl.dot`` at Triton's default, which on sm_90 lets
    wgmma accumulate in place at the tensor core's reduced precision for the whole K loop;
    ``P`` (32 <= P <= BLOCK_K) sums every P K-elements in a fresh partial and adds it to the
    float32 accumulator (``max_num_imprecise_acc``; ``ConvConfig.fp8_promote`` says why)."""
    group = tl.program_id(1)
    offs_m, offs_n, _, _ = tile_offsets(tl.program_id(0), M, CG_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < CG_OUT
    batch, oh, ow = pixel_coords(offs_m, OH, OW)
    ih0 = oh * SH - PH
    iw0 = ow * SW - PW
    x_rows = x_ptr + batch.to(tl.int64) * sxn + group * CG_IN * sxc
    n_glob = group * CG_OUT + offs_n
    w_cols = w_ptr + n_glob[None, :] * swo

    x_inv_scale, x_zp, x_zp_q = input_qparams(x_inv_scale_ptr, x_zp_ptr, X_QUANTIZED, HAS_X_ZP)

    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    if FLAT_K:
        # K = (kh, kw, c) flattened: one K block spans several taps (few input channels).
        K = KH * KW * CG_IN
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            c = k % CG_IN
            tap = k // CG_IN
            kh = tap // KW
            kw = tap % KW
            ih = ih0[:, None] + (kh * DH)[None, :]
            iw = iw0[:, None] + (kw * DW)[None, :]
            mask_k = k < K
            amask = (mask_m[:, None] & mask_k[None, :] & (ih >= 0) & (ih < H) & (iw >= 0)
                     & (iw < W))
            a_ptrs = x_rows[:, None] + ih * sxh + iw * sxw + (c * sxc)[None, :]
            a = load_quantized(a_ptrs, amask, x_inv_scale, x_zp, x_zp_q, FP8, X_QUANTIZED,
                               HAS_X_ZP, EXACT)
            b_off = kh * swh + kw * sww + c * swc
            b = tl.load(w_cols + b_off[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = dot_acc(a, b, acc, FP8_PROMOTE)
    else:
        # One (kh, kw) tap and a block of channels per step.
        c_tiles = tl.cdiv(CG_IN, BLOCK_K)
        for t in range(0, KH * KW * c_tiles):
            c0 = (t % c_tiles) * BLOCK_K
            tap = t // c_tiles
            kh = tap // KW
            kw = tap % KW
            ih = ih0 + kh * DH
            iw = iw0 + kw * DW
            valid = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            c = c0 + offs_k
            mask_k = c < CG_IN
            a_ptrs = (x_rows + ih * sxh + iw * sxw)[:, None] + (c * sxc)[None, :]
            a = load_quantized(a_ptrs, valid[:, None] & mask_k[None, :], x_inv_scale, x_zp,
                               x_zp_q, FP8, X_QUANTIZED, HAS_X_ZP, EXACT)
            b_ptrs = w_cols + (kh * swh + kw * sww) + (c * swc)[:, None]
            # K_W: the weight's channels (< CG_IN for an im2col buffer's padded row)
            b = tl.load(b_ptrs, mask=(c < K_W)[:, None] & mask_n[None, :], other=0.0)
            acc = dot_acc(a, b, acc, FP8_PROMOTE)

    conv_epilogue(
        acc, offs_m, n_glob, mask_m, mask_n,
        scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, res_scale_ptr, res_zp_ptr,
        out_inv_scale_ptr, out_zp_ptr, out_ptr, stride_rm, stride_om,
        HAS_X_ZP, HAS_BIAS, ACT, HAS_RESIDUAL, RES_Q, HAS_RES_ZP, POST_ACT, OUT_Q, HAS_OUT_ZP,
        OUT_MANT, OUT_EMIN, EXACT,
    )


SMS = 132  # H100/H200 SXM


def pick_config(M: int, cg_in: int, cg_out: int, k_total: int, fp8: bool) -> ConvConfig:
    """Tile shape from the problem shape (no autotuning on the call path). Measured on the H200
    by GPU time (CUDA-graph replays, ``bench/tune_conv.py``, int8, ResNet-50 layers at batch
    32):
    - 128x64x64, 4 warps, 4 stages: fastest on the large-M layers (3x3 at 56x56, 1x1 256->64,
      3x3 stride 2, the stem's patch GEMM).
    - kxk convs with few pixels (M <= 8192: 14x14 and 7x7 maps) and K >= 1152: 64x64x128,
      3 stages (a third faster on 3x3 512ch 7x7).
    - 1x1 convs that widen to >= 256 channels: 256x128x64, 8 warps (about a fifth faster).
    Where 128x64 tiles would leave SMs idle and K is short, smaller tiles give more programs;
    with a long K (2048->512 at 7x7) the bigger tiles stay faster."""
    if INTERPRETED:  # interpreter cost grows with tile size: smallest legal tiles
        return ConvConfig(32, 32, 32, 4, 1)
    taps = max(k_total // max(cg_in, 1), 1)
    if taps > 1 and M <= 8192 and k_total >= 1152 and cg_out >= 64:
        return ConvConfig(64, 64, 128, 4, 3)
    if taps == 1 and cg_out >= 256 and 64 <= cg_in <= 512 and M >= 1024:
        return ConvConfig(256, 128, 64, 8, 3)
    block_n = 64 if cg_out > 32 else 32 if cg_out > 16 else 16
    block_k = 64 if k_total >= 64 else 32
    block_m = 128
    if -(-M // block_m) * -(-cg_out // block_n) < SMS and k_total < 1024:
        block_m, block_n = 64, min(block_n, 32)
    if cg_in < block_k:  # stem: K spans taps, each A element is a gather
        block_m = 64
    return ConvConfig(block_m, block_n, block_k, 4, 4)


def prequantize(x, qdtype, inv_scale, zero_point, wrap=None):
    """Quantize ``x`` once in its own pass: a kxk conv (or a depthwise one) would otherwise
    quantize each input element k*k times in its prologue; int8/fp8 values are identical.
    Runs ``quantize``'s kernel over the storage as rows of its last two dimensions (W*C
    channels-last, H*W otherwise; W alone past 8192): the kernel's programs take 4 rows, and
    rows of C alone — 3 for a stem — made 1.6M programs of 12 values each, the slowest kernel of
    resnet's and mobilenet's 32x3x224x224 input on the H200 (GPU profile).
    ``wrap`` as in ``qconv2d``'s ``launcher``."""
    from qfuse.kernels.quantize import quantize

    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        x = x.contiguous(memory_format=torch.channels_last)
    nhwc = not x.is_contiguous()  # channels-last storage
    storage = x.permute(0, 2, 3, 1) if nhwc else x
    row = storage.shape[-2] * storage.shape[-1]
    row = row if row <= 8192 else storage.shape[-1]
    q, _ = quantize(storage.reshape(-1, row), qdtype, inv_scale, zero_point, INTERPRETED,
                    wrap=wrap)
    q = q.view(storage.shape)
    return q.permute(0, 3, 1, 2) if nhwc else q


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's weight layout: ``[O, I/g, KH, KW]`` stored channels-last (``[O, KH, KW, I]``
    in memory), so the channels of one tap — and for the stem the whole of K — are contiguous.
    Same shape and values; ``F.conv2d`` (the reference) reads it as is."""
    return weight.contiguous(memory_format=torch.channels_last)


# Ways to run a conv with groups == 1 over few input channels (a stem): "gather" (the stem
# kernel, gathering patches in its K loop), "im2col" (a patch buffer, then a 1x1 GEMM over it)
# and "flat" (the implicit GEMM's flat-K loop). Same numbers: int8 bit-identical.
STEM_PATHS = ("gather", "im2col", "flat")


def conv_path(groups: int, c_in: int, c_out: int, cg_in: int, kh: int, kw: int,
              stem_path: str | None, gemm_fits: bool = False,
              conv1x1_path: str | None = None) -> str:
    """The kernel a conv runs on: "depthwise", "implicit" (``_qconv_kernel``), "gemm1x1"
    (``tma``) or one of ``STEM_PATHS``. A kxk conv with fewer than 16 input channels and
    one group is a stem: its implicit GEMM would gather one or two bytes per A element and per
    tap over channel tiles mostly empty, so it runs on the stem kernel (``stem``);
    ``stem_path`` overrides for any conv with one group. A 1x1 stride-1 conv that is a plain
    GEMM descriptors can read (``gemm_fits``: ``conv_tma.fits``) runs on the TMA GEMM;
    ``conv1x1_path`` ("tma" / "mma", see ``conv_tma.CONV1X1_PATHS``) forces either kernel."""
    if conv1x1_path is not None:
        if conv1x1_path not in conv_tma.CONV1X1_PATHS or (conv1x1_path == "tma"
                                                         and not gemm_fits):
            raise UnsupportedError(
                f"qconv2d: conv1x1_path={conv1x1_path!r} for a conv the TMA GEMM cannot run "
                f"(it needs groups=1, a 1x1 kernel, stride 1, no padding or dilation, input "
                f"channels a multiple of 16 (got {cg_in}) and a channels-last input); use one of "
                f"{conv_tma.CONV1X1_PATHS} where it fits, or None to let the shape decide."
            )
        if conv1x1_path == "tma":
            return "gemm1x1"
    elif gemm_fits and stem_path is None:
        return "gemm1x1"
    if stem_path is not None:
        if stem_path not in STEM_PATHS or groups != 1:
            raise UnsupportedError(
                f"qconv2d: stem_path={stem_path!r} for a conv with groups={groups}; use one of "
                f"{STEM_PATHS} with groups=1, or None to let the shape decide."
            )
        return stem_path
    if groups == c_in and groups == c_out and cg_in == 1:
        return "depthwise"
    if groups == 1 and kh * kw > 1 and cg_in < 16:
        return "gather"
    return "implicit"


def qconv2d(
    x: torch.Tensor,
    call: ConvCall,
    residual: torch.Tensor | None = None,
    config: ConvConfig | StemConfig | None = None,
    launcher=None,
    prequantize_input: bool | None = None,
    stem_path: str | None = None,
    fp8_promote: int | None = None,
    conv1x1_path: str | None = None,
) -> torch.Tensor:
    """The fused quantized conv ``call`` on NCHW-shaped ``x`` (any strides; channels-last is the
    fast layout), ``call.weight`` [O, I/groups, KH, KW] int8 or fp8; returns a channels-last
    [N, O, OH, OW] tensor of ``call.out_dtype``. Meanings as ``ops.reference.qconv2d``.
    ``launcher`` wraps each kernel before its launch (``torch.library.wrap_triton`` in the op).
    A float input is quantized in the GEMM's prologue (1x1 convs) or, where each element feeds
    several taps, once in a separate pass (``prequantize_input`` overrides: same numbers).
    A kxk conv with fewer than 16 input channels and one group (a stem) runs on the stem
    kernel (``stem``; ``config`` then a ``StemConfig``, whose ``prequantize`` is the default for
    ``prequantize_input``); ``stem_path`` picks among ``STEM_PATHS`` (same numbers; see
    ``conv_path``).
    ``fp8_promote`` overrides the schedule's ``ConvConfig.fp8_promote`` (fp8 accumulation
    precision; capped at the tile's ``block_k``, since every ``tl.dot`` ends with a promotion).
    A 1x1 stride-1 conv with C_in % 16 == 0 on a channels-last input runs on the TMA GEMM
    (``tma``: a float input quantized first; ``config`` then a ``tma.Conv1x1Config``;
    ``tma.default_path`` says where it does not by default);
    ``conv1x1_path`` ("tma" / "mma") forces that kernel or the implicit GEMM (same numbers).

    Example (on CPU this runs under the Triton interpreter, TRITON_INTERPRET=1):
        >>> import torch
        >>> from qfuse.ops.reference import qconv2d as ref
        >>> x = torch.randn(1, 8, 5, 5)
        >>> call = ConvCall(torch.randint(-127, 128, (16, 8, 3, 3), dtype=torch.int8),
        ...                 torch.full((16,), 1e-3), x_inv_scale=torch.tensor(40.0),
        ...                 out_inv_scale=torch.tensor(20.0), act="relu", out_dtype=torch.int8,
        ...                 padding=[1, 1])
        >>> bool(torch.equal(qconv2d(x, call), ref(x, call)))
        True
    """
    launch = launcher or (lambda k: k)
    weight, stride, padding, dilation, groups = (call.weight, call.stride, call.padding,
                                                 call.dilation, call.groups)
    n, c_in, h, w = x.shape
    c_out, cg_in, kh, kw = weight.shape
    out = empty_nhwc(call.output_shape(x.shape), call.out_dtype, x.device)
    oh, ow = out.shape[2], out.shape[3]
    M = n * oh * ow
    if M == 0 or c_out == 0:
        return out
    fp8 = weight.dtype == FP8
    x_quantized = x.dtype in (torch.int8, FP8)
    gemm_fits = conv_tma.fits(x, weight, stride, padding, dilation, groups)
    if conv1x1_path is None and gemm_fits:
        conv1x1_path = conv_tma.default_path(M, x_quantized, config)
    path = conv_path(groups, c_in, c_out, cg_in, kh, kw, stem_path, gemm_fits, conv1x1_path)
    use_im2col = path == "im2col"
    if path == "gather":
        if config is not None and not isinstance(config, StemConfig):
            raise UnsupportedError(
                f"qconv2d: config={config} for the stem kernel; pass a StemConfig (or "
                f"stem_path='flat' / 'im2col' to run a ConvConfig on another stem path)."
            )
        config = config or pick_stem_config(c_out)
        if prequantize_input is None:
            prequantize_input = config.prequantize
    elif path == "gemm1x1":
        if config is not None and not isinstance(config, conv_tma.Conv1x1Config):
            raise UnsupportedError(
                f"qconv2d: config={config} for the 1x1 TMA GEMM; pass a tma.Conv1x1Config "
                "(or conv1x1_path='mma' to run a ConvConfig on the implicit GEMM)."
            )
        prequantize_input = True  # descriptors read int8/fp8 memory as it is
    elif isinstance(config, (StemConfig, conv_tma.Conv1x1Config)):
        raise UnsupportedError(
            f"qconv2d: a {type(config).__name__} for a conv that runs on the {path!r} path; "
            "pass a ConvConfig (StemConfig: stem_path='gather'; Conv1x1Config: a 1x1 conv "
            "tma.fits)."
        )
    if prequantize_input is None:
        prequantize_input = kh * kw > 1 or path == "depthwise"  # im2col then copies bytes
    if not x_quantized and x.numel() and prequantize_input:
        x = prequantize(x, weight.dtype, call.x_inv_scale, call.x_zero_point, launcher)
        x_quantized = True
    if residual is not None:  # read as [M, C] rows, like the output (row stride C)
        residual = residual.contiguous(memory_format=torch.channels_last)
    wsum = None
    if call.x_zero_point is not None and path != "depthwise":  # depthwise subtracts zp itself
        wsum = weight.to(torch.int32).sum(dim=(1, 2, 3), dtype=torch.int32)
    if path == "gemm1x1":
        run = conv_tma.traced_conv1x1 if launcher is not None else conv_tma.conv1x1
        return run(x, call, residual, wsum, config, fp8_promote)
    res_scale, res_zp = call.residual_qparams(residual)
    grid_bits = float_grid(call.out_dtype)
    flags = dict(
        SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1],
        KH=kh, KW=kw, FP8=fp8, X_QUANTIZED=x_quantized, HAS_X_ZP=call.x_zero_point is not None,
        HAS_BIAS=call.bias is not None, ACT=ACTIVATION_CODES[call.act],
        HAS_RESIDUAL=residual is not None,
        RES_Q=residual is not None and residual.dtype in (torch.int8, FP8),
        HAS_RES_ZP=res_zp is not None,
        POST_ACT=ACTIVATION_CODES[call.post_act], OUT_Q=output_code(call.out_dtype),
        HAS_OUT_ZP=call.out_zero_point is not None, OUT_MANT=grid_bits[0],
        OUT_EMIN=grid_bits[1], EXACT=INTERPRETED,
    )
    # The kernels' tensors between the weight and the output, in their order; an absent one is
    # the never-read ``scale`` (never ``out``: see ``im2col``'s note).
    opt = lambda t: t if t is not None else call.scale  # noqa: E731
    operands = (call.scale, opt(call.bias), opt(call.x_inv_scale), opt(call.x_zero_point),
                opt(wsum), opt(residual), opt(res_scale), opt(res_zp), opt(call.out_inv_scale),
                opt(call.out_zero_point))
    if path == "depthwise":
        return dwconv(x, weight, out, operands, flags, config, launch)
    if path == "gather":
        if fp8_promote is not None:
            config = replace(config, fp8_promote=min(fp8_promote, config.block_k))
        return stem_conv(x, weight, out, operands, flags, config, launch)
    sx = x.stride()
    sw = weight.stride()
    cg_out = c_out // groups
    sizes = (M, h, w, oh, ow, cg_in, cg_out, cg_in)
    strides = (sx[0], sx[2], sx[3], sx[1], sw[0], sw[2], sw[3], sw[1])
    k_total = kh * kw * cg_in
    if use_im2col:
        # A 1x1 GEMM over the patch buffer: one "pixel" per row, K = KP channels (the weight,
        # flattened (kh, kw, c) like the buffer, has K_W = KH*KW*C of them).
        x = im2col(x, weight.dtype, (kh, kw), stride, padding, dilation, oh, ow,
                   call.x_inv_scale, call.x_zero_point, launch)
        w2 = weight.permute(0, 2, 3, 1).reshape(c_out, -1)  # a view of the packed weight
        weight = w2
        sizes = (M, 1, 1, 1, 1, x.shape[1], c_out, w2.shape[1])
        strides = (x.stride(0), 0, 0, 1, w2.stride(0), 0, 0, w2.stride(1))
        flags.update(SH=1, SW=1, PH=0, PW=0, DH=1, DW=1, KH=1, KW=1, X_QUANTIZED=True)
        cg_in = k_total = x.shape[1]
    cfg = config or pick_config(M, cg_in, cg_out, k_total, fp8)
    if fp8_promote is not None:
        cfg = replace(cfg, fp8_promote=min(fp8_promote, cfg.block_k))
    flat_k = cg_in < cfg.block_k and not use_im2col  # im2col rows: padded, one "tap"
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(cg_out, cfg.block_n), groups)
    launch(_qconv_kernel)[grid](
        x, weight, *operands, out,
        *sizes, *strides, c_out, c_out,
        **flags, FLAT_K=flat_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FP8_PROMOTE=cfg.fp8_promote if fp8 else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )
    return out
