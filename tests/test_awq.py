"""AWQ (``qfuse.AWQ``): the scale and clip searches, the fold (an equivalence in float), the gain
over round-to-nearest on planted salient channels, composition with GPTQ and SmoothQuant, and
the errors for bad settings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qfuse
from qfuse import int4
from qfuse.algorithms.awq import AWQSamples, search_clip, search_scale
from tests.models import planned_float, tiny_llama

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

SALIENT = (3, 17, 40)


class Planted(nn.Module):
    """An RMSNorm read by three Linears (one shared ``s``, folded into the norm), one of which
    (``fc1``) alone feeds another (``fc2``: its ``s`` folds into ``fc1``'s rows), and a Linear
    reading a ReLU (nothing to fold into: clipped only). The norm and ``fc1`` plant a few
    channels far larger than the rest. The output is every branch side by side, so its error is
    the layers' output error AWQ minimises. Weights are heavy-tailed (Laplace), as trained ones
    are: a group's max then sits well above its typical weight, the room AWQ's scaling of salient
    columns uses (uniform init leaves none)."""

    def __init__(self, d: int = 64, h: int = 96):
        super().__init__()
        self.norm = LlamaRMSNorm(d)
        self.a, self.b, self.fc1 = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(d, h)
        self.fc2, self.c = nn.Linear(h, d), nn.Linear(d, d)
        laplace = torch.distributions.Laplace(0.0, 0.05)
        with torch.no_grad():
            for lin in (self.a, self.b, self.fc1, self.fc2, self.c):
                lin.weight.copy_(laplace.sample(lin.weight.shape))
            self.norm.weight[list(SALIENT)] = 25.0
            self.fc1.weight[list(SALIENT)] *= 25.0

    def forward(self, x):
        h = self.norm(x)
        return torch.cat([self.a(h), self.b(h), self.fc2(self.fc1(h)), self.c(torch.relu(x))],
                         dim=-1)


def _planted():
    torch.manual_seed(0)
    model = Planted().eval()
    calib = [torch.randn(4, 32, 64) for _ in range(4)]
    held = torch.randn(4, 32, 64)
    return model, calib, held


def _prepare(model, calib, config, **kw):
    prepared = qfuse.prepare(model, config, (calib[0],), merge_siblings=False, **kw)
    with torch.no_grad():
        for b in calib:
            prepared(b)
    return prepared


def _error(model, calib, held, config, **kw):
    q = qfuse.convert(_prepare(model, calib, config, **kw))
    with torch.no_grad():
        ref = model(held)
        return float((q(held) - ref).norm() / ref.norm())


def test_search_scale_favours_the_salient_channel_and_never_loses_to_rtn():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, 5] *= 30
    w = torch.randn(32, 64, generator=g)
    ratio, s, err = search_scale(x, x.abs().mean(0), w, 16, False)
    rtn = float((x @ (int4.fake_quantize_groups(w, 16, False) - w).T).pow(2).sum())
    assert ratio is not None and int(s.argmax()) == 5 and err < 0.7 * rtn
    flat = torch.randn(256, 64, generator=g)  # no salient channel: s = 1 is allowed to win
    _, _, err_flat = search_scale(flat, flat.abs().mean(0), w, 16, True)
    rtn_flat = float((flat @ (int4.fake_quantize_groups(w, 16, True) - w).T).pow(2).sum())
    assert err_flat <= rtn_flat


@pytest.mark.parametrize("symmetric", [True, False])
def test_search_clip_never_loses_to_the_full_range(symmetric):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(128, 48, generator=g), torch.randn(12, 48, generator=g)
    clipped, ratio = search_clip(x, w, 16, symmetric)
    assert ratio.shape == (12, 3) and bool((ratio <= 1).all()) and bool((ratio >= 0.5).all())

    def err(v):
        return float((x @ (int4.fake_quantize_groups(v, 16, symmetric) - w).T).pow(2).sum())

    assert err(clipped) < err(w) and bool((ratio < 1).any())


def test_samples_keep_the_mean_abs_over_every_row():
    s = AWQSamples(layer_name="fc", max_rows=3)
    x = torch.randn(2, 10, 4)
    s(x)
    torch.testing.assert_close(s.abs_mean, x.abs().reshape(-1, 4).mean(0))
    assert s.rows.shape == (3, 4)
    other = AWQSamples(layer_name="fc", max_rows=3)
    y = torch.randn(1, 5, 4)
    other(y)
    s.merge(other)
    both = torch.cat([x.reshape(-1, 4), y.reshape(-1, 4)])
    torch.testing.assert_close(s.abs_mean, both.abs().mean(0))


def test_awq_beats_round_to_nearest_on_planted_salient_channels():
    model, calib, held = _planted()
    config = qfuse.QConfig.w4a16(32)
    rtn = _error(model, calib, held, config)
    scaled = _error(model, calib, held, config, awq=qfuse.AWQ(clip=False))
    clipped = _error(model, calib, held, config, awq=qfuse.AWQ())
    assert scaled < 0.8 * rtn, (scaled, rtn)
    assert clipped < rtn, (clipped, rtn)


def test_folding_is_an_equivalence_in_float():
    model, calib, held = _planted()
    prepared = _prepare(model, calib, qfuse.QConfig.w4a16(32), awq=qfuse.AWQ(clip=False))
    folded, plan = planned_float(prepared)
    assert {plan.awq[n]["folded"] for n in ("a", "b", "fc1")} == {"RMSNorm weight"}
    assert plan.awq["fc2"]["folded"] == "producer"
    assert plan.awq["c"] == {"ratio": None, "folded": "no fold target"}  # reads a ReLU
    assert torch.equal(plan.smoothing["a"], plan.smoothing["fc1"])  # one s per shared input
    assert not torch.equal(plan.norm_weights["norm.weight"], model.norm.weight)
    with torch.no_grad():
        ref, out = model(held), folded(held)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[3], norm.weight[17] = 20.0, -12.0
    return model


def _llama_error(llama, config, **kw):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 16), generator=g)
    prepared = qfuse.prepare(llama, config, (), example_kwargs={"input_ids": ids}, **kw)
    with torch.no_grad():
        for _ in range(2 if kw else 0):  # W4A16 round-to-nearest reads no data
            prepared(input_ids=torch.randint(0, 96, (4, 16), generator=g))
        graph = qfuse.convert(prepared)
        ref, out = llama(input_ids=ids).logits, graph(input_ids=ids)[0]
    return float((out - ref).norm() / ref.norm()), graph


def test_llama_folds_into_both_norms_in_float(llama):
    ids = torch.randint(0, 96, (2, 16))
    prepared = qfuse.prepare(llama, qfuse.QConfig.w4a16(32), (), example_kwargs={"input_ids": ids},
                             awq=qfuse.AWQ(clip=False))
    with torch.no_grad():
        prepared(input_ids=torch.randint(0, 96, (4, 16)))
    folded, plan = planned_float(prepared)
    assert len(plan.norm_weights) == 4  # input and post-attention norms of 2 layers
    with torch.no_grad():
        ref, out = llama(input_ids=ids).logits, folded(input_ids=ids)[0]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_composes_with_gptq(llama):
    config = qfuse.QConfig.w4a16(32, symmetric=False)
    rtn, _ = _llama_error(llama, config)
    both, graph = _llama_error(llama, config, awq=qfuse.AWQ(), gptq=qfuse.GPTQ())
    assert both < rtn, (both, rtn)
    rows = [r for r in qfuse.summary(graph).rows if r["precision"] != "float"]
    assert len(rows) == 8 and all("GPTQ" in r["note"] for r in rows)
    assert not any("qfuse_samples" in n for n, _ in graph.named_modules())


def test_composes_with_smoothquant_and_gptq(llama):
    """W4A8 with a static input scale: SmoothQuant's factors first, AWQ's multiplied onto them
    (one RMSNorm weight holds both), the static scale of ``x / (s_sq s_awq)``, then GPTQ."""
    config = qfuse.QConfig.w4a8(32, dynamic=False)
    err, graph = _llama_error(llama, config, smoothquant=qfuse.SmoothQuant(0.5),
                              awq=qfuse.AWQ(clip=False), gptq=qfuse.GPTQ())
    assert err < 0.3, err
    notes = [r["note"] for r in qfuse.summary(graph).rows if r["precision"] != "float"]
    # per layer Q/K/V and gate/up (RMSNorm folds) and down_proj (into up_proj's rows)
    assert sum("SmoothQuant" in n for n in notes) == 6 and all("GPTQ" in n for n in notes)


@pytest.mark.parametrize("kwargs, match", [
    ({"grid": 0}, "grid=0"),
    ({"clip_grid": 2.5}, "clip_grid"),
    ({"layers": "fc*"}, r"AWQ\(layers=\('fc\*',\)\)"),
    ({"max_shrink": 1.0}, "max_shrink"),
    ({"clip": "yes"}, "clip='yes'"),
])
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(qfuse.QFuseError, match=match):
        qfuse.AWQ(**kwargs)


def test_bad_uses_name_the_fix():
    model, calib, _ = _planted()
    x = calib[0]
    with pytest.raises(qfuse.QFuseError, match=r"AWQ\(layers=...\) glob 'fcx' matches no"):
        qfuse.prepare(model, qfuse.QConfig.w4a16(32), (x,), awq=qfuse.AWQ(layers=("fcx",)))
    with pytest.raises(qfuse.QFuseError, match="4-bit group weights.*SmoothQuant"):
        qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,), awq=qfuse.AWQ())
    prepared = qfuse.prepare(model, qfuse.QConfig.w4a16(32), (x,), awq=qfuse.AWQ())
    with pytest.raises(qfuse.QFuseError, match="no calibration data reached"):
        qfuse.convert(prepared)
