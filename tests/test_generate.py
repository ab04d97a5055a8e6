"""generate() on a converted Llama (gate/up merged into one GEMM with the SwiGLU epilogue, int8
hand-off to the down projection): greedy tokens with dynamic and static caches and under
torch.compile equal the CPU reference's (``bench/models/generate_parity.py``'s ``parity``); on
the GPU for int8 with the IEEE-exact epilogue, the bit-exact contract."""

import pytest

pytest.importorskip("transformers")

from bench.models import generate_parity  # noqa: E402
from qfuse.nn.gated_mlp import QGatedMLP  # noqa: E402


def _model(config="int8_static"):
    _, qmodel, ids = generate_parity.quantized_llama(config)
    assert sum(isinstance(m, QGatedMLP) for m in qmodel.modules()) == 2  # the gated path
    return qmodel, ids[:2]


def test_cpu_caches_and_compiled_graph_agree():
    """aot_eager: Dynamo and AOTAutograd trace the qfuse ops and the static cache in seconds;
    Inductor's own CPU compile is the slow test in test_swap.py."""
    qmodel, ids = _model()
    reference, rows = generate_parity.parity(qmodel, ids, "cpu", "aot_eager", new_tokens=5)
    assert [(r["cache"], r["mode"]) for r in rows] == [
        ("dynamic", "eager"), ("static", "eager"), ("static", "torch.compile(aot_eager)")]
    assert len(reference[0]) == ids.shape[1] + 5
    assert all(r["tokens_equal_cpu"] for r in rows), rows


@pytest.mark.gpu
def test_gpu_tokens_equal_cpu_int8():
    qmodel, ids = _model()
    generate_parity.set_exact(qmodel, True)
    _, rows = generate_parity.parity(qmodel, ids, "cuda", "inductor", new_tokens=8)
    assert {r["mode"] for r in rows} >= {"eager", "generate's auto-compile",
                                         "torch.compile(inductor)"}
    assert all(r["tokens_equal_cpu"] for r in rows), [
        (r["cache"], r["mode"], r["tokens"]) for r in rows if not r["tokens_equal_cpu"]]
