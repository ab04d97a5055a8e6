"""Observer merge: two halves of the data merged equal one observer over all of it, in process
(``Recorder.merge``) and across two gloo ranks (``qfuse.observers.distributed.sync``)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qfuse.errors import CalibrationError, UnsupportedError
from qfuse.observers import OBSERVER_REGISTRY, make_observer
from qfuse.observers.distributed import sync
from qfuse.observers.hessian import InputHessian
from tests.observers.parity import CHANNEL_AXIS, make_batches

WORLD = 2
HISTOGRAMS = ("histogram", "histogram_mse", "histogram_entropy")
# name, kwargs: every observer kind, per tensor and (where supported) per channel.
CASES = [(name, {}) for name in sorted(OBSERVER_REGISTRY)] + [
    ("minmax", {"channel_axis": CHANNEL_AXIS}),
    ("moving_average_minmax", {"channel_axis": CHANNEL_AXIS, "averaging_constant": 0.3}),
    ("moving_average_minmax", {"averaging_constant": 0.3, "symmetric": False}),
    ("percentile", {"channel_axis": CHANNEL_AXIS, "symmetric": False, "percentile": 99.0}),
    ("hessian", {}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in CASES]


def _make(name: str, kwargs: dict):
    if name == "hessian":
        return InputHessian(layer_name="fc (input)", **kwargs)
    return make_observer(name, layer_name="fc (input)", **kwargs)


def _shard(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s batches. Every first batch holds the extremes of all the data, so that no
    histogram range ever grows and the histogram merge is exact (see ``_merge_stats``)."""
    batches = make_batches("outliers", seed=rank)
    batches[0] = batches[0].clone()
    batches[0].view(-1)[:2] = torch.tensor([-300.0, 400.0])
    return [b.transpose(1, 2) for b in batches]  # [N, L, C]: a Hessian reads the last axis


def _per_axis(kwargs: dict) -> dict:
    # the parity batches put channels on axis 1; transposed, they are the last axis
    return {**kwargs, "channel_axis": -1} if "channel_axis" in kwargs else kwargs


def _state(rec) -> dict:
    return {k: v.clone() for k, v in rec.state_dict().items()}


def _assert_same(merged: dict, single: dict, name: str) -> None:
    assert merged.keys() == single.keys()
    for key, want in single.items():
        got = merged[key]
        exact = name in ("minmax", *HISTOGRAMS) or key.startswith("num_")
        if key in ("decay", "origin_min", "origin_max"):
            continue  # bookkeeping: a rebased observer starts from its merged value
        if exact:
            assert torch.equal(got, want), key
        else:  # running means: the same sums in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)


def _one_process(name: str, kwargs: dict, shards) -> dict:
    rec = _make(name, _per_axis(kwargs))
    for shard in shards:
        for x in shard:
            rec(x)
    return _state(rec)


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=IDS)
def test_merge_in_process_equals_one_observer(name, kwargs):
    shards = [_shard(r) for r in range(WORLD)]
    parts = []
    for shard in shards:
        rec = _make(name, _per_axis(kwargs))
        for x in shard:
            rec(x)
        parts.append(rec)
    merged = parts[0].merge(parts[1])
    _assert_same(_state(merged), _one_process(name, kwargs, shards), name)


@pytest.mark.parametrize("name", HISTOGRAMS)
def test_histogram_merge_with_growing_ranges_is_within_a_bin(name):
    # Without the shared extremes each side's range grows at other moments than one
    # observer's: the histograms differ by re-binning, the chosen range by about one bin.
    shards = [make_batches("gaussian", seed=r) for r in range(WORLD)]
    one = _make(name, {})
    parts = [_make(name, {}) for _ in shards]
    for part, shard in zip(parts, shards, strict=True):
        for x in shard:
            part(x)
            one(x)
    merged = parts[0].merge(parts[1])
    assert torch.equal(merged.min_val, one.min_val) and torch.equal(merged.max_val, one.max_val)
    assert float(merged.histogram.sum()) == pytest.approx(float(one.histogram.sum()))
    bin_width = float(one.max_val - one.min_val) / one.bins
    for got, want in zip(merged.value_range(), one.value_range(), strict=True):
        assert abs(float(got) - float(want)) <= 2 * bin_width


def test_merging_an_empty_side_changes_nothing():
    full, empty = _make("percentile", {}), _make("percentile", {})
    full(torch.randn(100))
    before = _state(full)
    full.merge(empty)
    assert all(torch.equal(before[k], v) for k, v in _state(full).items())
    empty.merge(full)
    assert all(torch.equal(before[k], v) for k, v in _state(empty).items())


def test_merge_refuses_other_kinds_and_settings():
    with pytest.raises(UnsupportedError, match="fc \\(input\\): cannot merge"):
        _make("minmax", {}).merge(_make("percentile", {}))
    with pytest.raises(UnsupportedError, match="cannot merge"):
        _make("percentile", {}).merge(_make("percentile", {"percentile": 99.0}))
    a, b = _make("minmax", {"channel_axis": 0}), _make("minmax", {"channel_axis": 0})
    a(torch.randn(3, 4))
    b(torch.randn(5, 4))
    with pytest.raises(CalibrationError, match="cannot merge 5 channels into 3"):
        a.merge(b)


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    init = f"file://{tmp}/rendezvous"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        results = []
        for name, kwargs in CASES:
            rec = _make(name, _per_axis(kwargs))
            for x in _shard(rank):
                rec(x)
            sync(rec)
            results.append(_state(rec))
        # A rank without data: the other rank's statistics win on both.
        rec = _make("minmax", {})
        if rank == 1:
            rec(torch.tensor([-1.0, 3.0]))
        sync(rec)
        results.append(_state(rec))
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[list[dict]]:
    tmp = tmp_path_factory.mktemp("merge")
    # fork: the children inherit the imported modules (spawn re-imports qfuse: ~15 s each here)
    mp.start_processes(_worker, args=(str(tmp),), nprocs=WORLD, join=True, start_method="fork")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_two_gloo_ranks_equal_one_process_over_all_data(ranks, index):
    name, kwargs = CASES[index]
    single = _one_process(name, kwargs, [_shard(r) for r in range(WORLD)])
    for rank in range(WORLD):
        _assert_same(ranks[rank][index], single, name)
    for key, value in ranks[0][index].items():  # and the ranks agree bit for bit
        assert torch.equal(ranks[1][index][key], value), key


def test_a_rank_without_data_takes_the_others_statistics(ranks):
    for rank in range(WORLD):
        state = ranks[rank][-1]
        assert int(state["num_batches"]) == 1
        assert float(state["min_val"]) == -1.0 and float(state["max_val"]) == 3.0
