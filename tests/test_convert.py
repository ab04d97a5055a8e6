import pytest
import torch
from torch import nn

import qfuse
from qfuse.nn import QConv2d, QLinear
from qfuse.state import get_state
from tests.models import ConvNet, MLPBlock, randomize_batchnorm, sqnr_db


def quantize(model, x, config=None, batches=4):
    prepared = qfuse.prepare(model, config or qfuse.QConfig.int8_static(), example_inputs=(x,))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(batches):
            prepared(torch.randn(x.shape, generator=g))
    return qfuse.convert(prepared)


GUARDS = ("qfuse.ops.nonfinite", "qfuse.fusion.guards")  # run-time input checks and NaN marks


@pytest.mark.parametrize("symmetric", [True, False])
def test_mlp_block_fuses_into_two_kernels_with_int8_between(symmetric):
    torch.manual_seed(0)
    model = MLPBlock().eval()
    x = torch.randn(8, 32)
    config = qfuse.QConfig(symmetric=symmetric)
    qmodel = quantize(model, x, config)
    fused = [m for m in qmodel.modules() if isinstance(m, QLinear)]
    assert len(fused) == 2
    up, down = qmodel.get_submodule("up"), qmodel.get_submodule("down")
    assert up.activation == "gelu" and up.out_dtype == torch.int8
    assert down.input_quantized and down.out_dtype == torch.float32
    calls = [n.op for n in qmodel.graph.nodes if n.op in ("call_module", "call_function")
             and getattr(n.target, "__module__", "") not in GUARDS]
    assert calls.count("call_function") == 0  # everything is inside the two fused modules
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 30


def test_convnet_folds_bn_and_stays_accurate():
    torch.manual_seed(0)
    model = randomize_batchnorm(ConvNet())
    x = torch.randn(4, 1, 8, 8)
    qmodel = quantize(model, x)
    assert sum(isinstance(m, QConv2d) for m in qmodel.modules()) == 2
    assert not any(isinstance(m, nn.BatchNorm2d) for m in qmodel.modules())
    state = get_state(qmodel)
    assert len(state.folded_batchnorms) == 2
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 25


def test_converted_model_holds_no_float_weights():
    qmodel = quantize(MLPBlock().eval(), torch.randn(4, 32))
    float_params = [n for n, p in qmodel.named_parameters()]
    assert float_params == []
    assert qmodel.get_submodule("up").weight.dtype == torch.int8


def test_dynamic_batch_dimension():
    torch.manual_seed(0)
    model = MLPBlock().eval()
    qmodel = quantize(model, torch.randn(4, 32))
    for batch in (1, 3, 17):
        x = torch.randn(batch, 32)
        with torch.no_grad():
            assert qmodel(x).shape == (batch, 32)
            assert sqnr_db(model(x), qmodel(x)) > 25


def test_triton_equals_reference_end_to_end(device):
    torch.manual_seed(0)
    qmodel = quantize(MLPBlock().eval(), torch.randn(4, 32))
    x = torch.randn(5, 32)
    with torch.no_grad(), qfuse.use_backend("reference"):
        ref = qmodel(x)
    with torch.no_grad(), qfuse.use_backend("triton"):  # interpreter on CPU, else the GPU
        out = qmodel.to(device)(x.to(device)).cpu()
    assert torch.equal(ref, out)


def test_half_precision_cast_keeps_scales_float32():
    qmodel = quantize(MLPBlock().eval(), torch.randn(4, 32))
    qmodel = qmodel.to(torch.bfloat16)
    up = qmodel.get_submodule("up")
    assert up.scale.dtype == torch.float32 and up.weight.dtype == torch.int8


def test_a_cast_model_computes_in_its_new_dtype():
    """A converted float32 model cast to bf16 hands bf16 from layer to layer (a float output
    follows the cast, as nn.Linear's does) and back to float32 with ``.float()``."""
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(4, 32),))
    with torch.no_grad():
        prepared(torch.randn(8, 32))
    qmodel = qfuse.convert(prepared, output="model")  # the user's module, its Linears swapped
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = qmodel(x)
        half = qmodel.to(torch.bfloat16)(x.bfloat16())
        assert half.dtype == torch.bfloat16
        assert sqnr_db(ref, half.float()) > 30
        assert torch.equal(qmodel.float()(x), ref)


def test_convert_before_calibration_names_the_layer():
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))
    with pytest.raises(qfuse.CalibrationError, match=r"up \(input\).*no calibration data"):
        qfuse.convert(prepared)


def test_nan_in_calibration_data_names_the_layer():
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(qfuse.CalibrationError, match=r"up \(input\).*NaN"):
        prepared(x)


def test_all_zero_activation_range_is_an_error():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # ReLU output is always exactly 0
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 8),))
    prepared(torch.randn(4, 8))
    with pytest.raises(qfuse.CalibrationError, match=r"^2 \(input\).*exactly 0"):
        qfuse.convert(prepared)


def test_convert_twice_and_convert_of_plain_module_are_errors():
    qmodel = quantize(MLPBlock().eval(), torch.randn(4, 32))
    with pytest.raises(qfuse.QFuseError, match="already converted"):
        qfuse.convert(qmodel)
    with pytest.raises(qfuse.QFuseError, match="qfuse.prepare"):
        qfuse.convert(MLPBlock())


def test_convert_does_not_modify_prepared_model():
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))
    prepared(torch.randn(4, 32))
    graph = str(prepared.graph)
    tensors = {k: v.clone() for k, v in prepared.state_dict().items()}
    qfuse.convert(prepared)
    assert get_state(prepared).stage == "prepared"
    assert str(prepared.graph) == graph  # observers and float GEMMs still there
    after = prepared.state_dict()
    assert after.keys() == tensors.keys()
    assert all(torch.equal(after[k], v) for k, v in tensors.items())  # weights and ranges
    prepared(torch.randn(4, 32))  # still calibratable


def test_keep_float_leaves_layer_in_float_and_breaks_the_int8_handoff():
    torch.manual_seed(0)
    model = MLPBlock().eval()
    x = torch.randn(4, 32)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    qmodel = qfuse.convert(prepared, keep_float={"down": "sensitive"})
    assert qmodel.get_submodule("up").out_dtype == torch.float32  # its reader is float now
    assert not isinstance(qmodel.get_submodule("down"), QLinear)
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["down"]["precision"] == "float" and rows["down"]["note"] == "kept float: sensitive"
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 30


def test_keep_float_with_unknown_name_is_an_error():
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))
    prepared(torch.randn(2, 32))
    with pytest.raises(qfuse.QFuseError, match="not fusible chains"):
        qfuse.convert(prepared, keep_float={"nope": "x"})


def test_deepcopy_keeps_the_qfuse_state():
    import copy

    qmodel = quantize(MLPBlock().eval(), torch.randn(4, 32))
    clone = copy.deepcopy(qmodel)
    assert [r["name"] for r in qfuse.summary(clone).rows] == ["up", "down"]


def test_fp8_static_convnet_uses_fp8_convolutions():
    torch.manual_seed(0)
    model = randomize_batchnorm(ConvNet())
    x = torch.randn(4, 1, 8, 8)
    qmodel = quantize(model, x, qfuse.QConfig.fp8_static())
    convs = [m for m in qmodel.modules() if isinstance(m, QConv2d)]
    assert len(convs) == 2 and all(c.weight.dtype == torch.float8_e4m3fn for c in convs)
    assert qmodel.get_submodule("conv1").out_dtype == torch.float8_e4m3fn  # fp8 handoff
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 20


def test_layer_dtypes_mix_int8_and_fp8_layers():
    torch.manual_seed(0)
    model = MLPBlock().eval()
    x = torch.randn(8, 32)
    prepared = qfuse.prepare(model, qfuse.QConfig(symmetric=False), (x,))
    prepared(x)
    qmodel = qfuse.convert(prepared, layer_dtypes={"down": torch.float8_e4m3fn})
    up, down = qmodel.get_submodule("up"), qmodel.get_submodule("down")
    assert up.weight.dtype == torch.int8 and down.weight.dtype == torch.float8_e4m3fn
    assert up.out_dtype == torch.float32  # no int8 -> fp8 handoff
    assert down.x_zero_point is None  # fp8 is symmetric even under an affine config
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["up"]["precision"] == "int8" and rows["down"]["precision"] == "fp8_e4m3"
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 25


def test_layer_dtypes_reject_float_dtypes():
    prepared = qfuse.prepare(MLPBlock().eval(), qfuse.QConfig.int8_static(), (torch.randn(2, 32),))
    prepared(torch.randn(2, 32))
    with pytest.raises(qfuse.UnsupportedError, match="keep_float"):
        qfuse.convert(prepared, layer_dtypes={"up": torch.bfloat16})
