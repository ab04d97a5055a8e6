import copy

import pytest
import torch
from torch import nn

import qfuse
from qfuse.algorithms.smoothquant import factors
from qfuse.state import get_state
from tests.models import LNBlock, planned_float, sqnr_db


def quantize(model, x, **kw):
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,), **kw)
    with torch.no_grad():
        prepared(x)
    return qfuse.convert(prepared)


def test_smoothquant_improves_accuracy_on_outlier_channels():
    torch.manual_seed(0)
    model = LNBlock().eval()
    x = torch.randn(64, 64)
    plain = quantize(model, x)
    smooth = quantize(model, x, smoothquant=qfuse.SmoothQuant(alpha=0.5))
    with torch.no_grad():
        ref = model(x)
        gain = sqnr_db(ref, smooth(x)) - sqnr_db(ref, plain(x))
    assert gain > 6.0
    notes = {r["name"]: r["note"] for r in qfuse.summary(smooth).rows}
    assert notes["fc"] == "SmoothQuant alpha=0.5 (prologue)"
    assert notes["fc2"] == "SmoothQuant alpha=0.5 (folded into producer)"
    assert smooth.get_submodule("fc").x_inv_scale.shape == (64,)


def test_prologue_vector_runs_identically_in_triton(device):
    torch.manual_seed(1)
    model = LNBlock().eval()
    x = torch.randn(16, 64)
    qmodel = quantize(model, x, smoothquant=qfuse.SmoothQuant(alpha=0.5, layers=("fc",)))
    fc = qmodel.get_submodule("fc")  # int8 out to fc2: compared exactly
    assert fc.x_inv_scale.shape == (64,) and fc.out_dtype == torch.int8
    with torch.no_grad():
        h = model.ln(x)  # the same float input on both sides (CUDA's LayerNorm rounds its own way)
        with qfuse.use_backend("reference"):
            ref = fc(h)
        with qfuse.use_backend("triton"):  # interpreter on CPU, else the GPU
            out = copy.deepcopy(fc).to(device)(h.to(device)).cpu()
    assert torch.equal(ref, out)


def test_factors_leave_dead_channels_alone():
    act = torch.tensor([4.0, 0.0, 1.0])
    w = torch.tensor([[1.0, 2.0, 0.0], [0.25, 1.0, 0.0]])
    s = factors(act, w, alpha=0.5)
    assert s.tolist() == pytest.approx([2.0, 1.0, 1.0])


def test_alpha_out_of_range_is_rejected():
    with pytest.raises(qfuse.UnsupportedError, match="alpha"):
        qfuse.SmoothQuant(alpha=1.5)


# Llama: RMSNorm (exported as elementwise ops) feeds Q/K/V and gate/up; SmoothQuant's default
# selection finds it with the norm fusion's matcher and folds s into the norm's weight (and
# down_proj's into up_proj's rows: tests/test_fold_producers.py).
def _llama(merge_siblings: bool):
    pytest.importorskip("transformers")
    from tests.zoo_models import _tokens, llama

    torch.manual_seed(0)
    model = llama()[0].eval()
    with torch.no_grad():  # outlier channels, as trained LLMs' norms have
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[3], norm.weight[17] = 40.0, -25.0
    prepared = qfuse.prepare(
        model,
        qfuse.QConfig.int8_static(),
        (),
        example_kwargs=_tokens(),
        smoothquant=qfuse.SmoothQuant(0.5),
        merge_siblings=merge_siblings,
    )
    with torch.no_grad():
        for seed in range(1, 4):
            prepared(**_tokens(seed=seed))
    return model, prepared, _tokens(batch=4, seed=9)


@pytest.fixture(scope="module")
def llama_merged():
    return _llama(merge_siblings=True)


@pytest.fixture(scope="module")
def llama_unmerged():
    return _llama(merge_siblings=False)


def test_default_selection_on_llama_smooths_what_rmsnorm_feeds(llama_merged, llama_unmerged):
    layers = ("model.layers.0", "model.layers.1")
    merged = get_state(llama_merged[1]).smoothed
    assert merged == [
        f"{p}.{m}"
        for p in layers
        for m in ("self_attn.q_proj_k_proj_v_proj", "mlp.gate_proj_up_proj", "mlp.down_proj")
    ]
    unmerged = get_state(llama_unmerged[1]).smoothed
    each = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(unmerged) == sorted(
        f"{p}.{'self_attn' if m[0] in 'qkv' else 'mlp'}.{m}" for p in layers for m in each
    )


@pytest.mark.parametrize("merged", [True, False])
def test_folding_into_rmsnorm_is_an_equivalence_in_float(merged, llama_merged, llama_unmerged):
    model, prepared, x = llama_merged if merged else llama_unmerged
    smoothed, plan = planned_float(prepared)
    state = get_state(prepared)
    assert {plan.folded_into[n] for n in state.smoothed if "down" not in n} == {"RMSNorm weight"}
    assert {plan.folded_into[n] for n in state.smoothed if "down" in n} == {"up_proj rows"}
    assert not plan.prologue and len(plan.norm_weights) == 4  # 2 norms in each of 2 layers
    norm = model.model.layers[0].input_layernorm.weight
    folded = plan.norm_weights["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(folded, norm)  # s moved the outliers out of the norm
    if not merged:  # one s for every reader of a norm (Q, K, V), as the fold needs
        s = [plan.smoothing[f"model.layers.0.self_attn.{m}_proj"] for m in "qkv"]
        assert torch.equal(s[0], s[1]) and torch.equal(s[0], s[2])
    with torch.no_grad():
        ref, out = model(**x).logits, smoothed(**x)[0]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_int8_static_smoothquant_on_llama_converts_and_runs(llama_merged):
    model, prepared, x = llama_merged
    before = model.model.layers[0].input_layernorm.weight.clone()
    graph, swapped = qfuse.convert(prepared), qfuse.convert(prepared, output="model")
    rows = {r["name"]: r for r in qfuse.summary(graph).rows}
    for name in get_state(prepared).smoothed:
        if name.endswith("down_proj"):  # handed int8 by the gate/up GEMM, no prologue vector
            assert rows[name]["note"] == "SmoothQuant alpha=0.5 (folded into up_proj rows)"
            assert graph.get_submodule(name).x_inv_scale.numel() == 1
            continue
        assert rows[name]["note"] == "SmoothQuant alpha=0.5 (folded into RMSNorm weight)"
        assert rows[name]["input"].startswith("int8 from RMSNorm")  # the norm fusion still applies
        assert graph.get_submodule(name).x_inv_scale.numel() == 1  # no prologue vector
    folded = swapped.model.layers[0].input_layernorm.weight
    assert not torch.equal(folded, before)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, before)  # float model kept
    with torch.no_grad():
        ref, out = model(**x).logits, graph(**x)[0]
        assert torch.equal(swapped(**x).logits, out)
    assert sqnr_db(ref, out) > 15.0


def test_a_default_selection_that_matches_nothing_names_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    with pytest.raises(
        qfuse.UnsupportedError,
        match=r"an RMSNorm or directly by another Linear.*SmoothQuant\(layers=",
    ):  # the second Linear reads a ReLU: nothing to smooth, which would be a silent no-op
        qfuse.prepare(
            model.eval(), qfuse.QConfig.int8_static(), (x,), smoothquant=qfuse.SmoothQuant()
        )


def test_search_picks_per_layer_alpha_and_clip_and_beats_one_global_alpha():
    """A Linear reading a SwiGLU-like product with an outlier channel and a few huge rows (the
    attention sinks of a real LLM): one global alpha with the min/max range loses to the
    per-layer search, which the summary names."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            h = torch.nn.functional.silu(self.up(x)) * 3.0
            return self.down(h)

    model = Block().eval()
    with torch.no_grad():
        model.up.weight[5] *= 40  # an outlier channel of down's input
    batches = [torch.randn(4, 16, 32) for _ in range(4)]
    for b in batches:
        b[:, 0] *= 25  # each sequence's first row far larger (a sink)
    held = torch.randn(4, 16, 32)
    ref = model(held)

    def error(smoothquant):
        prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (batches[0],),
                                 smoothquant=smoothquant)
        with torch.no_grad():
            for b in batches:
                prepared(b)
        q = qfuse.convert(prepared)
        with torch.no_grad():
            return (q(held) - ref).norm().item() / ref.norm().item(), q

    global_err, _ = error(qfuse.SmoothQuant(0.5, layers=("down",)))
    searched_err, q = error(qfuse.SmoothQuant(search=True))
    assert searched_err < 0.7 * global_err, (searched_err, global_err)
    notes = {r["name"]: r["note"] for r in qfuse.summary(q).rows}
    assert notes["down"].startswith("SmoothQuant search: ")
    assert "activation clip" in notes["down"]
    assert not any("qfuse_samples" in n for n, _ in q.named_modules())  # removed at convert
