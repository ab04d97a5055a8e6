"""``qfuse::qlinear`` under torch.compile: one op node per fused layer, no graph break, and the
compiled model computes what the eager one does (CPU here; CUDA, reduce-overhead included, on the
device machine)."""

from __future__ import annotations

import pytest
import torch

import qfuse
from qfuse.fusion.nonfinite import strip_marks
from tests.models import LNBlock, MLPBlock


def _converted(model, config, x):
    prepared = qfuse.prepare(model.eval(), config, (x,))
    for _ in range(3):
        prepared(torch.randn_like(x))
    return qfuse.convert(prepared)


def _graphs(fn, *args):
    """Dynamo's graphs for ``fn(*args)`` (fullgraph: a break raises)."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs


def test_one_op_node_per_fused_layer_and_no_graph_break():
    x = torch.randn(4, 8, 32)
    q = _converted(MLPBlock(), qfuse.QConfig.int8_static(), x)
    qlinear = (torch.ops.qfuse.qlinear, torch.ops.qfuse.qlinear.default)

    def qlinear_nodes(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in qlinear]

    (gm,) = _graphs(q, x)  # one graph (fullgraph), the NaN/Inf marks' small ops beside the ops
    assert len(qlinear_nodes(gm)) == 2  # up (GELU, int8 out) and down (+ residual)
    assert strip_marks(q) > 0
    (gm,) = _graphs(q, x)
    ops = qlinear_nodes(gm)
    others = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert others == ops  # without the marks nothing else was traced: the ops are the graph
    assert "gelu" in ops[0].args and torch.int8 in ops[0].args


@pytest.mark.parametrize("cfg", ["int8_static", "fp8_static", "int8_dynamic"])
def test_inductor_compiled_model_equals_eager(cfg, device):
    x = torch.randn(4, 8, 32)
    q = _converted(MLPBlock(), getattr(qfuse.QConfig, cfg)(), x).to(device)
    x = x.to(device)
    ref = q(x)
    torch._dynamo.reset()
    out = torch.compile(q, fullgraph=True)(x)
    if device.type == "cpu" or cfg != "fp8_static":
        assert torch.equal(out, ref)  # the same kernels (or reference ops) in the same order
    else:
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_compiled_layernorm_model_matches_eager_up_to_inductors_layernorm():
    # Inductor computes LayerNorm with its own reduction order: ~1e-5 apart from eager.
    x = torch.randn(4, 8, 64)
    q = _converted(LNBlock(), qfuse.QConfig.int8_static(), x)
    torch._dynamo.reset()
    out = torch.compile(q, fullgraph=True)(x)
    torch.testing.assert_close(out, q(x), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_reduce_overhead_graphs_the_fused_kernels():
    x = torch.randn(4, 8, 32)
    q = _converted(MLPBlock(), qfuse.QConfig.int8_static(), x).cuda()
    x = x.cuda()
    ref = q(x)
    torch._dynamo.reset()
    fn = torch.compile(q, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = fn(x)
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["int8_static", "int8_static_asymmetric", "fp8_static",
                                 "int8_dynamic", "fp8_dynamic"])
@pytest.mark.parametrize("M", [1, 16, 130, 700])
def test_cached_eager_launch_equals_triton_launch(cfg, M):
    x = torch.randn(M, 32)
    q = _converted(MLPBlock(), getattr(qfuse.QConfig, cfg)(), x).cuda()
    x = x.cuda()
    outs = [q(x) for _ in range(3)]  # first call builds and checks the plan, then cached
    mods = [m for m in q.modules() if isinstance(m, qfuse.nn.QLinear)]
    assert all(m.launch_mode == "cached launch" for m in mods), [m.launch_mode for m in mods]
    assert all(any(k != "plain" for k in m._launch_cache) for m in mods)
    for m in mods:
        m._launch_cache.clear()
        m._launch_cache["plain"] = "forced for the test"
    plain = q(x)
    assert all(torch.equal(o, plain) for o in outs)
