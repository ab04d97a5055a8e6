"""One prepared 2-layer Llama for the calibration tests (capture dominates their time)."""

import pytest
import torch

import qfuse
from tests.zoo_models import build

# Every observer family on some layer: MinMax by default, histogram and percentile on others.
LAYER_CONFIGS = {
    "*.mlp.down_proj": qfuse.QConfig(observer="histogram_mse", symmetric=False),
    "*.self_attn.o_proj": qfuse.QConfig(observer="percentile"),
}


@pytest.fixture(scope="session")
def llama():
    """(prepared with GPTQ, four calibration batches); never calibrate it in place."""
    torch.manual_seed(0)
    model, make, _ = build("llama")
    prepared = qfuse.prepare(
        model,
        qfuse.QConfig.int8_static(),
        (),
        example_kwargs=make(),
        gptq=qfuse.GPTQ(),
        layer_configs=LAYER_CONFIGS,
    )
    return prepared, [make(batch=2, seq=12, seed=s) for s in range(4)]
