"""Whole CNNs through the user flow: prepare -> calibrate -> convert -> run -> save/load -> export.

CI (CPU, the reference kernels) covers the block types of ResNets and MobileNetV3 in models of our
own (tests/cnn_blocks.py); on the GPU the same flow runs the Triton conv kernels, and torchvision's
resnet18, resnet50 and mobilenet_v3_small (random weights) run too. torchvision cannot load with
the CPU torch wheel, so those tests skip there.
"""

from __future__ import annotations

import pytest
import torch

import qfuse
from tests.cnn_blocks import TinyMobileNet, TinyResNet, reestimate_batchnorm
from tests.models import sqnr_db

CONFIGS = [
    pytest.param(qfuse.QConfig.int8_static(), id="int8"),
    pytest.param(qfuse.QConfig.int8_static_asymmetric(), id="int8-asym"),
    pytest.param(qfuse.QConfig.fp8_static(), id="fp8"),
]


def _flow(make_model, shape, config, device, tmp_path, min_sqnr, batches=4):
    """Run the whole flow; returns the converted model and its summary rows."""
    g = torch.Generator().manual_seed(0)

    def batch():
        return torch.randn(*shape, generator=g).to(device)

    torch.manual_seed(0)  # the weights: the SQNR bound holds for these, not for any init
    model = reestimate_batchnorm(make_model().to(device), batch)
    x = batch()
    prepared = qfuse.prepare(model, config, example_inputs=(x,))
    for _ in range(batches):
        prepared(batch())
    qmodel = qfuse.convert(prepared)
    with torch.no_grad():
        ref, out = model(x), qmodel(x)
    assert sqnr_db(ref, out) > min_sqnr
    rows = qfuse.summary(qmodel).rows
    assert not [r for r in rows if r["precision"] == "float"], "a layer stayed float"

    path = tmp_path / "model.safetensors"
    qfuse.save(qmodel, path)
    loaded = qfuse.load(path, make_model().to(device), (x,))
    with torch.no_grad():
        assert torch.equal(loaded(x), out)
    program = qfuse.export_program(qmodel, (x,), tmp_path / "model.pt2")
    assert torch.equal(torch.export.load(tmp_path / "model.pt2").module()(x), out)
    assert torch.equal(program.module()(x), out)
    traced = qfuse.export_torchscript(qmodel, (x,), tmp_path / "model.ts")
    assert torch.equal(traced(x), out)
    return qmodel, rows


@pytest.mark.parametrize("config", CONFIGS)
def test_tiny_resnet(config, tmp_path, device):
    # fp8: 15.7 dB with the max-pool in float; its output, also a residual, rounded to e4m3
    # for the residual reader costs 0.8 dB (int8: 0.3 dB, 24.3 -> 24.0)
    min_sqnr = 14 if config.dtype == torch.float8_e4m3fn else 15
    qmodel, rows = _flow(TinyResNet, (2, 3, 12, 12), config, device, tmp_path, min_sqnr=min_sqnr)
    patterns = {r["name"]: r["pattern"] for r in rows}
    # Both shortcut kinds fuse the add and the ReLU after it, into the conv computed last.
    assert patterns["layer1.conv2"] == "Conv2d→residual→ReLU"
    assert patterns["layer2.downsample.0"] == "Conv2d→residual→ReLU"
    assert patterns["layer3.downsample.0"] == "Conv2d→residual→ReLU"
    assert patterns["layer3.conv3"] == "Conv2d"
    outputs = {r["name"]: r["output"] for r in rows}
    # The stem requantizes for its max-pool's readers; the pool runs on int8/fp8.
    assert outputs["stem.0"].endswith("layer1.conv1, layer1.conv2 (residual) through max_pool2d")


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]])
def test_tiny_mobilenet(config, tmp_path, device):
    qmodel, rows = _flow(TinyMobileNet, (2, 3, 16, 16), config, device, tmp_path, min_sqnr=12)
    patterns = {r["name"]: r["pattern"] for r in rows}
    assert patterns["stem.0"] == "Conv2d→Hardswish"
    assert patterns["blocks.1.dw.0"] == "Conv2d→Hardswish"
    assert patterns["blocks.2.dw.0"] == "Conv2d→ReLU6"
    assert patterns["blocks.2.project.0"] == "Conv2d→residual"
    # A block output read by the next block as input and as residual goes int8/fp8 to both.
    outputs = {r["name"]: r["output"] for r in rows}
    assert outputs["blocks.1.project.0"].endswith("blocks.2.project.0 (residual)")
    kernels = {r["name"]: r["kernel"] for r in rows}
    if device.type == "cuda":
        assert kernels["blocks.0.dw.0"] == "triton depthwise conv (cuda)"
        assert kernels["blocks.0.expand.0"] == "triton implicit-GEMM conv (cuda)"


@pytest.mark.gpu
@pytest.mark.parametrize("make", [TinyResNet, TinyMobileNet])
def test_triton_matches_reference_on_a_whole_network(make):
    """int8 end to end on the GPU (stem patch GEMM, int8 max-pool, int8 residuals, depthwise):
    Triton kernels give the reference's output bit for bit."""
    g = torch.Generator().manual_seed(0)
    model = reestimate_batchnorm(make().cuda(),
                                 lambda: torch.randn(4, 3, 16, 16, generator=g).cuda())
    x = torch.randn(4, 3, 16, 16, generator=g).cuda()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
    prepared(x)
    qmodel = qfuse.convert(prepared)
    with torch.no_grad():
        out = qmodel(x)
        with qfuse.use_backend("reference"):
            ref = qmodel(x)
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_compiled_and_graphed_match_eager():
    """``qfuse::qconv2d`` is a triton_op: torch.compile(fullgraph=True) takes the kernel into its
    graph; a CUDA-graph replay gives the same output."""
    g = torch.Generator().manual_seed(0)
    model = reestimate_batchnorm(TinyMobileNet().cuda(),
                                 lambda: torch.randn(4, 3, 16, 16, generator=g).cuda())
    x = torch.randn(4, 3, 16, 16, generator=g).cuda()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
    prepared(x)
    qmodel = qfuse.convert(prepared)
    with torch.no_grad():
        out = qmodel(x)
        compiled = torch.compile(qmodel, fullgraph=True)
        # Inductor launches user kernels without enable_fp_fusion=False and compiles the float
        # ops around them (pooling) its own way: a rounding flip here and there, not a match.
        assert sqnr_db(out, compiled(x)) > 30
        graph = torch.cuda.CUDAGraph()
        qmodel(x)
        with torch.cuda.graph(graph):
            static = qmodel(x)
        graph.replay()
        assert torch.equal(static, out)


def _torchvision():
    tv = pytest.importorskip("torchvision")
    try:
        tv.models.resnet18(weights=None)
    except Exception as exc:  # the CPU torch wheel: torchvision's C ops fail to load
        pytest.skip(f"torchvision does not load here: {exc}")
    if not torch.cuda.is_available():
        pytest.skip("torchvision models run on the GPU machine (CI covers the block types)")
    return tv


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, min_sqnr, config",
    [
        ("resnet18", 15, CONFIGS[0].values[0]),
        ("resnet18", 10, CONFIGS[2].values[0]),
        ("resnet50", 12, CONFIGS[0].values[0]),
        ("mobilenet_v3_small", 8, CONFIGS[0].values[0]),
    ],
    ids=["resnet18-int8", "resnet18-fp8", "resnet50-int8", "mobilenet_v3_small-int8"],
)
def test_torchvision(name, min_sqnr, config, tmp_path):
    tv = _torchvision()

    def make():
        torch.manual_seed(0)
        return getattr(tv.models, name)(weights=None)

    qmodel, rows = _flow(make, (2, 3, 224, 224), config, torch.device("cuda"), tmp_path,
                         min_sqnr=min_sqnr, batches=2)
    fused = [r for r in rows if r["precision"] != "float"]
    float_out = [r for r in fused if r["output"] in ("float32", "bfloat16", "float16")]
    print(f"{name}: {len(fused)} fused layers, {len(float_out)} write float")
    assert all("triton" in r["kernel"] for r in fused)
