"""``qfuse.kernels.tuning``: M buckets, candidates, one autotune per bucket, the disk cache."""

from __future__ import annotations

import json
import types

import pytest
import torch

import qfuse
from qfuse.kernels import schedules, tuning
from qfuse.kernels.common import ACTIVATION_CODES, LIGHT_ACTIVATIONS
from qfuse.kernels.schedules import GemmConfig, m_bucket

SMEM = 232448  # bytes of shared memory an H100/H200 block may use


def test_buckets_are_monotone_and_cover_every_m():
    buckets = [m_bucket(m) for m in range(1, 20000)]
    assert buckets == sorted(buckets)
    assert all(b >= m for m, b in zip(range(1, 20000), buckets, strict=True) if m <= 8192)
    assert len(set(buckets)) == len(schedules.M_BUCKETS) + 1


@pytest.mark.parametrize("kind", ["int8-xf", "int8-xq", "fp8-xf", "fp8-xq"])
@pytest.mark.parametrize("M", [1, 16, 64, 128, 512, 16384])
@pytest.mark.parametrize(("K", "N"), [(4096, 14336), (14336, 4096), (1024, 4096)])
def test_candidates_fit_the_gpu(kind, M, K, N):
    cands = schedules.candidates(M, N, K, kind, sms=132)
    assert cands and len(cands) <= 16, "a small set: autotuning compiles each one"
    for c in cands:
        x_bytes = 2 if kind.endswith("xf") and not c.prequantize else 1
        stage = c.block_k * (c.block_m * x_bytes + c.block_n)
        assert stage * (c.num_stages - 1) <= SMEM, c
        assert c.split_k == 1 or -(-K // c.block_k) >= c.split_k, c


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """pick_config on a CPU machine: a named fake GPU, an empty cache dir, counted autotunes."""
    monkeypatch.setenv("QFUSE_CACHE_DIR", str(tmp_path))
    # The GPU runs set QFUSE_AUTOTUNE=0 for speed; these tests count autotunes (a test that
    # wants it off sets it itself).
    monkeypatch.delenv("QFUSE_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "_gpu_name", lambda device: "Fake GPU")
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls, colds = [], []

    def fake_autotune(run, configs, report=None, cold=False):
        calls.append(len(configs))
        colds.append(cold)
        if report is not None:
            report.append((configs[-1], 0.001))
        return configs[-1]

    monkeypatch.setattr(tuning, "autotune", fake_autotune)
    return types.SimpleNamespace(calls=calls, colds=colds, path=tmp_path / "tuning.json")


def test_one_autotune_per_bucket_then_cached_on_disk(fake_gpu):
    dev = torch.device("cpu")
    picks = {tuning.pick_config(M, 4096, 4096, "int8-xq", dev, False, run=lambda c: None)
             for M in range(17, 33)}
    assert len(fake_gpu.calls) == 1 and len(picks) == 1  # M 17..32 share the bucket 32
    stored = json.loads(fake_gpu.path.read_text())
    assert list(stored) == ["Fake GPU|int8-xq|M32|N4096|K4096"]
    tuning._memory.clear()  # a second process: reads the file, does not retune
    again = tuning.pick_config(20, 4096, 4096, "int8-xq", dev, False, run=lambda c: None)
    assert again == picks.pop() and len(fake_gpu.calls) == 1


def test_decode_buckets_are_timed_cold_and_reported(fake_gpu, monkeypatch):
    """M <= 64 streams weights (decode): autotune times with a cold L2; reports are kept when
    a benchmark asks (tuning.REPORTS)."""
    monkeypatch.setattr(tuning, "REPORTS", [])
    dev = torch.device("cpu")
    for M in (1, 64, 128):
        tuning.pick_config(M, 2048, 2048, "int8-xf", dev, False, run=lambda c: None)
    assert fake_gpu.colds == [True, True, False]
    assert [r["cold"] for r in tuning.REPORTS] == [True, True, False]
    assert tuning.REPORTS[0]["key"] == "Fake GPU|int8-xf|M1|N2048|K2048"  # M=1: its own bucket
    assert tuning.REPORTS[0]["times_ms"][0][1] == 0.001


def test_no_autotune_when_disabled(fake_gpu, monkeypatch):
    monkeypatch.setenv("QFUSE_AUTOTUNE", "0")
    cfg = tuning.pick_config(100, 4096, 4096, "fp8-xf", torch.device("cpu"), False, run=print)
    assert fake_gpu.calls == [] and cfg == schedules.candidates(100, 4096, 4096, "fp8-xf", 132)[0]


def test_shipped_table_is_used_for_its_gpu(fake_gpu, monkeypatch):
    key = "Fake GPU|int8-xq|M16|N64|K64"
    monkeypatch.setitem(tuning.TUNED, key, {"block_m": 16, "block_n": 32, "block_k": 64})
    cfg = tuning.pick_config(13, 64, 64, "int8-xq", torch.device("cpu"), False, run=print)
    assert cfg == GemmConfig(16, 32, 64) and fake_gpu.calls == []


def test_shipped_table_entries_are_valid_configs():
    from qfuse.kernels.tuned_configs import TUNED

    assert TUNED, "the H200 table ships with the package"
    for key, row in TUNED.items():
        gpu, kind, m, n, k, *epilogue = key.split("|")
        assert kind in ("int8-xf", "int8-xq", "fp8-xf", "fp8-xq")
        assert int(m[1:]) in (*schedules.M_BUCKETS, 2 * schedules.M_BUCKETS[-1])
        assert len(epilogue) <= 1 and all(
            e in ACTIVATION_CODES and e not in LIGHT_ACTIVATIONS for e in epilogue)
        assert key == tuning.cache_key(gpu, kind, int(m[1:]), int(n[1:]), int(k[1:]),
                                       *epilogue)
        cfg = GemmConfig(**row)
        assert schedules.for_epilogue(cfg, bool(epilogue)) == cfg  # runs as measured


def test_interpreter_gets_its_own_schedule():
    cfg = tuning.pick_config(5, 10, 10, "int8-xf", torch.device("cpu"), True)
    assert cfg == schedules.INTERPRETER_CONFIG


def test_heavy_epilogue_caps_the_tile(fake_gpu, monkeypatch):
    key = "Fake GPU|int8-xq|M8192|N64|K64"
    big = {"block_m": 256, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}
    monkeypatch.setitem(tuning.TUNED, key, big)
    dev = torch.device("cpu")
    light = tuning.pick_config(5000, 64, 64, "int8-xq", dev, False, run=print)
    heavy = tuning.pick_config(5000, 64, 64, "int8-xq", dev, False, run=print, heavy_epilogue=True)
    assert (light.block_m, light.block_n) == (256, 128)
    assert (heavy.block_m, heavy.block_n, heavy.num_stages) == (128, 128, 4)


@pytest.mark.parametrize("kind", ["int8-xf", "fp8-xf", "int8-xq"])
@pytest.mark.parametrize("M", [16, 800, 4096])
@pytest.mark.parametrize("tune", [True, False])
def test_every_pick_fits_shared_memory(fake_gpu, monkeypatch, kind, M, tune):
    # The untuned pick (compile, capture, QFUSE_AUTOTUNE=0) has no failed launch to skip, and
    # the autotuner must time the heavy-epilogue cap that will run, so neither may overflow.
    monkeypatch.setenv("QFUSE_AUTOTUNE", "1" if tune else "0")
    cfg = tuning.pick_config(M, 1536, 384, kind, torch.device("cpu"), False,
                             run=lambda c: None, heavy_epilogue=True, x_bytes=4)
    assert schedules.fits(cfg, kind, 4), cfg


def test_autotune_raises_when_no_schedule_launches(monkeypatch):
    def run(cfg):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(tuning.triton.testing, "do_bench", lambda fn, **kw: fn())

    report = []
    with pytest.raises(qfuse.errors.BackendError, match="no GEMM schedule could launch"):
        tuning.autotune(run, schedules.candidates(4096, 384, 384, "int8-xq", 132)[:2], report)
    assert len(report) == 2 and all("out of resources" in e for _, e in report)


def test_autotune_keeps_no_flush_buffer(monkeypatch):
    """The cold timings' 2x-L2 buffer lives for one autotune, not for the process."""
    monkeypatch.setattr(tuning, "_time_ms", lambda fn, cold=False: (
        tuning._FLUSH.setdefault(1, object()), 1.0)[1])
    cands = schedules.candidates(16, 2048, 2048, "int8-xq", 132)[:2]
    assert tuning.autotune(lambda cfg: None, cands, cold=True) == cands[0]
    assert tuning._FLUSH == {}


@pytest.mark.gpu
def test_cold_timing_reads_weights_from_memory():
    """A 32 MB weight fits the H200's L2: hot, a GEMV reads it from L2; cold (flushed before
    each call, the flushes' time subtracted) from HBM, slower and bounded by its bandwidth."""
    w = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    hot = tuning.device_time_ms(lambda: torch.nn.functional.linear(x, w))
    cold = tuning.device_time_ms(lambda: torch.nn.functional.linear(x, w), cold=True)
    assert cold > hot
    assert w.numel() * 2 / (cold * 1e-3) < 6e12  # no faster than ~HBM (4.8 TB/s on an H200)


@pytest.mark.parametrize("M", [512, 4096])
def test_heavy_epilogue_offers_one_warpgroup_tiles_at_any_size(M):
    # Above 4096x4096 weights every compute-bound candidate is capped to the same 128x128x128
    # schedule: autotune must still have the one-warpgroup tiles whose epilogues overlap.
    cands = schedules.runnable_candidates(M, 11264, 2048, "int8-xf", 132, heavy_epilogue=True)
    assert cands[0] == schedules.for_epilogue(cands[0], True)  # the untuned pick is unchanged
    assert len(cands) == len(set(cands)) >= 5
    assert any(c.num_warps == 4 and c.block_k == 64 for c in cands)
    assert all(c.block_m * c.block_n <= 128 * 128 and schedules.fits(c, "int8-xf") for c in cands)
    light = schedules.runnable_candidates(M, 11264, 2048, "int8-xf", 132, heavy_epilogue=False)
    # heavy only, in the MMA family (the TMA family has its own list, the same for both)
    assert not any(c.num_warps == 4 and c.block_k == 64 and not c.tma for c in light)
