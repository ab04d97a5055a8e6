"""One prepared 2-layer Llama for the calibration tests (capture dominates their time), and its
checkpoint in safetensors shards with a twin prepared on ``meta``."""

import copy

import pytest
import torch

import qfuse
from qfuse.calibrate import init_empty_weights
from qfuse.state import get_state
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


@pytest.fixture(scope="session")
def shards(llama, tmp_path_factory):
    """(the checkpoint folder, a meta twin prepared from the same config, batches, the fully
    loaded model calibrated sequentially)."""
    prepared, batches = llama
    model = get_state(prepared).source.model
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="200KB")
    with init_empty_weights():
        twin = type(model)(model.config).eval()
    meta = qfuse.prepare(
        twin,
        qfuse.QConfig.int8_static(),
        (),
        example_kwargs=batches[0],
        gptq=qfuse.GPTQ(),
        layer_configs=LAYER_CONFIGS,
    )
    loaded = qfuse.calibrate_sequential(copy.deepcopy(prepared), batches, device="cpu")
    return folder, meta, batches, loaded


def by_chain(gm) -> dict:
    """Every recorder's state and GPTQ result, by layer name (the node names of a graph
    captured on meta differ from a loaded one's)."""
    state = get_state(gm)
    out = {}
    for chain in state.chains:
        recorders = {"input": state.observers[chain.input], "hessian": state.hessians[chain.name]}
        for kind, target in recorders.items():
            for key, value in gm.get_submodule(target).state_dict().items():
                out[f"{chain.name}.{kind}.{key}"] = value
        for (name, _, _), hit in gm.get_submodule(recorders["hessian"]).solved.items():
            if name == chain.name:
                out[f"{chain.name}.gptq.codes"] = hit.codes
                out[f"{chain.name}.gptq.scale"] = hit.scale
    return out
