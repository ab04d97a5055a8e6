"""``qfuse::qconv2d`` and ``qfuse::max_pool2d`` under torch.compile.

Issue #11's regression: a compiled conv model failed in Inductor's scheduler (``KeyError: 'op17'``)
on squeeze-excitation's 1x1 maps. Two causes, both tested here: the op's fake output, its Triton
body's and its reference's strides disagreed where a dimension has size 1, and Inductor lowers
``torch.empty(..., memory_format=channels_last)`` to contiguous strides (a copy in and out of
every kernel, a self-copy on 1x1 maps). ``kernels.layout`` now allocates every output one way.
CPU here; the compiled Triton kernels, reduce-overhead included, on the device machine.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qfuse
from qfuse.kernels.conv import implicit as conv_kernels
from qfuse.kernels.conv.call import ConvCall
from qfuse.kernels.layout import empty_nhwc
from qfuse.kernels.pool import max_pool2d as pool_kernel
from qfuse.nn import QConv2d
from tests.cnn_blocks import TinyMobileNet, reestimate_batchnorm

# (n, c_in, c_out, h, w, k, groups): 1x1 maps (SE), one output channel, batch 1, depthwise
DEGENERATE = [
    (4, 8, 16, 1, 1, 1, 1),
    (2, 8, 1, 5, 4, 3, 1),
    (1, 8, 16, 5, 5, 5, 1),
    (3, 16, 16, 1, 1, 3, 16),
]


def _conv_args(n, c_in, c_out, h, w, k, groups, device):
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (c_out, c_in // groups, k, k), generator=g,
                           dtype=torch.int8)
    x = torch.randn(n, c_in, h, w, generator=g).contiguous(memory_format=torch.channels_last)
    args = (x, conv_kernels.pack_weight(weight), torch.full((c_out,), 1e-3), None,
            torch.tensor(40.0), None, None, torch.tensor(20.0), None, "relu", torch.int8,
            [1, 1], [k // 2] * 2, [1, 1], groups)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("shape", DEGENERATE, ids=["1x1-map", "one-channel", "batch1",
                                                   "depthwise-1x1"])
def test_fake_kernel_and_reference_outputs_have_one_stride_set(shape, device):
    args = _conv_args(*shape, device)
    kernel = conv_kernels.qconv2d(*ConvCall.from_op_args(*args))  # the Triton body
    with qfuse.use_backend("reference"):
        reference = torch.ops.qfuse.qconv2d(*args)
        pool_ref = torch.ops.qfuse.max_pool2d(kernel, [3, 3], [1, 1], [1, 1], [1, 1], False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.qfuse.qconv2d(*args)
    expected = empty_nhwc(kernel.shape, kernel.dtype, "cpu").stride()
    assert kernel.stride() == reference.stride() == fake.stride() == expected
    assert torch.equal(kernel, reference)

    pooled = pool_kernel(kernel, [3, 3], [1, 1], [1, 1], [1, 1], False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        pool_fake = torch.ops.qfuse.max_pool2d(kernel, [3, 3], [1, 1], [1, 1], [1, 1], False)
    assert pooled.stride() == pool_ref.stride() == pool_fake.stride() == expected


class SqueezeChain(torch.nn.Module):
    """Convs only, down to a 1x1 map and on through 1x1 convs (squeeze-excitation's shapes):
    every layer hands int8/fp8 to the next, so the compiled graph is the fused kernels alone."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 5), torch.nn.ReLU(),  # 5x5 -> 1x1
            torch.nn.Conv2d(32, 8, 1), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 32, 1),
        )

    def forward(self, x):
        return self.body(x)


def _converted(model, config, x):
    prepared = qfuse.prepare(model.eval(), config, example_inputs=(x,))
    for _ in range(2):
        prepared(torch.randn_like(x))
    return qfuse.convert(prepared)


def test_one_op_node_per_conv_and_no_graph_break():
    x = torch.randn(2, 3, 16, 16)
    model = reestimate_batchnorm(TinyMobileNet(), lambda: torch.randn(4, 3, 16, 16))
    q = _converted(model, qfuse.QConfig.int8_static(), x)
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(q, backend=backend, fullgraph=True)(x)
    (gm,) = graphs
    convs = [n for n in gm.graph.nodes
             if n.op == "call_function" and n.target in (torch.ops.qfuse.qconv2d,
                                                         torch.ops.qfuse.qconv2d.default)]
    assert len(convs) == sum(isinstance(m, QConv2d) for m in q.modules())


@pytest.mark.parametrize("cfg", ["int8_static", "fp8_static"])
def test_compiled_conv_chain_equals_eager(cfg, device):
    x = torch.randn(2, 8, 5, 5)
    q = _converted(SqueezeChain(), getattr(qfuse.QConfig, cfg)(), x).to(device)
    x = x.to(device).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = q(x)
        torch._dynamo.reset()
        out = torch.compile(q, fullgraph=True)(x)
        assert torch.equal(out, ref)  # the same kernels in the same order, or the reference
        if device.type == "cuda":
            torch._dynamo.reset()
            graphed = torch.compile(q, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                out = graphed(x)
            assert torch.equal(out, ref)
