"""``qfuse::qlinear``: schema and fake tensor, checks and typed errors, compile and eager paths."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qfuse.ops  # noqa: F401  (registers the op)
from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.gemm.call import GemmCall
from qfuse.ops.qlinear import qlinear_call

FP8 = torch.float8_e4m3fn


def op_args(M=3, K=16, N=8, qdtype=torch.int8, x=None, **over):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(N, K, generator=g) * 20).clamp(-127, 127).to(qdtype)
    args = dict(x=torch.randn(M, K, generator=g) if x is None else x, weight=w,
                scale=torch.full((N,), 1e-2), bias=torch.randn(N, generator=g),
                x_inv_scale=torch.tensor(30.0), x_zero_point=None, weight_sum=None,
                residual=None, out_inv_scale=None, out_zero_point=None, activation="gelu",
                out_dtype=torch.float32)
    args.update(over)
    return args


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("mode", ["static", "dynamic", "quantized_rows"])
def test_opcheck(qdtype, mode):
    args = op_args(qdtype=qdtype)
    if mode == "dynamic":
        args["x_inv_scale"] = None
    if mode == "quantized_rows":
        args.update(x=(torch.randn(3, 16) * 30).clamp(-127, 127).to(qdtype), x_inv_scale=None,
                    x_scale=torch.rand(3))
    # test_schema multiplies inputs to detect mutation, which CPU torch lacks for float8.
    utils = ("test_faketensor",) if qdtype == FP8 else ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.qfuse.qlinear.default, tuple(args.values()), test_utils=utils)


def test_leading_dims_and_per_token_scales_flatten():
    x = torch.randn(2, 5, 16)
    flat = torch.ops.qfuse.qlinear(**op_args(x=x.reshape(10, 16), x_inv_scale=None))
    out = torch.ops.qfuse.qlinear(**op_args(x=x, x_inv_scale=None))
    assert out.shape == (2, 5, 8) and torch.equal(out.reshape(10, 8), flat)


@pytest.mark.parametrize(
    ("over", "error"),
    [
        (dict(x=torch.randn(3, 15)), ShapeError),
        (dict(weight=torch.randn(8, 16)), UnsupportedError),
        (dict(x=torch.zeros(3, 16, dtype=FP8)), UnsupportedError),  # fp8 x, int8 weight
        (dict(x_inv_scale=None, x_zero_point=torch.tensor(3)), UnsupportedError),
        (dict(x=torch.randn(3, 16), x_scale=torch.ones(3)), UnsupportedError),
        (dict(out_dtype=torch.int8), UnsupportedError),
    ],
)
def test_typed_errors(over, error):
    with pytest.raises(error):
        torch.ops.qfuse.qlinear(**op_args(**over))


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("needs_op", [False, True], ids=["plain_eager", "grad"])
def test_the_op_is_skipped_only_in_plain_eager(needs_op):
    args = op_args()
    args["x"].requires_grad_(needs_op)
    with _Record() as rec:
        out = qlinear_call(*GemmCall.from_op_args(**args))
    called = torch.ops.qfuse.qlinear.default in rec.ops
    assert called == needs_op and rec.ops  # eager: the body's aten ops, straight
    assert torch.equal(out.detach(), torch.ops.qfuse.qlinear(*args.values()).detach())


def test_the_schemas_are_the_ones_saved_graphs_name():
    """The ops' flat argument lists (``call.OP_ARGS``) are the schemas exported graphs and
    TorchScript files record: argument for argument as before the call descriptions."""
    assert str(torch.ops.qfuse.qlinear.default._schema) == (
        "qfuse::qlinear(Tensor x, Tensor weight, Tensor scale, Tensor? bias, "
        "Tensor? x_inv_scale, Tensor? x_zero_point, Tensor? weight_sum, Tensor? residual, "
        "Tensor? out_inv_scale, Tensor? out_zero_point, str activation, ScalarType out_dtype, "
        "Tensor? x_scale=None, bool fast_act=False) -> Tensor")
    assert str(torch.ops.qfuse.qconv2d.default._schema) == (
        "qfuse::qconv2d(Tensor x, Tensor weight, Tensor scale, Tensor? bias, "
        "Tensor? x_inv_scale, Tensor? x_zero_point, Tensor? residual, Tensor? out_inv_scale, "
        "Tensor? out_zero_point, str activation, ScalarType out_dtype, SymInt[] stride, "
        "SymInt[] padding, SymInt[] dilation, SymInt groups, str post_activation=\"none\", "
        "Tensor? residual_scale=None, Tensor? residual_zero_point=None) -> Tensor")


def test_a_call_flattens_into_the_op_and_back():
    args = op_args(x_scale=torch.rand(3), fast_act=True, residual=torch.randn(3, 8))
    x, call, x_scale, residual = GemmCall.from_op_args(**args)
    assert call.act == "gelu" and call.fast_act and x_scale is args["x_scale"]
    flat = call.op_args(x, x_scale, residual)
    assert all(a is b for a, b in zip(flat, args.values(), strict=True))
