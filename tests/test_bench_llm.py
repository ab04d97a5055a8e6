"""bench/models/bench_llm.py on a 2-layer Llama on the CPU: every row is checked, timed or an error,
and the JSON carries what the GPU run's file must (device, versions, commit, rows)."""

import json

import pytest

from bench.models import bench_llm


def test_tiny_run_writes_checked_rows(tmp_path):
    out = tmp_path / "llm.json"
    bench_llm.main(["--tiny", "--impls", "bf16,qfuse_int8,qfuse_int8_dyn", "--out", str(out)])
    data = json.loads(out.read_text())
    for key in ("device", "torch", "triton", "commit", "model", "config", "build_s", "targets",
                "autotune"):
        assert key in data
    assert data["complete"] is True
    rows = data["rows"]
    assert {(r["impl"], r["phase"], r["batch"]) for r in rows} >= {
        ("bf16", "decode", 1), ("qfuse_int8", "decode", 1), ("qfuse_int8", "prefill", 1),
        ("qfuse_int8_dyn", "decode", 1), ("qfuse_int8", "decode", 32),
    }
    for r in rows:
        assert r["mode"] == "eager" and r["seq"] == (16 if r["phase"] == "prefill" else 1)
        assert "error" not in r, r
        assert r["median_us"] > 0 and r["tokens_per_s"] > 0
        assert 0 <= r["max_rel_err"] <= 0.25 and 0 <= r["argmax_agree"] <= 1
    bf16 = next(r for r in rows if r["impl"] == "bf16" and r["phase"] == "decode")
    assert bf16["max_rel_err"] == 0 and bf16["x_bf16"] == 1.0
    assert data["weight_bytes"]["qfuse_int8"] * 2 == data["weight_bytes"]["bf16"]  # int8: half
    (vs_bf16,) = [t for t in data["targets"] if t["target"] == "decode batch 1 vs bf16 best"]
    assert vs_bf16["want"] == 1.6 and vs_bf16["met"] == (vs_bf16["x"] >= 1.6)
    q = next(r for r in rows if r["impl"] == "qfuse_int8" and r["phase"] == "decode")
    assert q["max_rel_err"] > 0  # quantized logits differ from bf16: the check looked at them
    assert abs(q["x_bf16"] - bf16["median_us"] / q["median_us"]) < 1e-2


def test_generate_rows_time_generate_as_a_user_calls_it(tmp_path):
    """generate() as a user calls it, bf16 beside qfuse int8 (every other mode: ``slow``)."""
    out = tmp_path / "llm.json"
    bench_llm.main(["--tiny", "--plan", "generate", "--impls", "bf16,qfuse_int8", "--out",
                    str(out), "--modes", "generate"])
    data = json.loads(out.read_text())
    _check_generate_rows(data)


@pytest.mark.slow
def test_every_generate_mode_writes_its_row(tmp_path):
    out = tmp_path / "llm.json"
    bench_llm.main(["--tiny", "--plan", "generate", "--impls", "bf16,qfuse_int8", "--out",
                    str(out), "--modes", "generate,generate-trees,generate-decodegraphs,"
                    "generate-decodegraphs-attn,generate-sdpa"])
    data = json.loads(out.read_text())
    assert {(r["impl"], r["mode"]) for r in data["rows"]} == {
        ("bf16", "generate"), ("qfuse_int8", "generate"), ("qfuse_int8", "generate-trees"),
        ("bf16", "generate-decodegraphs"), ("bf16", "generate-decodegraphs-attn"),
        ("qfuse_int8", "generate-sdpa")}
    # the attention each row ran: a converted model carries qfuse's, bf16 gets it only there
    attn = {(r["impl"], r["mode"]): r["attention"] for r in data["rows"]}
    assert attn[("qfuse_int8", "generate")] == attn[("bf16", "generate-decodegraphs-attn")] \
        == "qfuse"
    assert attn[("bf16", "generate")] == attn[("qfuse_int8", "generate-sdpa")] == "sdpa"
    _check_generate_rows(data)


def _check_generate_rows(data):
    rows = {r["impl"]: r for r in data["rows"] if r["mode"] == "generate"}
    assert set(rows) == {"bf16", "qfuse_int8"}
    for r in rows.values():
        assert r["phase"] == "generate" and "error" not in r, r
        # per-token time from 16 vs 80 new tokens: the longer call took longer
        assert r["wall_s_long"] > r["wall_s_short"] > 0 and r["median_us"] > 0
        assert 0 <= r["token_agree"] <= 1
    assert rows["bf16"]["token_agree"] == 1.0 and rows["bf16"]["x_bf16"] == 1.0
    (goal,) = [t for t in data["targets"] if t["target"] == "generate batch 1 vs bf16 generate"]
    assert goal["want"] == 1.35 and goal["met"] == (goal["x"] >= 1.35)


def test_unknown_impl_is_refused():
    import pytest

    with pytest.raises(SystemExit, match="unknown impls"):
        bench_llm.main(["--tiny", "--impls", "qfuse_int4"])


def test_kernel_classes():
    assert bench_llm.classify("_qlinear_kernel") == "quantized GEMM"
    assert bench_llm.classify("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm"
    assert bench_llm.classify("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "GEMM"
    assert bench_llm.classify("pytorch_flash::flash_fwd_kernel") == "attention"
    assert bench_llm.classify("triton_poi_fused_mul_silu_3") == "other"


def test_precompile_covers_the_static_impls_gemms():
    """The GPU run compiles every autotune candidate up front (in a pool, while models build):
    the gated gate/up writing int8/fp8 for down, down reading it, and the bf16-input layers, at
    each planned M bucket; dynamic impls run untuned and need none."""
    from transformers import LlamaConfig

    config = LlamaConfig(**bench_llm.SHAPES["tinyllama"])
    jobs = bench_llm.precompile_jobs(config, ["bf16", "qfuse_int8", "qfuse_fp8_dyn"],
                                     [1, 512], sms=132)
    kinds = {(v.kind, v.act, v.quantized_out) for v, _ in jobs}
    assert kinds == {("int8-xf", "none", False), ("int8-xf", "swiglu", True),
                     ("int8-xq", "none", False)}
    blocks = {dict(c)["block_m"] for _, c in jobs}
    assert 16 in blocks and max(blocks) >= 64  # decode and prefill schedules
    assert len(jobs) == len(set(jobs))


def test_gemm_positions_average_each_projection_over_layers_and_calls():
    # Two calls of a 2-layer model: the rotary embedding's matmul first, then per layer a norm,
    # Q/K/V, O, gate/up, down; then the LM head.
    layer = [("rms_norm_kernel", 1.0), ("_qlinear_decode_kernel", 4.0),
             ("_qlinear_decode_kernel", 3.0), ("_qlinear_decode_kernel", 9.0),
             ("_qlinear_mma_kernel", 6.0)]
    call = ([("cutlass_rotary_matmul", 2.0)] + layer + [(n, us + 1) for n, us in layer]
            + [("nvjet_sm90_tst_256x8", 50.0)])
    got = bench_llm.gemm_positions(call + call, calls=2, layers=2)
    assert [p["us"] for p in got["per_layer"]] == [4.5, 3.5, 9.5, 6.5]
    assert got["before_layers"] == [{"kernel": "cutlass_rotary_matmul", "us": 2.0}]
    assert got["after_layers"] == [{"kernel": "nvjet_sm90_tst_256x8", "us": 50.0}]
    assert bench_llm.gemm_positions(call[:-1] + call, calls=2, layers=2) is None  # uneven
    scrambled = call[:4] + call[5:6] + call[4:5] + call[6:]  # layer 0: gate/up and down swapped
    assert bench_llm.gemm_positions(scrambled, calls=1, layers=2) is None


def test_torchao_quantize_leaves_inductor_settings_alone():
    """torchao's quantize_ turns on coordinate-descent tuning for the whole process by default;
    the benchmarks' wrapper must not, or every later bf16/qfuse compile row changes with it."""
    pytest.importorskip("torchao", reason="torchao is in the bench extra: pip install -e .[bench]")
    import harness
    import torch
    import torch._inductor.config as ic
    from torchao.quantization import Int8WeightOnlyConfig

    before = {k: getattr(ic, k) for k in harness.TORCHAO_INDUCTOR}
    harness.torchao_quantize(torch.nn.Sequential(torch.nn.Linear(32, 16)), Int8WeightOnlyConfig())
    assert {k: getattr(ic, k) for k in harness.TORCHAO_INDUCTOR} == before
    with harness.torchao_inductor():
        assert ic.coordinate_descent_tuning and ic.coordinate_descent_check_all_directions
    assert {k: getattr(ic, k) for k in harness.TORCHAO_INDUCTOR} == before


def test_checkpoint_keeps_ratios_and_targets_of_a_run_cut_short(tmp_path):
    out = tmp_path / "partial.json"
    rows = [dict(impl="bf16", mode="graph", phase="decode", batch=1, median_us=300.0),
            dict(impl="qfuse_int8", mode="graph", phase="decode", batch=1, median_us=200.0)]
    bench_llm.RUN_META.update(model="tiny", plan="graph")
    bench_llm.checkpoint(str(out), rows)
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["model"] == "tiny"
    assert data["rows"][1]["x_bf16"] == 1.5 and "x_bf16" not in rows[1]  # the caller's rows kept
    (goal,) = [t for t in data["targets"] if t["target"] == "decode batch 1 vs bf16 best"]
    assert goal["x"] == 1.5 and goal["met"] is False
    assert not list(tmp_path.glob("*.tmp*"))  # written through a temporary file, renamed
