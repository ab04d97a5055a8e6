"""The ResNet recipe: basic blocks on digits, static PTQ: int8 within 0.5 and fp8 within 0.3
points of fp32 (issue #11; 450 test images: one image is 0.22 points, so fp8 may lose at most one
and int8 at most two), every conv fused, the residual adds fused into the conv computed last."""

from tests.optional import needs

needs("sklearn", "recipes")  # the digits data set

from qfuse.recipes.ptq_resnet import run  # noqa: E402


def test_int8_and_fp8_stay_within_the_accuracy_budget():
    r = run(epochs=6, seed=0, use_cache=False, device="cpu", batch_size=32)
    assert r["fp32_top1"] > 97.0
    assert r["fp32_top1"] - r["int8_top1"] <= 0.5
    # measured 2026-11-25, 2 cores (AMD EPYC, AVX2): fp32 99.33, int8 99.33, fp8 (GPTQ) 99.11;
    # fp8 rounded to nearest was 98.67 (3 images), which is why the recipe runs GPTQ for fp8.
    assert r["fp32_top1"] - r["fp8_top1"] <= 0.3
    patterns = {row["name"]: row["pattern"] for row in r["summary"].rows}
    assert {row["precision"] for row in r["summary"].rows} == {"int8"}
    assert patterns["layers.0.conv2"] == "Conv2d→residual→ReLU"
    assert patterns["layers.2.downsample.0"] == "Conv2d→residual→ReLU"
    assert patterns["layers.2.conv2"] == "Conv2d"
    # Blocks hand int8 to the next block's convs where those are the only readers.
    outputs = {row["name"]: row["output"] for row in r["summary"].rows}
    assert outputs["layers.1.conv2"].startswith("int8 to layers.2.conv1")
