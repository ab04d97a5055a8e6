"""``qfuse.auto_fallback`` under a layer budget (``max_layers`` / ``max_fraction``): the most
sensitive layers that fit the cap, the fewest of them that meet ``max_drop``, or all of them
with ``met`` False when the cap is too small; a merged Q/K/V layer counts three."""

import pytest
import torch
from torch import nn

import qfuse
from qfuse.analysis.fallback import layer_budget, layer_sizes
from qfuse.analysis.sensitivity import output_sqnr_db
from tests.test_sensitivity import planted_model


def setup(outliers=(4,)):
    model = planted_model(5, outliers)  # five Linears: 0, 2, 4, 6, 8
    x = torch.randn(64, 16)
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
    with torch.no_grad():
        prepared(x)
        ref = model(x)

    def sqnr(m):  # higher is better; float scores +inf, capped
        with torch.no_grad():
            return min(output_sqnr_db([ref], [m(x)]), 100.0)

    return prepared, x, sqnr


def test_layer_budget_alone_moves_the_most_sensitive_layers_with_one_evaluation():
    prepared, x, sqnr = setup(outliers=(4, 8))
    report = qfuse.sensitivity(prepared, data=[x], quiet=True)
    qmodel, fb = qfuse.auto_fallback(
        prepared, sqnr, max_layers=2, fallback="fp8", report=report, quiet=True
    )
    assert sorted(fb.fallback_layers) == ["4", "8"]
    assert (fb.max_layers, fb.met, fb.moved, fb.layers) == (2, True, 2, 5)
    assert fb.evaluations == 1 and fb.trace == []  # the returned model only
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["4"]["precision"] == rows["8"]["precision"] == "fp8_e4m3"
    assert "within the budget of 2" in rows["4"]["note"]
    assert all(rows[n]["precision"] == "int8" for n in ("0", "2", "6"))
    # one layer allowed: the more sensitive of the two
    _, one = qfuse.auto_fallback(prepared, sqnr, max_fraction=0.2, report=report, quiet=True)
    assert list(one.fallback_layers) == [report.ranked()[0].name] and one.max_layers == 1


def test_layer_budget_with_max_drop_keeps_the_fewest_that_meet_it():
    prepared, x, sqnr = setup(outliers=(4,))
    _, fb = qfuse.auto_fallback(prepared, sqnr, max_drop=70.0, max_layers=3, data=[x], quiet=True)
    assert list(fb.kept_float) == ["4"] and fb.met and fb.metric >= 30.0


def test_a_max_drop_out_of_reach_within_the_cap_is_reported_not_raised():
    prepared, x, sqnr = setup(outliers=(4, 8))
    report = qfuse.sensitivity(prepared, data=[x], quiet=True)
    _, fb = qfuse.auto_fallback(
        prepared, sqnr, max_drop=1.0, max_layers=1, report=report, quiet=True
    )
    assert not fb.met and len(fb.fallback_layers) == 1
    assert fb.metric < 100.0 - 1.0  # the other planted layer still loses
    # without the cap, the same max_drop is met with both
    _, free = qfuse.auto_fallback(prepared, sqnr, max_drop=70.0, report=report, quiet=True)
    assert sorted(free.fallback_layers) == ["4", "8"] and free.met


class Attention(nn.Module):
    """Q, K, V read one input and end there: prepare merges them into one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.o = nn.Linear(48, 16)

    def forward(self, x):
        return self.o(torch.cat([self.q(x), self.k(x), self.v(x)], -1))


def test_a_merged_layer_counts_as_its_members():
    x = torch.randn(32, 16)
    prepared = qfuse.prepare(Attention().eval(), qfuse.QConfig.int8_static(), (x,))
    with torch.no_grad():
        prepared(x)
    sizes = layer_sizes(prepared)
    assert sorted(sizes.values()) == [1, 3] and sum(sizes.values()) == 4
    merged = next(n for n, k in sizes.items() if k == 3)
    report = qfuse.sensitivity(prepared, data=[x], quiet=True)
    _, fb = qfuse.auto_fallback(prepared, lambda m: 0.0, max_layers=2, report=report, quiet=True)
    assert merged not in fb.fallback_layers and fb.moved <= 2  # three Linears do not fit two


def test_layer_budget_arithmetic():
    assert layer_budget(None, 0.1, 210) == 21
    assert layer_budget(30, 0.1, 210) == 21
    assert layer_budget(3, None, 210) == 3
    assert layer_budget(None, None, 210) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "needs a budget"),
        ({"max_layers": -1}, "max_layers"),
        ({"max_layers": 1.5}, "max_layers"),
        ({"max_fraction": 1.5}, "max_fraction"),
    ],
)
def test_bad_budgets_name_the_fix(kwargs, match):
    prepared, _, sqnr = setup()
    with pytest.raises(qfuse.QFuseError, match=match):
        qfuse.auto_fallback(prepared, sqnr, **kwargs)
