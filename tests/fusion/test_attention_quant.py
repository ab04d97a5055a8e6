"""Attention + quantize fusion in convert (``fusion.attention_quant``) on a tiny BERT: the same
numbers as the unfused graph on the CPU (the op's reference path), Triton within the attention's
float rounding, save/load/export round trips, ONNX, and where it must not apply."""

from __future__ import annotations

import os

import pytest
import torch

import qfuse
from qfuse.ops.attention import INTERPRETED, attention_quant_call
from tests.models import tiny_bert, token_batch
from tests.optional import reason

transformers = pytest.importorskip("transformers")
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _bert(dtype=torch.float32):
    return tiny_bert(1, dtype)


_inputs = token_batch


def _prepared(cfg="int8_static", dtype=torch.float32, **kw):
    p = qfuse.prepare(_bert(dtype), getattr(qfuse.QConfig, cfg)(), (), example_kwargs=_inputs(),
                      **kw)
    with torch.no_grad():
        for seed in range(3):
            p(**_inputs(seed, pad=seed != 1))
    return p


def _ops(gm, target=attention_quant_call):
    return [n for n in gm.graph.nodes if n.target is target]


def _pair(dtype=torch.float32):
    """(fused, unfused) converts of one calibration."""
    p = _prepared(dtype=dtype)
    return qfuse.convert(p), qfuse.convert(p, fuse_attention=False)


@pytest.fixture(scope="module")
def converted():
    return _pair()


def _run(gm, **inputs):
    with torch.no_grad():
        return gm(**inputs)["last_hidden_state"]


def test_reference_path_equals_the_unfused_graph(converted):
    fused, plain = converted
    assert len(_ops(fused)) == 1 and not _ops(fused, SDPA)
    assert not _ops(plain) and len(_ops(plain, SDPA)) == 1
    for node in _ops(fused):  # no quantize pass left: the output layer reads int8 as it is
        (reader,) = node.users
        assert fused.get_submodule(reader.target).input_quantized
    for pad in (True, False):
        inputs = _inputs(7, pad)
        assert torch.equal(_run(fused, **inputs), _run(plain, **inputs))
    rows = {r["name"]: r for r in qfuse.summary(fused).rows}
    row = rows["encoder.layer.0.attention.output.dense"]
    assert row["input"] == "int8 from attention (scaled_dot_product_attention)"


@pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors: the gpu test below")
def test_triton_path_within_attention_rounding(converted):
    fused, plain = converted
    with qfuse.use_backend("triton"):
        out, ref = _run(fused, **_inputs(7)), _run(plain, **_inputs(7))
    assert float((out - ref).norm() / ref.norm()) < 2e-2


def test_fp8_and_dynamic_configs():
    fp8 = qfuse.convert(_prepared("fp8_static"))
    node = _ops(fp8)[0]
    assert node.args[-1] == torch.float8_e4m3fn
    assert not _ops(qfuse.convert(_prepared("int8_dynamic")))  # no static scale to write with


def test_decoder_attention_keeps_sdpa():
    """A Llama's attention (rotary q/k, a causal mask) is not this pattern: SDPA stays."""
    from tests.zoo_models import llama

    torch.manual_seed(0)
    model, tokens, _ = llama()
    p = qfuse.prepare(model.eval(), qfuse.QConfig.int8_static(), (), example_kwargs=tokens())
    with torch.no_grad():
        p(**tokens())
    q = qfuse.convert(p)
    assert not _ops(q) and len(_ops(q, SDPA)) == 2


def test_save_load_and_export_round_trip(converted, tmp_path):
    fused, _ = converted
    path = os.path.join(tmp_path, "m.safetensors")
    qfuse.save(fused, path)
    loaded = qfuse.load(path, _bert(), (), _inputs())
    inputs = _inputs(3)
    assert len(_ops(loaded)) == 1 and torch.equal(_run(loaded, **inputs), _run(fused, **inputs))
    prog = os.path.join(tmp_path, "m.pt2")
    qfuse.export_program(fused, (), prog, example_kwargs=_inputs())
    out = torch.export.load(prog).module()(**inputs)["last_hidden_state"]
    assert torch.equal(out, _run(fused, **inputs))


def test_onnx_writes_float_attention_then_quantize(converted, tmp_path):
    pytest.importorskip("onnxruntime", reason=reason("onnxruntime"))
    from tests.export.test_onnx import run_ort

    fused, _ = converted
    path = tmp_path / "bert.onnx"
    qfuse.export_onnx(fused, path, example_kwargs=_inputs())
    inputs = _inputs(5)
    (hidden,) = run_ort(path, inputs)
    ref = _run(fused, **inputs)
    assert float((hidden - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_model_within_attention_rounding(dtype):
    """On CUDA the op runs the Triton kernel: the fused model against the unfused one, eager and
    compiled (Inductor launches the kernel through ``wrap_triton``)."""
    fused, plain = (m.to("cuda") for m in _pair(dtype))
    inputs = {k: v.cuda() for k, v in _inputs(7).items()}
    out, ref = _run(fused, **inputs).float(), _run(plain, **inputs).float()
    assert float((out - ref).norm() / ref.norm()) < 2e-2
    with torch.no_grad():
        compiled = torch.compile(fused, fullgraph=True)(**inputs)["last_hidden_state"].float()
    assert float((compiled - ref).norm() / ref.norm()) < 2e-2
