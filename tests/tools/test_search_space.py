"""qfuse.search's LLM space: dynamic (per-token) schemes, SmoothQuant's layers, auto_fallback to
fp8 ranked by the local sensitivity; candidates reproduce through prepare/convert and the result
says why it won. Toy models only (fast)."""

import json

import pytest
import torch

import qfuse
from qfuse.analysis.sensitivity import output_sqnr_db
from qfuse.tools import Candidate, SearchSpace
from qfuse.tools.calibrate import Calibrations, key_of
from qfuse.tools.search import plain_config, scheme_name
from tests.test_sensitivity import planted_model


def test_the_default_space_is_unchanged_and_the_llm_space_is_dynamic():
    default = SearchSpace()
    assert default.schemes() == [("int8", "static"), ("fp8", "static")]
    assert (default.fallback, default.sensitivity, default.smoothquant_layers) == (
        "float", "full", None)
    llm = SearchSpace.llm()
    assert llm.schemes() == [("int8", "dynamic"), ("fp8", "dynamic")]
    assert (llm.fallback, llm.fallback_fraction, llm.sensitivity) == ("fp8", 0.1, "local")
    assert plain_config("int8", "static") == qfuse.QConfig.int8_static()
    assert plain_config("fp8", "dynamic") == qfuse.QConfig.fp8_dynamic()
    assert scheme_name("int8", "static") == "int8"  # the notes' names of the static search
    for bad in ({"activations": ("weekly",)}, {"fallback": "int4"}, {"sensitivity": "fast"},
                {"smoothquant_layers": "*"}):
        with pytest.raises(qfuse.QFuseError):
            SearchSpace(**bad)


def test_candidates_reproduce_their_prepare_and_convert_arguments():
    c = Candidate(qfuse.QConfig.int8_static(), 0.8, True, smoothquant_layers=("*",),
                  fp8_layers=("b", "a"))
    assert c.label() == ("int8 static, minmax sym + SmoothQuant 0.8 on every Linear + GPTQ + "
                         "auto_fallback (2 fp8)")
    sq = c.prepare_kwargs()["smoothquant"]
    assert (sq.alpha, sq.layers) == (0.8, ("*",))
    kw = c.convert_kwargs()
    assert kw["layer_dtypes"] == {"b": torch.float8_e4m3fn, "a": torch.float8_e4m3fn}
    assert set(kw["notes"]) == {"a", "b"} and "keep_float" not in kw
    d = c.to_dict()
    assert d["smoothquant_layers"] == ["*"] and d["fp8_layers"] == ["b", "a"]
    json.dumps(d)
    # what existed before keeps its label and its dict
    old = Candidate(qfuse.QConfig(symmetric=False), smoothquant=0.5, keep_float=("x",))
    assert old.label() == "int8 static, minmax asym + SmoothQuant 0.5 + auto_fallback (1 float)"
    assert set(old.to_dict()) == {"label", "config", "smoothquant_alpha", "gptq", "keep_float"}
    assert Candidate(qfuse.QConfig.fp8_dynamic()).label() == "fp8 dynamic (per-token)"
    # the calibration cache tells SmoothQuant's layers apart, and keeps its old keys
    cfg = qfuse.QConfig()
    assert key_of(cfg, 0.5, False) == json.dumps([cfg.to_dict(), 0.5, False], sort_keys=True)
    assert key_of(cfg, 0.5, False, ("*",)) != key_of(cfg, 0.5, False)


def test_dynamic_search_falls_back_to_fp8_by_the_local_ranking_and_reproduces():
    """Per-token int8 still loses the planted layer (one 500 channel sets every row's scale);
    auto_fallback moves it, ranked by the local sensitivity, to fp8; the result's arguments
    redo it and its ``why`` names the winner and what was over the budget."""
    model = planted_model()
    torch.manual_seed(1)
    calib = [torch.randn(64, 16) for _ in range(2)]
    held = torch.randn(64, 16)
    with torch.no_grad():
        ref = model(held)

    def score(m):  # output SQNR, capped: higher is better
        with torch.no_grad():
            return min(output_sqnr_db([ref], [m(held)]), 100.0)

    space = SearchSpace(dtypes=("int8",), activations=("dynamic",), observers=("minmax",),
                        smoothquant_alphas=(), gptq=False, fallback="fp8",
                        fallback_fraction=0.25, sensitivity="local")
    r = qfuse.search(model, calib, score, max_drop=100.0 - 25.0, space=space, quiet=True)
    assert r.candidate.fp8_layers == ("4",) and r.candidate.keep_float == ()
    assert r.config == qfuse.QConfig.int8_dynamic() and r.metric >= 25.0
    assert r.fallback.report.rows[0].metric is None  # the local ranking: SQNR only
    assert r.why.startswith("picked int8 dynamic (per-token) + auto_fallback (1 fp8)")
    assert "over the budget: int8 dynamic (per-token) (drop" in r.why
    assert r.to_dict()["why"] == r.why and r.path[-1].stage == "picked"
    prepared = qfuse.prepare(model, r.config, (calib[0],), **r.prepare_kwargs())
    with torch.no_grad():
        for x in calib:
            prepared(x)
    again = qfuse.convert(prepared, **r.convert_kwargs())
    assert score(again) == pytest.approx(r.metric, abs=1e-6)
    rows = {row["name"]: row for row in qfuse.summary(again).rows}
    assert rows["4"]["precision"] == "fp8_e4m3" and rows["0"]["precision"] == "int8"


def test_cache_calibrates_smoothquant_layers_apart():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval()
    cache = Calibrations(model, [torch.randn(16, 8)], quiet=True)
    a = cache.get(qfuse.QConfig(), 0.5)
    b = cache.get(qfuse.QConfig(), 0.5, smoothquant_layers=("*",))
    assert a is not b and cache.calibrations == 2
    assert cache.get(qfuse.QConfig(), 0.5, False, ("*",)) is b


RECIPE = '''
import torch
from torch import nn
from qfuse.tools import SearchSpace, SweepSpec

def sweep_spec(reduced=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    calib = [torch.randn(32, 16) for _ in range(2)]
    held = torch.randn(64, 16)
    ref = model(held).detach()
    rms = lambda m: (m(held) - ref).pow(2).mean().sqrt().item()
    space = SearchSpace(dtypes=("int8",), activations=("dynamic", "static"),
                        observers=("minmax",), smoothquant_alphas=(), gptq=False,
                        auto_fallback=False)
    return SweepSpec("tiny", model, calib, rms, held[:8], metric="rms error",
                     higher_is_better=False, default_max_drop=0.05, search_space=space)
'''


def test_qfuse_best_says_what_it_picked_and_why(tmp_path, capsys):
    """``qfuse best``: fp32 and the search's winner from the recipe's own space, its reason."""
    from tests.optional import needs

    needs("matplotlib", "recipes")  # the report draws pareto.png
    from qfuse.cli import main

    recipe = tmp_path / "tiny_best.py"
    recipe.write_text(RECIPE)
    out = tmp_path / "best"
    code = main(["best", "--recipe", str(recipe), "--out", str(out), "--device", "cpu",
                 "--repeats", "1", "--quiet"])
    text = capsys.readouterr().out
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in results["rows"]] == ["fp32", "best"]
    label = results["search"]["candidate"]["label"]
    assert f"best: {label}" in text and "why: picked " in text and "rms error: " in text
    assert "int8 dynamic (per-token)" in {s["candidate"] for s in results["search"]["path"]}
    assert "Why: picked" in (out / "report.md").read_text()
