"""qfuse.recipes.ptq_llm on the small trained Llama (the CI fixture), reduced: two configs.

Sanity bounds, not the README's targets (those are the full run's): the float model beats the
unigram baseline by far, int8 dynamic stays close to float, and ``generate()`` on the converted
``LlamaForCausalLM`` continues the prompts with text.
"""

import json

import pytest

pytest.importorskip("transformers")

from qfuse.calibration import llm as data  # noqa: E402
from qfuse.recipes import ptq_llm  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return ptq_llm.run(
        ["fp8 static", "int8 dynamic"],
        heldout=4,
        calibration=4,
        prompts=2,
        qat_steps=0,
        progress=False,
        bf16=False,
        model_name="toy",
    )


def test_float_model_is_trained(result):
    manifest = json.loads((data.DIR / "manifest.json").read_text())
    float_row = result["rows"][0]
    assert float_row["config"].startswith("float")
    # a trained model: well below the add-one unigram perplexity of the held-out text
    assert float_row["perplexity"] < manifest["unigram_perplexity"] / 2


def test_quantized_rows_are_sane(result):
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) >= {"fp8 static", "int8 dynamic"}
    for name in ("fp8 static", "int8 dynamic"):
        r = rows[name]
        # small changes, not zero (a quantized model that equals float quantized nothing)
        assert 0 < abs(r["perplexity_change_pct"]) < 10, r
        assert 0.85 < r["top1_agreement"] < 1.0, r
        assert 0 <= r["generation_agreement"] <= 1
        assert r["sample"].startswith(data.SAMPLE_PROMPT) and len(r["sample"]) > len(
            data.SAMPLE_PROMPT
        )


def test_unknown_config_is_refused():
    with pytest.raises(SystemExit, match="unknown configs"):
        ptq_llm.run(["int4 static"], heldout=1, prompts=0, progress=False, model_name="toy")
