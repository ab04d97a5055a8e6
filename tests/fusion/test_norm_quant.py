"""LayerNorm + quantize fusion in convert: the same numbers as the unfused graph on the CPU,
Triton within the LayerNorm's float rounding, save/load/export round trips, and where it must
not apply."""

from __future__ import annotations

import os

import pytest
import torch

import qfuse
from qfuse.ops.layernorm import layer_norm_quant_call
from tests.models import LNBlock

X = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))


def _prepared(cfg, **kw):
    torch.manual_seed(0)
    p = qfuse.prepare(LNBlock().eval(), cfg, (X,), **kw)
    for i in range(3):
        p(torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(i + 1)))
    return p


def _ln_ops(gm):
    return [n for n in gm.graph.nodes if n.target is layer_norm_quant_call]


@pytest.mark.parametrize("cfg", ["int8_static", "int8_static_asymmetric", "fp8_static"])
def test_reference_path_equals_the_unfused_graph(cfg):
    p = _prepared(getattr(qfuse.QConfig, cfg)())
    fused, plain = qfuse.convert(p), qfuse.convert(p, fuse_norms=False)
    assert len(_ln_ops(fused)) == 1 and not _ln_ops(plain)
    assert torch.equal(fused(X), plain(X))
    row = next(r for r in qfuse.summary(fused).rows if r["name"] == "fc")
    assert row["input"].endswith("from LayerNorm (layer_norm)")


def test_triton_path_within_layernorm_rounding(device):
    p = _prepared(qfuse.QConfig.int8_static())
    fused, plain = qfuse.convert(p).to(device), qfuse.convert(p, fuse_norms=False).to(device)
    with qfuse.use_backend("triton"):
        out, ref = fused(X.to(device)), plain(X.to(device))
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("kw", [dict(config="int8_dynamic"),
                                dict(config="int8_static", smoothquant=qfuse.SmoothQuant(0.5))])
def test_not_applied_without_one_static_scale(kw):
    p = _prepared(getattr(qfuse.QConfig, kw.pop("config"))(), **kw)
    q = qfuse.convert(p)
    assert not _ln_ops(q)


def test_save_load_and_export_round_trip(tmp_path):
    p = _prepared(qfuse.QConfig.int8_static())
    q = qfuse.convert(p)
    path = os.path.join(tmp_path, "m.safetensors")
    qfuse.save(q, path)
    torch.manual_seed(0)
    loaded = qfuse.load(path, LNBlock().eval(), (X,))
    assert len(_ln_ops(loaded)) == 1 and torch.equal(loaded(X), q(X))
    prog = os.path.join(tmp_path, "m.pt2")
    qfuse.export_program(q, (X,), prog)
    assert torch.equal(torch.export.load(prog).module()(X), q(X))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_of_a_llama_fuses_and_matches_the_unfused_graph(dtype):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval().to(dtype)
    g = torch.Generator().manual_seed(0)
    ids = lambda: torch.randint(0, 128, (2, 12), generator=g)  # noqa: E731
    p = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs={"input_ids": ids()})
    for _ in range(3):
        p(input_ids=ids())
    fused, plain = qfuse.convert(p), qfuse.convert(p, fuse_norms=False)
    rows = [r for r in qfuse.summary(fused).rows if "from RMSNorm" in (r.get("input") or "")]
    assert len(rows) == 4  # q/k/v (merged) and gate/up (merged, SwiGLU) in each of 2 layers
    x = ids()
    logits = lambda m, dev="cpu": m(input_ids=x.to(dev))[0].cpu()  # noqa: E731
    assert torch.equal(logits(fused), logits(plain))
    with qfuse.use_backend("triton"):  # interpreter on CPU, the kernel on the GPU
        out = logits(fused.to(_dev()), _dev())
    torch.testing.assert_close(out, logits(plain), rtol=0.05, atol=0.05)


def _dev():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
