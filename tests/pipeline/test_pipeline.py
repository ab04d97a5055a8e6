"""One pipeline: options validated and versioned, the same passes in prepare, convert, save and
load, and load replaying exactly the options and rewrites the file records."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import qfuse
from qfuse.errors import FormatError, QFuseError, UnsupportedError
from qfuse.ops.layernorm import layer_norm_quant_call
from qfuse.ops.pool import max_pool2d_call
from qfuse.pipeline import CAPTURE, PASSES, GraphPass, PipelineOptions, register
from qfuse.state import get_state
from tests.fusion.test_pool_quant import StemPool
from tests.fusion.test_pool_quant import _convert as _pool_prepared
from tests.models import LNBlock

X = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))


def _ln_prepared(**kw):
    torch.manual_seed(0)
    model = LNBlock().eval()
    p = qfuse.prepare(model, qfuse.QConfig.int8_static(), (X,), **kw)
    p(X)
    return model, p


def _graph(gm) -> list[tuple[str, str]]:
    """What the graph computes, node by node (names aside)."""
    return [(n.op, str(n.target)) for n in gm.graph.nodes if n.op in ("call_function",
                                                                       "call_module")]


def _metadata(path) -> dict:
    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["qfuse"])


def _rewrite_metadata(path, edit) -> None:
    """Re-save the file with ``edit(meta)`` applied (tensors and checksums untouched)."""
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["qfuse"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(meta)
    save_file(tensors, path, metadata={"qfuse": json.dumps(meta)})


def test_options_round_trip_and_refuse_what_they_cannot_mean():
    opts = PipelineOptions(merge_gated=False, fuse_pools=False)
    assert PipelineOptions.from_dict(opts.to_dict()) == opts
    assert PipelineOptions.from_dict({"version": 1}) == PipelineOptions()
    with pytest.raises(UnsupportedError, match="newer"):
        PipelineOptions.from_dict({**opts.to_dict(), "version": 99})
    with pytest.raises(UnsupportedError, match=r"no options \['fuse_everything'\]"):
        PipelineOptions.from_dict({"version": 1, "fuse_everything": True})
    with pytest.raises(UnsupportedError, match="fuse_norms=1"):
        PipelineOptions(fuse_norms=1)
    with pytest.raises(Exception, match="cannot assign"):
        opts.fuse_norms = True  # frozen


def test_merge_siblings_and_pipeline_must_agree():
    with pytest.raises(UnsupportedError, match="contradicts"):
        qfuse.prepare(LNBlock().eval(), qfuse.QConfig.int8_static(), (X,), merge_siblings=False,
                      pipeline=PipelineOptions())
    with pytest.raises(UnsupportedError, match="PipelineOptions"):
        qfuse.prepare(LNBlock().eval(), qfuse.QConfig.int8_static(), (X,), pipeline={})


def test_prepare_options_reach_convert_and_convert_arguments_override():
    _, p = _ln_prepared(pipeline=PipelineOptions(fuse_norms=False))
    assert not any(n.target is layer_norm_quant_call for n in qfuse.convert(p).graph.nodes)
    fused = qfuse.convert(p, fuse_norms=True)
    assert any(n.target is layer_norm_quant_call for n in fused.graph.nodes)
    assert get_state(fused).pipeline == PipelineOptions(fuse_norms=True)
    assert get_state(fused).passes["fuse_norms"] == ["fc"]


def test_load_replays_the_saved_options_not_the_defaults(tmp_path):
    """Converted with fuse_norms=False, saved, loaded: the same graph (before, load fused the
    LayerNorm regardless)."""
    model, p = _ln_prepared()
    qmodel = qfuse.convert(p, fuse_norms=False)
    assert not any(n.target is layer_norm_quant_call for n in qmodel.graph.nodes)
    path = tmp_path / "ln.safetensors"
    qfuse.save(qmodel, path)
    meta = _metadata(path)
    assert meta["pipeline"] == PipelineOptions(fuse_norms=False).to_dict()
    assert "fuse_norms" not in meta["passes"]
    loaded = qfuse.load(path, LNBlock().eval(), (X,))
    assert _graph(loaded) == _graph(qmodel)
    assert get_state(loaded).pipeline == PipelineOptions(fuse_norms=False)
    with torch.no_grad():
        assert torch.equal(loaded(X), qmodel(X))
    fused = qfuse.convert(p)  # the default still fuses, and loads fused
    qfuse.save(fused, path)
    again = qfuse.load(path, LNBlock().eval(), (X,))
    assert _graph(again) == _graph(fused) != _graph(qmodel)


def test_load_replays_pool_fusion_off(tmp_path):
    prepared, x = _pool_prepared(StemPool(), qfuse.QConfig.int8_static())
    qmodel = qfuse.convert(prepared, fuse_pools=False)
    path = tmp_path / "pool.safetensors"
    qfuse.save(qmodel, path)
    fresh = StemPool().eval()
    loaded = qfuse.load(path, fresh, (x,))
    assert not any(n.target is max_pool2d_call for n in loaded.graph.nodes)
    assert _graph(loaded) == _graph(qmodel)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))


def test_a_rewrite_that_differs_on_load_names_the_pass(tmp_path):
    _, p = _ln_prepared()
    path = tmp_path / "ln.safetensors"
    qfuse.save(qfuse.convert(p), path)
    _rewrite_metadata(path, lambda meta: meta["passes"].update(fuse_norms=[]))
    with pytest.raises(FormatError, match="graph pass fuse_norms rewrote none when the model was "
                                          "saved but fc on this float model"):
        qfuse.load(path, LNBlock().eval(), (X,))


def test_a_file_without_options_loads_as_before(tmp_path):
    """Files saved before the options were recorded: norms and pools fused, as load did then."""
    _, p = _ln_prepared()
    qmodel = qfuse.convert(p)
    path = tmp_path / "old.safetensors"
    qfuse.save(qmodel, path)
    _rewrite_metadata(path, lambda meta: [meta.pop(k) for k in ("pipeline", "passes")])
    loaded = qfuse.load(path, LNBlock().eval(), (X,))
    assert _graph(loaded) == _graph(qmodel)


def test_bad_saved_options_are_a_format_error(tmp_path):
    _, p = _ln_prepared()
    path = tmp_path / "bad.safetensors"
    qfuse.save(qfuse.convert(p), path)
    _rewrite_metadata(path, lambda meta: meta["pipeline"].update(fuse_norms="yes"))
    with pytest.raises(FormatError, match="pipeline options cannot be read"):
        qfuse.load(path, LNBlock().eval(), (X,))


def test_a_registered_pass_runs_in_prepare_and_is_replayed_by_load(tmp_path):
    """A new model family adds one pass: here one that records the LayerNorms it sees."""

    def norms(ctx):
        return [n.name for n in ctx.gm.graph.nodes
                if n.target is torch.ops.aten.layer_norm.default]

    extra = register(GraphPass("count_norms", CAPTURE, apply=norms,
                               record=lambda ctx, result: result))
    try:
        model, p = _ln_prepared()
        assert get_state(p).passes["count_norms"] == ["layer_norm"]
        path = tmp_path / "ln.safetensors"
        qfuse.save(qfuse.convert(p), path)
        assert _metadata(path)["passes"]["count_norms"] == ["layer_norm"]
        qfuse.load(path, LNBlock().eval(), (X,))  # replayed and compared
        _rewrite_metadata(path, lambda meta: meta["passes"].update(count_norms=["ln_2"]))
        with pytest.raises(FormatError, match="count_norms"):
            qfuse.load(path, LNBlock().eval(), (X,))
    finally:
        PASSES.remove(extra)


def test_register_refuses_a_duplicate_or_an_unknown_option():
    with pytest.raises(QFuseError, match="already registered"):
        register(GraphPass("merge_gated", CAPTURE, apply=lambda ctx: None))
    with pytest.raises(QFuseError, match="not a PipelineOptions field"):
        register(GraphPass("x", CAPTURE, apply=lambda ctx: None, option="fuse_all"))
