"""qfuse.search's noise margin: with ``PerWindow`` scores a candidate meets the budget only when
its drop plus the one-sided upper confidence bound of its paired per-window differences vs float
does, in the search and in auto_fallback's stopping rule. The metric is planted (a function of
which layers are quantized), so each test knows the drops and spreads exactly."""

import math

import pytest
import torch
from torch import nn

import qfuse
from qfuse.nn import QLinear
from qfuse.state import get_state
from qfuse.tools import SearchSpace, SweepSpec, run_sweep
from qfuse.tools.margin import PerWindow, bound, rule, t_quantile
from qfuse.tools.search import SearchError

BASE = (1.0, 2.0, 3.0, 4.0, 1.5, 2.5, 3.5, 4.5)  # float's per-window score, higher is better
STEADY = (0.05,) * 8  # every window drops by 0.05
NOISY = (-0.25, 0.35) * 4  # mean drop 0.05 too, but half the windows drop by 0.35
ONLY_INT8 = SearchSpace(dtypes=("int8",), observers=("minmax",), symmetric=(True,),
                        smoothquant_alphas=(), gptq=False, auto_fallback=False)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    return model, [torch.randn(16, 8) for _ in range(2)]


def _planted(drops: dict, per_window: bool = True):
    """Scores that depend only on the model's dtype: float gives BASE, a quantized model BASE
    minus ``drops[dtype]`` window by window."""

    def score(m):
        state = get_state(m)
        drop = (0.0,) * len(BASE) if state is None else drops[state.config.dtype]
        scores = PerWindow(tuple(b - d for b, d in zip(BASE, drop, strict=True)))
        return scores if per_window else scores.metric

    return score


def _by_dtype(m):  # a fake, steady clock: int8 1 ms, fp8 2 ms
    return 1.0 if get_state(m).config.dtype == torch.int8 else 2.0


def test_the_bound_is_the_paired_t_bound_through_the_link():
    base = PerWindow(tuple(math.log(20.0) + 0.01 * i for i in range(16)), link=math.exp)
    diffs = [0.004 + (0.003 if i % 2 else -0.003) for i in range(16)]  # NLL up 0.4% +- 0.3%
    q = PerWindow(tuple(b + d for b, d in zip(base.values, diffs, strict=True)), link=math.exp)
    b = bound(q, base, higher_is_better=False)  # perplexity: lower is better
    se = math.sqrt(sum((d - 0.004) ** 2 for d in diffs) / 15 / 16)
    assert b.drop == pytest.approx(q.metric - base.metric) and b.drop > 0  # perplexity went up
    assert b.worst == pytest.approx(math.exp(q.mean + t_quantile(0.95, 15) * se) - base.metric)
    assert b.margin > 0
    assert bound(q, base, False, confidence=0.5).margin == pytest.approx(0.0, abs=1e-12)
    assert bound(q.metric, base.metric, False).margin == 0.0  # one number: no spread to bound
    assert t_quantile(0.95, 7) == pytest.approx(1.8946, abs=1e-3)  # the t table
    with pytest.raises(qfuse.QFuseError, match="same windows"):
        bound(PerWindow((1.0, 2.0)), PerWindow((1.0, 2.0, 3.0)))


def test_a_mean_drop_within_budget_on_noisy_windows_is_refused():
    """int8 and fp8 both drop the mean by 0.05 (budget 0.1); int8 is faster but its windows
    disagree (-0.25 / +0.35): its bound is over the budget, so the steady fp8 wins. As plain
    floats the two are the same drop and the faster int8 wins, as before."""
    model, calib = _model()
    drops = {torch.int8: NOISY, torch.float8_e4m3fn: STEADY}
    space = SearchSpace(dtypes=("int8", "fp8"), observers=("minmax",), smoothquant_alphas=(),
                        gptq=False, auto_fallback=False)
    r = qfuse.search(model, calib, _planted(drops), max_drop=0.1, space=space,
                     time_fn=_by_dtype, quiet=True)
    assert r.config.dtype == torch.float8_e4m3fn
    assert r.drop == pytest.approx(0.05) and r.margin == pytest.approx(0.0, abs=1e-9)
    int8 = next(s for s in r.path if s.candidate == "int8 static, minmax sym")
    assert int8.drop == pytest.approx(0.05) and int8.drop + int8.margin > 0.1 and not int8.meets
    assert "over the budget: int8 static, minmax sym (drop 0.05 + margin" in r.why
    assert rule(PerWindow(BASE)) in r.why and r.margin_rule == rule(PerWindow(BASE))
    assert r.to_dict()["margin"] == r.margin

    plain = qfuse.search(model, calib, _planted(drops, per_window=False), max_drop=0.1,
                         space=space, time_fn=_by_dtype, quiet=True)
    assert plain.config.dtype == torch.int8 and plain.margin == 0.0
    assert "no margin: eval_fn returns one number per model" in plain.why


def test_the_search_with_a_margin_is_deterministic():
    model, calib = _model()
    drops = {torch.int8: NOISY, torch.float8_e4m3fn: STEADY}
    runs = [qfuse.search(model, calib, _planted(drops), max_drop=0.1, time_fn=_by_dtype,
                         space=SearchSpace(observers=("minmax",), symmetric=(True,),
                                           smoothquant_alphas=(0.5,), gptq=False,
                                           auto_fallback=False), quiet=True)
            for _ in range(2)]
    a, b = (r.to_dict() for r in runs)
    assert a == b and a["candidate"]["label"] == "fp8 static, minmax"
    assert [s["stage"] for s in a["path"]].count("SmoothQuant") == 2  # int8 tried it, noted


def test_no_candidate_within_drop_plus_margin_is_a_search_error_naming_both():
    model, calib = _model()
    with pytest.raises(SearchError, match="no configuration meets max_drop=0.1") as failed:
        qfuse.search(model, calib, _planted({torch.int8: NOISY}), max_drop=0.1,
                     space=ONLY_INT8, time_fn=_by_dtype, quiet=True)
    text = str(failed.value)
    assert "int8 static, minmax sym: drop 0.05 + margin" in text and "95% upper" in text
    steps = [s for s in failed.value.path if s.candidate]
    assert [s.meets for s in steps] == [False] and steps[0].margin > 0.05
    # the same windows without a margin: today's behaviour, the mean drop meets the budget
    r = qfuse.search(model, calib, _planted({torch.int8: NOISY}, per_window=False),
                     max_drop=0.1, space=ONLY_INT8, time_fn=_by_dtype, quiet=True)
    assert r.drop == pytest.approx(0.05) and r.margin == 0.0
    with pytest.raises(qfuse.QFuseError, match="confidence"):
        qfuse.search(model, calib, _planted({}), max_drop=0.1, confidence=1.0, quiet=True)
    spec = SweepSpec("tiny", model, calib, _planted({}), calib[0])
    with pytest.raises(qfuse.QFuseError, match="confidence"):  # before anything runs
        run_sweep(spec, ["fp32", "best"], confidence=0.4, quiet=True)


def test_auto_fallback_stops_at_the_budget_with_the_margin():
    """Each int8 layer drops the windows by 0 or 0.2 (mean 0.1); budget 0.25. On the mean, two
    int8 layers (0.2) meet it; with the margin of 8 windows two are over (0.2 + 0.14) and one
    is within (0.1 + 0.07): auto_fallback keeps one layer in int8, not two."""
    model, calib = _model()
    per_layer = (0.0, 0.2) * 4

    def score(m, per_window=True):
        n = sum(isinstance(x, QLinear) for x in m.modules()) if get_state(m) else 0
        scores = PerWindow(tuple(b - n * d for b, d in zip(BASE, per_layer, strict=True)))
        return scores if per_window else scores.metric

    space = SearchSpace(dtypes=("int8",), observers=("minmax",), smoothquant_alphas=(),
                        gptq=False, fallback="float", sensitivity="local")
    r = qfuse.search(model, calib, score, max_drop=0.25, space=space, quiet=True)
    assert len(r.candidate.keep_float) == 3 and r.drop == pytest.approx(0.1)
    assert r.drop + r.margin <= 0.25 and r.margin == pytest.approx(
        t_quantile(0.95, 7) * math.sqrt(sum((d - 0.1) ** 2 for d in per_layer) / 7 / 8))
    plain = qfuse.search(model, calib, lambda m: score(m, False), max_drop=0.25, space=space,
                         quiet=True)
    assert len(plain.candidate.keep_float) == 2 and plain.drop == pytest.approx(0.2)


def test_the_llm_recipe_validates_per_window_on_text_it_never_calibrates_on():
    """``--recipe llm`` (here on the toy Llama): ``validate`` gives each window's mean NLL,
    whose metric is the recipe's perplexity, on windows after the calibration ones."""
    from tests.optional import needs

    needs("transformers", "recipes")
    from qfuse.calibration import llm as data
    from qfuse.recipes import ptq_llm

    spec = ptq_llm.sweep_spec(reduced=True, model="toy")
    scores = spec.validate(spec.model)
    valid = data.validation_windows(4)
    assert isinstance(scores, PerWindow) and len(scores) == 4
    assert scores.metric == pytest.approx(data.score(spec.model, valid)[0], rel=1e-5)
    calib = data.calibration_windows()
    assert not any(torch.equal(v, c) for v in valid for c in calib)
