"""Two gloo processes: PTQ calibration and QAT under DDP give every rank one converted model."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import qfuse
from tests.models import ConvNet, randomize_batchnorm

WORLD = 2


def _converted_tensors(qmodel) -> dict:
    """Every buffer of the fused modules (int8 weights, scales, zero points, biases)."""
    return {k: v.clone() for k, v in qmodel.state_dict().items()}


def _shard(rank: int, seed: int, shape) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(shape, generator=g) * (1 + rank) for _ in range(3)]


def _scenario(rank: int, mode: str) -> dict:
    torch.manual_seed(0)  # same float model on every rank
    model = randomize_batchnorm(ConvNet())
    x = torch.randn(4, 1, 8, 8)
    out = {}
    if mode in ("ptq", "ptq_minmax"):
        config = (
            qfuse.QConfig(observer="histogram_mse", symmetric=False)
            if mode == "ptq"
            else qfuse.QConfig.int8_static()
        )
        gptq = qfuse.GPTQ() if mode == "ptq" else None
        prepared = qfuse.prepare(model, config, (x,), gptq=gptq)
        with torch.no_grad():
            for batch in _shard(rank, 10, (4, 1, 8, 8)):
                prepared(batch)
        out["merged"] = qfuse.sync_observers(prepared)
        out["converted"] = _converted_tensors(qfuse.convert(prepared))
        return out
    qat_config = qfuse.QATConfig(learnable_scales=mode == "qat_lsq", bn_freeze_step=2)
    config = qfuse.QConfig(observer="moving_average_minmax")
    qat = qfuse.prepare_qat(model.train(), config, (x,), qat=qat_config)
    ddp = nn.parallel.DistributedDataParallel(qat)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for batch in _shard(rank, 20, (8, 1, 8, 8)):
        loss = ddp(batch).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out["converted"] = _converted_tensors(qfuse.convert(qat.eval()))
    return out


MODES = ("qat", "qat_lsq", "ptq", "ptq_minmax")


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    init = f"file://{tmp}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        results = {mode: _scenario(rank, mode) for mode in MODES}
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One two-process gloo run (process start-up dominates), every scenario in it."""
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(tmp),), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_identical(results: list[dict]) -> None:
    first = results[0]["converted"]
    scales = [k for k in first if k.endswith(("x_scale", "weight_scale", "out_scale"))]
    assert len(scales) >= 6 and any(k.endswith("weight") for k in first)
    for other in results[1:]:
        assert other["converted"].keys() == first.keys()
        for name, tensor in first.items():
            assert torch.equal(other["converted"][name], tensor), name


@pytest.mark.parametrize("mode", ["qat", "qat_lsq"])
def test_ddp_qat_ranks_convert_to_identical_scales_and_weights(ranks, mode):
    _assert_identical([r[mode] for r in ranks])


def test_ptq_calibration_under_ddp_merges_observers_and_hessians(ranks):
    assert ranks[0]["ptq"]["merged"] > 0
    _assert_identical([r["ptq"] for r in ranks])


def test_sync_observers_matches_one_process_over_all_shards(ranks):
    # MinMax merges exactly: the two-rank scales equal one observer that saw both shards.
    torch.manual_seed(0)
    model = randomize_batchnorm(ConvNet())
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(4, 1, 8, 8),))
    with torch.no_grad():
        for rank in range(WORLD):
            for batch in _shard(rank, 10, (4, 1, 8, 8)):
                prepared(batch)
    single = _converted_tensors(qfuse.convert(prepared))
    merged = ranks[0]["ptq_minmax"]["converted"]
    assert merged.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(merged[name], tensor), name
