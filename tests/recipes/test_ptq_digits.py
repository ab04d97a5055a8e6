"""The main job: digits CNN+MLP, static PTQ: int8 within 0.5 and fp8 within 0.3 points of fp32."""

from tests.optional import needs

needs("sklearn", "recipes")  # the digits data set

from qfuse.recipes.ptq_digits import run  # noqa: E402


def test_int8_and_fp8_stay_within_the_accuracy_budget():
    r = run(epochs=40, seed=0)
    assert r["fp32_top1"] > 95.0
    assert r["fp32_top1"] - r["int8_top1"] <= 0.5
    assert r["fp32_top1"] - r["fp8_top1"] <= 0.3
    assert {row["precision"] for row in r["fp8_summary"].rows} == {"fp8_e4m3"}
    patterns = {row["name"]: row["pattern"] for row in r["summary"].rows}
    assert patterns == {
        "conv1": "Conv2d→ReLU",
        "conv2": "Conv2d→ReLU",
        "fc1": "Linear→ReLU",
        "fc2": "Linear",
    }
