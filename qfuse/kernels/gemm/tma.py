"""The TMA family's main loop: x and W tiles loaded through Hopper's tensor memory accelerator
(host-side tensor descriptors); ``kernel._qlinear_kernel`` runs it under ``TMA``, one tile per
program or (``persistent``) one program per SM walking the tiles in grouped order with the loop
flattened, so the next tile's first loads are in flight while this tile's epilogue runs.

    acc[M, N] = x_q @ W_q^T                        (int8: int32 accumulate; fp8: float32)
    out       = finish_tile(acc)                   (scales, bias, act / gated, residual, requant)

Same arguments and numbers as the other families for an already quantized x (int8/fp8, handed
over by the previous layer or quantized by a separate pass: a descriptor reads memory as it is,
so there is no prologue quantization here). A descriptor load is one bulk copy issued by one
thread into swizzled shared memory, with edges past M, N and K zero-filled by the copy engine: no
address arithmetic or masks in the main loop, and the registers they took are free for the
accumulator and the epilogue. (A warp-specialized tile loop, which would overlap a heavy epilogue
with the next tile's MMAs, does not compile for this kernel on sm_90: triton 3.7.1's make_ttgir
fails, and triton 3.6 did not finish compiling it.)

What a descriptor needs, checked by ``supported``: a 16-byte aligned base, unit stride along K
and a row pitch that is a multiple of 16 bytes (K % 16 == 0 for one-byte elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qfuse.kernels.grid import pdl


@triton.jit
def tma_accumulate(acc, x_desc, w_desc, row0, col0, k_tiles, BLOCK_K: tl.constexpr):
    """``acc`` plus the tile at ``(row0, col0)``'s products over all ``k_tiles`` K tiles, x
    [M, K] and W [N, K] read through their descriptors."""
    for k in range(0, k_tiles):
        a = x_desc.load([row0, k * BLOCK_K])
        b = w_desc.load([col0, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc, out_dtype=acc.dtype)
    return acc


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether descriptors can read ``x`` [M, K] and ``weight`` [N, K] as they are."""
    K = x.shape[1]
    return all(
        t.dtype in (torch.int8, torch.float8_e4m3fn)
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        for t in (x, weight)
    ) and K % 16 == 0


def descriptors(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int,
                block_k: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    return (TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]))


def tma_args(args: dict, x: torch.Tensor, weight: torch.Tensor, cfg) -> dict:
    """``launch.gemm_args``' arguments with x and W as descriptors and the TMA flags (the
    prologue's and split-K's arguments are never read)."""
    x_desc, w_desc = descriptors(x, weight, cfg.block_m, cfg.block_n, cfg.block_k)
    return {**args, "x_ptr": x_desc, "w_ptr": w_desc, "PERSISTENT": cfg.persistent,
            "TMA": True, "DECODE": False, "WORDS": False, "EVEN_K": False, "X_WORDS": False,
            "PDL": pdl(x.device)}
