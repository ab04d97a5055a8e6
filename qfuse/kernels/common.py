"""Pieces shared by every qfuse kernel: tile order, rounding, activations, requantization.

Bit-exactness with the CPU reference (``qfuse/ops/reference.py``, same formulas in torch) is the
design rule here. Only IEEE-exact float32 operations are used — add, subtract, multiply,
``div_rn``, min/max, comparisons and bit casts — in a fixed order, and kernels are launched with
``enable_fp_fusion=False`` so that no multiply-add is contracted into an FMA. ``tl.exp``,
``tl.erf``, ``libdevice`` and plain ``/`` (``div.full.f32``) would each round differently from
torch on the CPU, and a 1-ulp difference flips an int8 rounding now and then; libdevice also does
not run in the interpreter.

At the end, one host-side piece: ``ConvConfig``, the schedule type the implicit-GEMM conv kernel
(``conv``) and the depthwise kernel (``depthwise``) share.
"""

import os
from dataclasses import dataclass

import triton
import triton.language as tl

from qfuse import primitives
from qfuse.errors import UnsupportedError

# Whether Triton runs kernels in its interpreter (CPU tensors: tests, debugging). Read once, when
# qfuse imports this module, as ``@triton.jit`` itself reads TRITON_INTERPRET when a kernel
# module is imported: set it before importing qfuse. Every qfuse module asks this one.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Constants read inside @jit functions are tl.constexpr: compiled Triton (3.6 and later) refuses
# plain globals there, the interpreter does not — the spine's first GPU run failed to compile on
# exactly this. ``INTERPRETED_JIT`` is ``INTERPRETED`` for kernel code.
INTERPRETED_JIT = tl.constexpr(INTERPRETED)
# Adding and subtracting 1.5 * 2**23 rounds a float32 to an integer, ties to even, for |x| < 2**22.
ROUND_MAGIC = tl.constexpr(12582912.0)
FP8_E4M3_MAX = tl.constexpr(primitives.FP8_E4M3_MAX)

@dataclass(frozen=True)
class Activation:
    """One epilogue activation: ``code`` is the kernels' ``ACT`` constexpr (``activation`` /
    ``gated`` branch on it); ``gate`` names the activation a gated one applies to the gate half
    (its weight rows interleave gate and up: [g0, u0, g1, u1, ...], out[:, j] = gate(y[:, 2j]) *
    y[:, 2j + 1], N / 2 columns; every even-width column tile holds whole pairs); ``light``: costs
    about nothing in an epilogue (others get register-light schedules and the fast form on the
    GPU); ``slope``: its largest slope (Lipschitz constant), which test bounds scale by.

    Adding an activation: one row here, its branch in ``activation``, and its twin in
    ``ops.reference.ACTIVATIONS`` (tests/kernels/test_activations.py checks all three agree).
    """

    code: int
    gate: str | None = None
    light: bool = False
    slope: float = 1.0


# "gelu" is the erf form (torch.nn.GELU()), "gelu_tanh" the tanh form. GELU's slope peaks at
# 1.129 (x = 2.4), SiLU's at 1.100 (x = 2.4), hardswish's at 1.5 (x = 3).
EPILOGUE_ACTIVATIONS = {
    "none": Activation(0, light=True),
    "relu": Activation(1, light=True),
    "gelu": Activation(2, slope=1.13),
    "gelu_tanh": Activation(3, slope=1.13),
    "silu": Activation(4, slope=1.1),
    "relu6": Activation(5, light=True),
    "hardswish": Activation(6, slope=1.5),
    "swiglu": Activation(7, gate="silu"),
    "geglu": Activation(8, gate="gelu"),
    "geglu_tanh": Activation(9, gate="gelu_tanh"),
}
# Views of the table by what callers ask.
ACTIVATION_CODES = {name: a.code for name, a in EPILOGUE_ACTIVATIONS.items()}
GATED_ACTIVATIONS = {name: a.gate for name, a in EPILOGUE_ACTIVATIONS.items() if a.gate}
LIGHT_ACTIVATIONS = tuple(name for name, a in EPILOGUE_ACTIVATIONS.items() if a.light)
# The gated activations are coded last, so kernels select them with ``ACT >= GATED_FROM``.
GATED_FROM = tl.constexpr(min(ACTIVATION_CODES[name] for name in GATED_ACTIVATIONS))
if any((code >= GATED_FROM.value) != (name in GATED_ACTIVATIONS)
       for name, code in ACTIVATION_CODES.items()):
    raise AssertionError("EPILOGUE_ACTIVATIONS: code the gated activations after the others")


def out_features(rows: int, act: str) -> int:
    """Columns a GEMM over ``rows`` weight rows writes with activation ``act``."""
    return rows // 2 if act in GATED_ACTIVATIONS else rows


@triton.jit
def tile_indices(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row-tiles share each column sweep, so W tiles stay in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def mul_rn(a, b):
    """``a * b`` rounded on its own, never contracted with a following add into an FMA.

    Kernels are launched with ``enable_fp_fusion=False``, but torch.compile launches them from
    Inductor's wrapper, which does not pass that option (torch 2.11-2.13), so a product feeding
    an add would fuse and round once instead of twice — 1 ulp, enough to flip an int8 rounding.
    An explicitly rounded ``mul.rn.f32`` is never contracted. The interpreter computes in numpy,
    which never contracts.
    """
    if INTERPRETED_JIT:
        return a * b
    else:
        out = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r",
            [a.to(tl.float32).to(tl.int32, bitcast=True),
             b.to(tl.float32).to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=True, pack=1,
        )
        return out.to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(x):
    """Round to the nearest integer, ties to even; valid for |x| < 2**22 (callers clamp first)."""
    return (x + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _asm_f32(x, OP: tl.constexpr):
    """One PTX instruction ``OP $0, $1`` on a float32, result float32 (bit casts are free)."""
    out = tl.inline_asm_elementwise(
        OP + " $0, $1;", "=r,r", [x.to(tl.float32).to(tl.int32, bitcast=True)],
        dtype=tl.int32, is_pure=True, pack=1,
    )
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _sat_s8(x, OP: tl.constexpr):
    """``cvt.<OP>.sat.s8.f32``: float32 -> int8 with the given rounding, saturated to
    [-128, 127] in the same instruction (PTX lets a 32-bit register hold the s8 result)."""
    out = tl.inline_asm_elementwise(
        "cvt." + OP + ".sat.s8.f32 $0, $1;", "=r,r", [x.to(tl.float32).to(tl.int32, bitcast=True)],
        dtype=tl.int32, is_pure=True, pack=1,
    )
    return out.to(tl.int8)


@triton.jit
def quantize_int8(x, inv_scale, zero_point, HAS_ZP: tl.constexpr = True):
    """float32 -> int8: clamp(round(x * inv_scale) + zero_point, -128, 127), ties to even.

    Compiled: ``cvt.rni.sat.s8`` rounds and saturates in one instruction; with a zero point the
    product is rounded first (``cvt.rni.f32.f32``), the integer zero point added (exact) and the
    sum converted saturating — the reference's bits, 2-4 instructions an element where the
    clamp / magic-number form below takes 8 (it ran in every requantizing epilogue and prologue).
    ``HAS_ZP=False``: the zero point is 0 and not added.

    Interpreted (no PTX): the zero point rides in the rounding constant: ``v + MAGIC`` is the
    rounded integer plus MAGIC (|v| <= 256), and ``MAGIC - zero_point`` is exact for an integer
    zero point, so one subtraction gives ``round(v) + zero_point``."""
    v = x * inv_scale
    if INTERPRETED_JIT:
        v = tl.minimum(tl.maximum(v, -256.0), 256.0)
        v = (v + ROUND_MAGIC) - (ROUND_MAGIC - zero_point)
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        return v.to(tl.int8)
    elif HAS_ZP:
        return _sat_s8(_asm_f32(v, "cvt.rni.f32.f32") + zero_point, "rzi")
    else:
        return _sat_s8(v, "rni")


@triton.jit
def quantize_fp8(x, inv_scale, EXACT: tl.constexpr):
    """float32 -> float8 e4m3fn: clamp(x * inv_scale, -448, 448), round to nearest even.

    Clamping gives saturation (torch's own cast would turn overflow into NaN). Compiled, the
    cast is ``cvt.rn.satfinite.e4m3x2.f32``, which saturates finite values itself (and keeps
    NaN, as the reference's clamp does), so no clamp is issued. ``EXACT`` rounds with integer
    ops before the cast, for the interpreter (see ``round_to_float_grid``).
    """
    v = x * inv_scale
    if EXACT:
        v = tl.minimum(tl.maximum(v, -FP8_E4M3_MAX), FP8_E4M3_MAX)
        return fp8_from_grid(round_to_float_grid(v, 3, -6))
    elif INTERPRETED_JIT:
        return tl.minimum(tl.maximum(v, -FP8_E4M3_MAX), FP8_E4M3_MAX).to(tl.float8e4nv)
    return v.to(tl.float8e4nv)


@triton.jit
def fp8_from_grid(v):
    """e4m3fn from a float32 already on the e4m3 grid within +-448, by integer ops alone.

    The interpreter's own cast loses the sign of zero besides rounding wrongly (triton #8322).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    normal = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)  # rebias 127 -> 7
    subnormal = (a * 512.0).to(tl.int32)  # below 2**-6: multiples of 2**-9
    code = tl.where(a < 0.015625, subnormal, normal) | sign
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def exp_f32(x):
    """exp(x) from IEEE ops: x = n*ln2 + r, |r| <= ln2/2, degree-7 Taylor of e^r, times 2**n.

    Relative error under 2e-7 on [-87, 88]; inputs are clamped to that range (enough for every
    activation here: their results saturate far earlier).
    """
    x = tl.minimum(tl.maximum(x, -87.0), 88.0)
    n = round_half_even(mul_rn(x, x * 0.0 + 1.4426950408889634))
    # Cody-Waite: ln2 = 0.693359375 - 2.12194440e-4; the first product is exact for |n| < 2**15.
    r = x - mul_rn(n, n * 0.0 + 0.693359375)
    r = r + mul_rn(n, n * 0.0 + 2.12194440e-4)
    p = r * 0.0 + 1.9841269841269841e-4
    p = mul_rn(p, r) + 1.3888888888888889e-3
    p = mul_rn(p, r) + 8.3333333333333333e-3
    p = mul_rn(p, r) + 4.1666666666666667e-2
    p = mul_rn(p, r) + 1.6666666666666667e-1
    p = mul_rn(p, r) + 0.5
    p = mul_rn(p, r) + 1.0
    p = mul_rn(p, r) + 1.0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return mul_rn(p, two_n)


@triton.jit
def gelu_erf(x):
    """0.5 * x * (1 + erf(x / sqrt 2)), erfc by Abramowitz & Stegun 7.1.26 (abs. error 1.5e-7).

    The erfc form keeps relative accuracy in the negative tail, where 1 + erf cancels.
    """
    z = x * 0.7071067811865476
    az = tl.abs(z)
    t = tl.math.div_rn(az * 0.0 + 1.0, 1.0 + mul_rn(az, az * 0.0 + 0.3275911))
    poly = t * 0.0 + 1.061405429
    poly = mul_rn(poly, t) + -1.453152027
    poly = mul_rn(poly, t) + 1.421413741
    poly = mul_rn(poly, t) + -0.284496736
    poly = mul_rn(poly, t) + 0.254829592
    erfc = mul_rn(mul_rn(poly, t), exp_f32(-(az * az)))
    one_plus_erf = tl.where(z < 0.0, erfc, 2.0 - erfc)
    return mul_rn(0.5 * x, one_plus_erf)


@triton.jit
def rcp_approx(x):
    """1 / x by the special-function unit alone (``rcp.approx.ftz``, ~1 ulp; ``1.0 / x`` is
    ``div.full.f32``, which adds range checks and a multiply)."""
    if INTERPRETED_JIT:
        return 1.0 / x
    else:
        return _asm_f32(x, "rcp.approx.ftz.f32")


@triton.jit
def exp2_approx(x):
    """2 ** x by the special-function unit alone (``ex2.approx.ftz``, ~2 ulp; ``tl.exp`` adds
    a scaling of the argument and denormal handling around it)."""
    if INTERPRETED_JIT:
        return tl.exp2(x)
    else:
        return _asm_f32(x, "ex2.approx.ftz.f32")


@triton.jit
def gelu_erf_fast(x):
    """``gelu_erf``'s formula (Abramowitz & Stegun 7.1.26, 1.5e-7 absolute error in erf) on the
    special-function unit: ~15 instructions an element against ~40 for libdevice ``erff``
    (whose two branches both run when a warp's values straddle them) or ``gelu_erf``'s IEEE
    polynomials, where the epilogue runs after the MMAs with the tensor cores idle.

        gelu(x) = x * Phi(x),  Phi(x) = q for x < 0, 1 - q otherwise,
        q = 0.5 * erfc(|x| / sqrt 2) = poly(t) * t * exp(-x^2 / 2),  t = 1 / (1 + p |x| / sqrt 2)

    with A&S's coefficients halved and p / sqrt 2 folded. Every product that meets an add is an
    explicit ``tl.fma`` or an explicitly rounded ``mul_rn``: the compiler may not contract
    anything, so Triton's launch (no FP fusion) and Inductor's (FP fusion on) compute the same
    bits."""
    t = rcp_approx(tl.fma(tl.abs(x), 0.23164188826636045, 1.0))
    poly = tl.fma(t, 0.5307027145, -0.7265760135)
    poly = tl.fma(poly, t, 0.7107068705)
    poly = tl.fma(poly, t, -0.142248368)
    poly = tl.fma(poly, t, 0.127414796)
    q = mul_rn(mul_rn(poly, t), exp2_approx(mul_rn(x, x) * -0.7213475204444817))
    return mul_rn(x, tl.where(x < 0.0, q, 1.0 - q))


@triton.jit
def sigmoid_fast(x):
    """1 / (1 + exp(-x)) on the special-function unit (two instructions and an add)."""
    return rcp_approx(1.0 + exp2_approx(x * -1.4426950408889634))


@triton.jit
def gelu_tanh(x):
    """0.5 * x * (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3)."""
    u = 0.7978845608028654 * (x + mul_rn(x * x * x, x * 0.0 + 0.044715))
    return tl.math.div_rn(x, 1.0 + exp_f32(-2.0 * u))


@triton.jit
def silu(x):
    """x * sigmoid(x)."""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x))


@triton.jit
def hardswish(x):
    """x * clamp(x + 3, 0, 6) / 6, the division correctly rounded (torch's CPU one is too)."""
    return tl.math.div_rn(x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0), 6.0 + x * 0.0)


@triton.jit
def activation(x, ACT: tl.constexpr, FAST: tl.constexpr = False):
    """The activation coded ``ACT``. ``FAST`` swaps the IEEE-exact GELU/SiLU polynomials (~40
    float ops an element, run after the MMAs) for forms on the hardware's approximate ``exp``
    and reciprocal (``gelu_erf_fast``, ``sigmoid_fast``): outputs then
    differ from the CPU reference by rounding (int8: at most one step, rarely; tested in
    tests/kernels/test_fast_epilogue.py). ReLU and identity are exact either way."""
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        if FAST:
            x = gelu_erf_fast(x)
        else:
            x = gelu_erf(x)
    elif ACT == 3:
        if FAST:
            # fma, not x + c * x^3: no contraction left to the compiler (see gelu_erf_fast)
            x = mul_rn(x, sigmoid_fast(1.5957691216057308 * tl.fma(0.044715 * (x * x), x, x)))
        else:
            x = gelu_tanh(x)
    elif ACT == 4:
        if FAST:
            x = mul_rn(x, sigmoid_fast(x))
        else:
            x = silu(x)
    elif ACT == 5:
        x = tl.minimum(tl.maximum(x, 0.0), 6.0)
    elif ACT == 6:
        x = hardswish(x)
    return x


@triton.jit
def round_to_float_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 ``x`` to the nearest (ties to even) value of a narrower float format.

    The format has ``MANT_BITS`` stored mantissa bits and smallest normal exponent ``MIN_EXP``
    (bf16: 7, -126; fp16: 10, -14; fp8 e4m3: 3, -6). The result is exactly representable, so the
    following cast is exact in any rounding mode. The Triton interpreter's casts truncate
    (triton #8322 for fp8; bf16 showed a 1-ulp difference on half of the values, measured here),
    while the GPU's ``cvt.rn`` rounds to nearest even: interpreted kernels call this first, compiled
    ones do not need to. Range limits (overflow) are the caller's: clamp before casting.
    """
    DROP: tl.constexpr = 23 - MANT_BITS
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)
    normal = (bits & ~((1 << DROP) - 1)).to(tl.float32, bitcast=True)
    # Below the smallest normal the grid spacing is fixed at 2**(MIN_EXP - MANT_BITS): adding and
    # subtracting 1.5 * 2**(MIN_EXP - MANT_BITS + 23) rounds to it, ties to even.
    # Rounded on |x| with the sign put back, so that an underflow keeps it (-0.0, as a cast does;
    # times -1, since Triton's unary minus is 0 - x, which gives +0.0).
    magic = 1.5 * 2.0 ** (MIN_EXP - MANT_BITS + 23)
    subnormal = (tl.abs(x) + magic) - magic
    subnormal = tl.where(x.to(tl.int32, bitcast=True) < 0, subnormal * -1.0, subnormal)
    return tl.where(tl.abs(x) < 2.0**MIN_EXP, subnormal, normal)


@triton.jit
def gated(y, offs_n, ACT: tl.constexpr, FAST: tl.constexpr = False):
    """A gated activation (``ACT`` 7-9, see ``GATED_ACTIVATIONS``) of a tile whose columns
    ``offs_n`` (even-aligned, contiguous) interleave gate and up values: returns
    ``act(gate) * up`` [BM, BN / 2] and its output columns ``offs_n[0::2] // 2``."""
    g, u = tl.split(tl.reshape(y, (y.shape[0], y.shape[1] // 2, 2)))
    cols, _ = tl.split(tl.reshape(offs_n, (offs_n.shape[0] // 2, 2)))
    if ACT == 7:
        g = activation(g, 4, FAST)
    elif ACT == 8:
        g = activation(g, 2, FAST)
    else:
        g = activation(g, 3, FAST)
    return mul_rn(g, u), cols // 2


@triton.jit
def dot_acc(a, b, acc, FP8_PROMOTE: tl.constexpr):
    """``acc + a @ b``, the conv and stem kernels' main-loop step; fp8 with ``FP8_PROMOTE`` > 0
    promotes to float32 every FP8_PROMOTE K-elements. Triton rejects P > the dot's K (BLOCK_K)
    for fp8 operands; int8 dots and non-sm_90 lowerings ignore it, and so does the interpreter
    (float32 sums throughout)."""
    if FP8_PROMOTE > 0:
        return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTE, out_dtype=acc.dtype)
    else:
        return tl.dot(a, b, acc, out_dtype=acc.dtype)


@triton.jit
def input_qparams(x_inv_scale_ptr, x_zp_ptr, X_QUANTIZED: tl.constexpr, HAS_X_ZP: tl.constexpr,
                  X_INV_VEC: tl.constexpr = False):
    """An input's quantization: ``(inv_scale, zero point as float, zero point as int8)``; 1 and
    0 where the input is already quantized or symmetric, and ``inv_scale`` 1 with ``X_INV_VEC``
    (one inverse scale per input channel, loaded per tile by ``quantize_tile``)."""
    x_inv_scale = 1.0
    x_zp = 0.0
    x_zp_q = 0
    if not X_QUANTIZED and not X_INV_VEC:
        x_inv_scale = tl.load(x_inv_scale_ptr)
    if HAS_X_ZP:
        x_zp_q = tl.load(x_zp_ptr).to(tl.int8)
        x_zp = tl.load(x_zp_ptr).to(tl.float32)
    return x_inv_scale, x_zp, x_zp_q


@triton.jit
def quantize_tile(a, inv_ptrs, inv_mask, inv_scale, zero_point, FP8: tl.constexpr,
                  INV_VEC: tl.constexpr, EXACT: tl.constexpr):
    """A loaded float tile ``a`` quantized to fp8 or int8 (with ``zero_point``), the prologue of
    every kernel that quantizes its input: by the scalar ``inv_scale``, or (``INV_VEC``: one per
    input channel, SmoothQuant's prologue vector) by those at ``inv_ptrs`` (a row of the
    tile's columns, ``inv_mask`` where they exist)."""
    inv = inv_scale
    if INV_VEC:
        inv = tl.load(inv_ptrs, mask=inv_mask, other=0.0)[None, :]
    if FP8:
        return quantize_fp8(a.to(tl.float32), inv, EXACT)
    else:
        return quantize_int8(a.to(tl.float32), inv, zero_point)


@triton.jit
def load_quantized(ptrs, mask, x_inv_scale, x_zp, x_zp_q, FP8: tl.constexpr,
                   X_QUANTIZED: tl.constexpr, HAS_X_ZP: tl.constexpr, EXACT: tl.constexpr):
    """An input tile as int8/fp8 (the conv kernels' A tiles): read as it is, or quantized when
    float; masked (padding) entries are the quantized zero, the zero point."""
    if X_QUANTIZED:
        a = tl.load(ptrs, mask=mask, other=0.0)
        if HAS_X_ZP:
            a = tl.where(mask, a, x_zp_q)
    else:  # quantize(0.0) is the zero point: padding needs no special case
        a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            a = quantize_fp8(a, x_inv_scale, EXACT)
        else:
            a = quantize_int8(a, x_inv_scale, x_zp, HAS_X_ZP)
    return a


@triton.jit
def tile_offsets(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Output tile ``pid`` in grouped order (``tile_indices``): its row and column indices and
    its row and column block."""
    pid_m, pid_n = tile_indices(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return offs_m, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pid_m, pid_n


@triton.jit
def pixel_coords(offs_m, OH, OW):
    """``(batch, oh, ow)`` of output pixels ``offs_m`` (row-major over [N, OH, OW])."""
    ow = offs_m % OW
    oh = (offs_m // OW) % OH
    return (offs_m // OW) // OH, oh, ow


# ---- the conv kernels' schedule (conv and depthwise) ----

@dataclass(frozen=True)
class ConvConfig:
    """A schedule: tile sizes, warps and pipeline depth (``block_k`` unused by depthwise).

    ``fp8_promote``: K-elements an fp8 wgmma may sum at the tensor core's own precision before
    the partial is added to the float32 accumulator (Triton's ``max_num_imprecise_acc``). 0
    (default) is Triton's sm_90 default, in-place accumulation over the whole K: the H100
    ``test_gpu_real_shapes`` then missed a 2-step e4m3 bound near zero on every implicit-GEMM
    shape (worst 4.1e-3 absolute in y, K=576; 289 of 1.6M outputs) while |y| is O(1). 32..
    ``block_k``, a multiple of 32 (one m64nNk32 wgmma): promote that often, at the cost of one
    float32 add per accumulator element per interval (``bench/diag_conv_fp8.py`` measures both).
    DeepSeek-V3 (sec. 3.3.2) measured ~14 retained bits for Hopper fp8 MMA and promoted every
    128. Longer intervals than ``block_k`` are not expressible: each ``tl.dot`` ends with a
    promotion. Ignored by int8 and by depthwise (no dot)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    fp8_promote: int = 0

    def __post_init__(self):
        check_fp8_promote(self, max(self.block_k, 32))


def check_fp8_promote(config, limit: int) -> None:
    """A conv schedule's ``fp8_promote``: 0 or a multiple of 32 up to ``limit``."""
    p = config.fp8_promote
    if p and (p % 32 or not 32 <= p <= limit):
        raise UnsupportedError(
            f"{type(config).__name__}: fp8_promote={p}; use 0 (Triton's default) or a multiple "
            f"of 32 (one fp8 wgmma's K) up to block_k={config.block_k} (see "
            "ConvConfig.fp8_promote)."
        )


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under a programmatic dependent launch (``grid.pdl``): wait until the kernel before this
    one has finished and its writes are visible, then let the kernel after this one be
    scheduled as this one's programs finish (its own wait keeps it correct). A no-op otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
