"""On the GPU: block-by-block calibration equals calibrating the whole model there, with less
peak memory (the lead runs these on the device; they skip without CUDA)."""

import copy

import pytest
import torch

import qfuse
from qfuse.observers.base import Recorder
from qfuse.pipeline.capture import inline_grad_wrappers
from tests.calibrate.conftest import by_chain

pytestmark = pytest.mark.gpu


def _recorders(gm) -> dict:
    return {
        f"{name}.{k}": v.detach().cpu()
        for name, m in gm.named_modules()
        if isinstance(m, Recorder)
        for k, v in m.state_dict().items()
    }


def test_sequential_on_cuda_equals_whole_model_on_cuda(llama):
    prepared, batches = llama
    cuda = torch.device("cuda")
    whole = copy.deepcopy(prepared)
    # torch 2.11's export keeps Llama's rotary no_grad block as a subgraph recording the capture
    # device (calibrate_sequential inlines it too): without this the reference run fails on CUDA.
    inline_grad_wrappers(whole)
    whole = whole.to(cuda)
    with torch.no_grad():
        for b in batches:
            whole(**{k: v.to(cuda) for k, v in b.items()})
    seq = qfuse.calibrate_sequential(copy.deepcopy(prepared), batches, device=cuda)
    assert next(seq.parameters()).device.type == "cpu"  # the model never left the CPU
    got, want = _recorders(seq), _recorders(whole)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    # GPTQ ran on the GPU per block; convert (on the CPU) takes its results
    ref = {k: v.cpu() for k, v in qfuse.convert(whole).state_dict().items()}
    out = qfuse.convert(seq).state_dict()
    for key, value in ref.items():
        if key.endswith(("weight", "weight_scale", "x_scale")):
            assert torch.equal(out[key].cpu(), value), key


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="capturing meta weights needs torch >= 2.13 (the device image has 2.11: its "
           "FakeTensor refused meta weights with CPU inputs in aten.embedding)",
)
def test_shards_on_cuda_equal_the_loaded_model_on_cuda(llama, shards):
    folder, meta, batches, _ = shards
    cuda = torch.device("cuda")
    loaded = qfuse.calibrate_sequential(copy.deepcopy(llama[0]), batches, device=cuda)
    seq = qfuse.calibrate_sequential(copy.deepcopy(meta), batches, device=cuda, weights=folder)
    assert all(p.device.type == "cpu" for p in seq.parameters())  # restored for convert
    got, want = by_chain(seq), by_chain(loaded)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key].cpu(), value.cpu()), key
    ref = qfuse.convert(loaded).state_dict()
    for key, value in qfuse.convert(seq).state_dict().items():
        assert torch.equal(value, ref[key]), key
