"""QAT recipe, as run (6 epochs, ~15 s): QAT recovers what PTQ loses on the hard configuration."""

from tests.optional import needs

needs("sklearn", "recipes")  # the digits data set

from qfuse.recipes.qat_digits import run  # noqa: E402


def test_qat_recovers_what_ptq_loses_with_per_tensor_weights_and_outliers():
    # The recipe's 6 epochs, not a reduced 2: after 2 epochs QAT was 98.67 (5 images short of
    # fp32) with 2 threads and 99.33 with 1, from the same float model: a toss-up on the budget.
    r = run(epochs=6, progress=False)
    assert abs(r["fp32"] - r["fp32_float"]) <= 0.25  # planting keeps the float function
    # measured 2026-11-25, 2 cores (AMD EPYC, AVX2): fp32 99.78, PTQ 97.11, QAT 99.56 (2 threads),
    # 98.89 (1 thread)
    assert r["ptq"] <= r["fp32"] - 1.0  # one scale per tensor cannot hold the outliers
    assert r["qat"] >= r["ptq"] + 0.4
    assert r["fp32"] - r["qat"] <= 1.0
    # the converted model is the fake-quant model (a one-code flip may move one image)
    assert abs(r["qat"] - r["qat_fake_quant"]) <= 0.25
    assert {row["precision"] for row in r["summary"].rows} == {"int8"}
