"""The main job: digits CNN+MLP, static int8 PTQ, within 1.0 point of fp32 top-1."""

from recipes.ptq_digits import run


def test_int8_loses_at_most_one_point():
    r = run(epochs=40, seed=0)
    assert r["fp32_top1"] > 95.0
    assert r["fp32_top1"] - r["int8_top1"] <= 1.0
    patterns = {row["name"]: row["pattern"] for row in r["summary"].rows}
    assert patterns == {
        "conv1": "Conv2d→ReLU",
        "conv2": "Conv2d→ReLU",
        "fc1": "Linear→ReLU",
        "fc2": "Linear",
    }
