"""SmoothQuant's and AWQ's factors folded into a producer's rows through an op linear in them
(``qfuse.algorithms.row_folds``, ``LayerPlan.row_fold``): ``down_proj``'s into the ``up_proj``
rows behind the gated product, ``o_proj``'s into the ``v_proj`` rows behind the attention (one
factor per KV head's channel, shared by its query heads). An equivalence in float, merged (one
gate/up GEMM with a SwiGLU epilogue, odd rows; one Q/K/V GEMM) or not, static and dynamic, alpha
and search, with GPTQ after it and AWQ on 4-bit weights; no fold, and no change, where the
producer stays float or the value has another reader."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qfuse
from qfuse.state import get_state
from tests.models import planned_float, sqnr_db, tiny_llama

pytest.importorskip("transformers")

DOWN = "model.layers.0.mlp.down_proj"
O_PROJ = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def llama():
    """A 2-layer tiny Llama whose down_proj inputs carry outlier channels (a few up_proj rows far
    larger than the rest, as trained SwiGLU products have)."""
    model = tiny_llama(layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[[5, 40]] *= 30.0
    return model


@pytest.fixture(scope="module")
def llama_v(llama):
    """``llama`` with outlier channels in o_proj's input too (a few v_proj rows far larger)."""
    model = copy.deepcopy(llama)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight[[3, 20]] *= 20.0  # KV heads 0 and 1 (head_dim 16)
    return model


def _ids(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 96, (batch, 16), generator=torch.Generator().manual_seed(seed))


def _prepare(model, config, merge=True, **kw):
    prepared = qfuse.prepare(model, config, (), example_kwargs={"input_ids": _ids(0)},
                             merge_siblings=merge, **kw)
    with torch.no_grad():
        for seed in (1, 2):
            prepared(input_ids=_ids(seed, batch=4))
    return prepared


def _float_output(prepared, model):
    """(float model's logits, the plan's folded float weights' logits, plan). Layers that keep a
    prologue vector (``x / s`` in the kernel) get their unsmoothed weights back: in float a
    prologue and ``W * s`` cancel, which ``planned_float`` (weights only) cannot show."""
    folded, plan = planned_float(prepared)
    for name in plan.prologue:
        chain = next(c for c in get_state(prepared).chains if c.name == name)
        owner, _, leaf = chain.weight.rpartition(".")
        w = plan.weights[name] / plan.smoothing[name][None, :]
        folded.get_submodule(owner)._parameters[leaf] = nn.Parameter(w)
    ids = _ids(9)
    with torch.no_grad():
        return model(input_ids=ids).logits, folded(input_ids=ids)[0], plan


def _cases(alpha, search):
    """merge x dynamic x (alpha, search): CI runs two that between them cover each value
    (merged static alpha, unmerged dynamic search); the other six are ``slow``."""
    out = []
    for merge in (True, False):
        for dynamic in (True, False):
            for sq, name in ((alpha, "alpha"), (search, "search")):
                core = (merge, dynamic, name) in {(True, False, "alpha"), (False, True, "search")}
                out.append(pytest.param(merge, dynamic, sq, id=f"{name}-{dynamic}-{merge}",
                                        marks=() if core else pytest.mark.slow))
    return out


def _down_names(merge: bool) -> tuple[str, str]:
    up = "model.layers.0.mlp." + ("gate_proj_up_proj" if merge else "up_proj")
    return DOWN, up


@pytest.mark.parametrize(("merge", "dynamic", "smoothquant"),
                         _cases(qfuse.SmoothQuant(0.8), qfuse.SmoothQuant(search=True)))
def test_fold_into_up_rows_is_an_equivalence_in_float(llama, merge, dynamic, smoothquant):
    config = qfuse.QConfig.int8_dynamic() if dynamic else qfuse.QConfig.int8_static()
    prepared = _prepare(llama, config, merge, smoothquant=smoothquant)
    assert DOWN in get_state(prepared).smoothed  # the default selection takes down_proj too
    ref, out, plan = _float_output(prepared, llama)
    down, up = _down_names(merge)
    if smoothquant.search and plan.searched[down][0] is None:
        pytest.fail("the search chose no smoothing for down_proj; the planted outliers should "
                    "make it smooth")
    assert plan.where_smoothed(down) == "folded into up_proj rows"
    assert down not in plan.prologue
    divided = plan.row_divisors[up]
    if merge:  # interleaved [gate, up] rows: only the odd (up) rows take the factors
        assert torch.equal(divided[0::2], torch.ones_like(divided[0::2]))
        assert torch.equal(divided[1::2], plan.smoothing[down])
    else:
        assert torch.equal(divided, plan.smoothing[down])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_converted_graph_and_model_run_the_folded_rows(llama):
    """Static int8, merged gate/up: the gate/up GEMM (SwiGLU epilogue) hands down_proj int8 at
    its smoothed scale, with no prologue vector; the model swap (``QGatedMLP``) carries the same
    rows. Both beat the unsmoothed config, and summary names the fold."""
    config = qfuse.QConfig.int8_static()
    prepared = _prepare(llama, config, smoothquant=qfuse.SmoothQuant(0.8))
    graph = qfuse.convert(prepared)
    swapped = qfuse.convert(prepared, output="model")
    rows = {r["name"]: r for r in qfuse.summary(graph).rows}
    assert rows[DOWN]["note"] == "SmoothQuant alpha=0.8 (folded into up_proj rows)"
    assert rows[DOWN]["input"] == "int8 from model.layers.0.mlp.gate_proj_up_proj"
    assert graph.get_submodule(DOWN).x_inv_scale.numel() == 1
    plain = qfuse.convert(_prepare(llama, config, smoothquant=qfuse.SmoothQuant(0.8,
                                   layers=("*q_proj*", "*gate_proj*"))))
    ids = _ids(9)
    with torch.no_grad():
        ref = llama(input_ids=ids).logits
        out, base = graph(input_ids=ids)[0], plain(input_ids=ids)[0]
        assert torch.allclose(swapped(input_ids=ids).logits, out, atol=1e-4)
    assert sqnr_db(ref, out) > sqnr_db(ref, base) + 1.0, (sqnr_db(ref, out), sqnr_db(ref, base))


@pytest.mark.parametrize("dynamic", [True, False])
def test_composes_with_gptq(llama, dynamic):
    config = qfuse.QConfig.int8_dynamic() if dynamic else qfuse.QConfig.int8_static()
    graph = qfuse.convert(_prepare(llama, config, smoothquant=qfuse.SmoothQuant(0.8),
                                   gptq=qfuse.GPTQ()))
    notes = {r["name"]: r["note"] for r in qfuse.summary(graph).rows}
    assert "folded into up_proj rows" in notes[DOWN] and "GPTQ" in notes[DOWN]
    ids = _ids(9)
    with torch.no_grad():
        ref, out = llama(input_ids=ids).logits, graph(input_ids=ids)[0]
    assert sqnr_db(ref, out) > 20.0


def test_up_kept_float_leaves_down_unsmoothed(llama):
    """No quantized up_proj to take the factors: down_proj keeps its unsmoothed weights (the
    default selection took it for the fold only; a dynamic config has no prologue either)."""
    config = qfuse.QConfig.int8_dynamic()
    prepared = _prepare(llama, config, merge=False, smoothquant=qfuse.SmoothQuant(0.8))
    # gate too: its RMSNorm fold needs every reader quantized (a dynamic config has no prologue)
    keep = {f"model.layers.0.mlp.{m}_proj": "test" for m in ("gate", "up")}
    graph = qfuse.convert(prepared, keep_float=keep)
    notes = {r["name"]: r["note"] for r in qfuse.summary(graph).rows}
    assert notes[DOWN].startswith("SmoothQuant alpha=0.8 (not smoothed: ")
    w = graph.get_submodule(DOWN)
    plain = qfuse.convert(_prepare(llama, config, merge=False), keep_float=keep)
    assert torch.equal(w.weight, plain.get_submodule(DOWN).weight)
    assert torch.equal(w.weight_scale, plain.get_submodule(DOWN).weight_scale)


class SharedProduct(nn.Module):
    """``silu(gate(x)) * up(x)`` read by ``down`` and also added to the output: scaling up's rows
    would change that second reader, so nothing folds there."""

    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        p = nn.functional.silu(self.gate(x)) * self.up(x)
        return self.down(p) + p[..., : x.shape[-1]]


def _assert_smoothed_in_prologue(model, x, layer: str) -> None:
    """``layer`` alone smoothed: its factors stay in its prologue, no producer row changes."""
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,), merge_siblings=False,
                             smoothquant=qfuse.SmoothQuant(0.5, layers=(layer,)))
    prepared(x)
    _, plan = planned_float(prepared)
    assert plan.where_smoothed(layer) == "prologue" and not plan.row_divisors


def test_a_product_with_another_reader_is_not_folded():
    torch.manual_seed(0)
    model, x = SharedProduct().eval(), torch.randn(4, 8, 16)
    _assert_smoothed_in_prologue(model, x, "down")
    with pytest.raises(qfuse.UnsupportedError, match="no layer is eligible"):
        qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,), merge_siblings=False,
                      smoothquant=qfuse.SmoothQuant(0.5))  # up/gate read x, no norm: nothing


def _assert_tied_over_query_heads(s: torch.Tensor) -> None:
    """tiny_llama: 4 query heads of 16 channels, 2 KV heads; heads 0, 1 read KV head 0."""
    heads = s.reshape(4, 16)
    assert torch.equal(heads[0], heads[1]) and torch.equal(heads[2], heads[3])
    assert not torch.equal(heads[0], heads[2])


@pytest.mark.parametrize(("merge", "dynamic", "smoothquant"),
                         _cases(qfuse.SmoothQuant(0.8, layers=("*",)),
                                qfuse.SmoothQuant(search=True)))
def test_fold_into_v_rows_is_an_equivalence_in_float(llama_v, merge, dynamic, smoothquant):
    config = qfuse.QConfig.int8_dynamic() if dynamic else qfuse.QConfig.int8_static()
    prepared = _prepare(llama_v, config, merge, smoothquant=smoothquant)
    ref, out, plan = _float_output(prepared, llama_v)
    if smoothquant.search and plan.searched[O_PROJ][0] is None:
        pytest.skip("the search chose no smoothing for o_proj")
    assert plan.where_smoothed(O_PROJ) == "folded into v_proj rows" and not plan.prologue
    s = plan.smoothing[O_PROJ]
    _assert_tied_over_query_heads(s)
    qkv = "model.layers.0.self_attn." + ("q_proj_k_proj_v_proj" if merge else "v_proj")
    divided = plan.row_divisors[qkv]
    v = divided[96:] if merge else divided  # merged: Q (64 rows), K (32), V (32)
    torch.testing.assert_close(v, s.reshape(4, 16)[[0, 2]].flatten(), rtol=0, atol=0)
    if merge:
        assert torch.equal(divided[:96], torch.ones(96))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_default_selection_leaves_o_proj_alone(llama_v):
    """As llm-compressor's SmoothQuant mappings: the default takes down_proj (up_proj's rows), not
    o_proj; naming it (or search) folds it into v_proj's rows."""
    prepared = _prepare(llama_v, qfuse.QConfig.int8_dynamic(), smoothquant=qfuse.SmoothQuant(0.8))
    assert O_PROJ not in get_state(prepared).smoothed
    graph = qfuse.convert(_prepare(llama_v, qfuse.QConfig.int8_dynamic(), gptq=qfuse.GPTQ(),
                                   smoothquant=qfuse.SmoothQuant(0.8, layers=("*",))))
    notes = {r["name"]: r["note"] for r in qfuse.summary(graph).rows}
    assert notes[O_PROJ].startswith("SmoothQuant alpha=0.8 (folded into v_proj rows)")
    ids = _ids(9)
    with torch.no_grad():
        ref, out = llama_v(input_ids=ids).logits, graph(input_ids=ids)[0]
    assert sqnr_db(ref, out) > 20.0


def test_bert_folds_o_into_value_rows_under_the_fused_attention():
    """An encoder (MHA, no GQA, merged Q/K/V): attention.output.dense's factors go into the
    value rows, and convert still fuses SDPA with its quantize (``fusion.attention_quant``)."""
    from tests.models import tiny_bert, token_batch

    model, batch = tiny_bert(1), token_batch(0)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=batch,
                             smoothquant=qfuse.SmoothQuant(0.5, layers=("*attention.output*",)))
    with torch.no_grad():
        for seed in (1, 2):
            prepared(**token_batch(seed))
    folded, plan = planned_float(prepared)
    name = "encoder.layer.0.attention.output.dense"
    assert plan.where_smoothed(name) == "folded into value rows"
    graph = qfuse.convert(prepared)
    row = next(r for r in qfuse.summary(graph).rows if r["name"] == name)
    assert row["input"].startswith("int8 from attention")
    with torch.no_grad():
        ref, out = model(**batch)[0], folded(**batch)[0]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert sqnr_db(ref, graph(**batch)[0]) > 30.0


class NonlinearValue(nn.Module):
    """Attention whose value goes through ``tanh`` before SDPA: not linear in v's rows."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape

        def split(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        v = torch.tanh(split(self.v(x)))
        a = nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), v)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


def test_a_value_not_linear_in_v_is_not_folded():
    torch.manual_seed(0)
    _assert_smoothed_in_prologue(NonlinearValue().eval(), torch.randn(2, 8, 32), "o")


@pytest.mark.parametrize("merge", [True, False])
def test_awq_folds_into_up_and_v_rows(llama_v, merge):
    """W4A16: AWQ's down_proj (o_proj) factors go into up's (v's) rows (4-bit layers have no
    prologue), the plan stays an equivalence in float, and with GPTQ after it the model converts
    and runs."""
    config = qfuse.QConfig.w4a16(32)
    prepared = _prepare(llama_v, config, merge, awq=qfuse.AWQ(clip=False))
    ref, out, plan = _float_output(prepared, llama_v)
    assert plan.awq[DOWN]["folded"] == "up_proj rows"
    assert plan.awq[DOWN]["ratio"] is not None
    assert plan.awq[O_PROJ]["folded"] == "v_proj rows"
    if plan.awq[O_PROJ]["ratio"] is not None:
        _assert_tied_over_query_heads(plan.smoothing[O_PROJ])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    graph = qfuse.convert(_prepare(llama_v, config, merge, awq=qfuse.AWQ(), gptq=qfuse.GPTQ()))
    ids = _ids(9)
    with torch.no_grad():
        assert sqnr_db(ref, graph(input_ids=ids)[0]) > 10.0


def test_sensitivity_undoes_the_fold():
    """``qfuse.sensitivity(method="local")`` compares up_proj's quantized output, whose rows the
    fold divided, with its float output: it multiplies the divisor back, so smoothing costs up
    nothing there."""
    model = tiny_llama(layers=1)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[[5, 40]] *= 30.0
    config = qfuse.QConfig.int8_dynamic()
    batches = [{"input_ids": _ids(s, batch=4)} for s in (1, 2)]
    report = {}
    for kw in ({}, {"smoothquant": qfuse.SmoothQuant(0.8)}):
        prepared = _prepare(model, config, merge=False, **kw)
        rows = qfuse.sensitivity(prepared, data=batches, method="local", quiet=True).rows
        report[bool(kw)] = {r.name: r for r in rows}
    up = "model.layers.0.mlp.up_proj"
    assert abs(report[True][up].sqnr_db - report[False][up].sqnr_db) < 1.0
