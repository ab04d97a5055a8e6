"""``qfuse.flows.plan``: SmoothQuant, GPTQ and the state's own transforms run in order over one
per-layer plan, and convert builds what the plan ends with."""

from __future__ import annotations

import torch

import qfuse
from qfuse.flows.plan import GPTQTransform, LayerPlan, SmoothQuantTransform, transforms
from qfuse.state import get_state
from tests.models import LNBlock

X = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))


def _prepared(**kw):
    torch.manual_seed(0)
    p = qfuse.prepare(LNBlock().eval(), qfuse.QConfig.int8_static(), (X,), **kw)
    p(X)
    return p


class Recorder:
    """A transform that records what the plan held when it ran and scales one layer's input."""

    def __init__(self):
        self.seen = None

    def apply(self, plan: LayerPlan) -> None:
        self.seen = {name: w.clone() for name, w in plan.weights.items()}
        scale, zp = plan.x_qparams["fc"]
        plan.x_qparams["fc"] = (scale * 2, zp)


def test_transforms_run_smoothquant_then_gptq_then_the_states_own():
    p = _prepared(smoothquant=qfuse.SmoothQuant(0.5), gptq=qfuse.GPTQ())
    state = get_state(p)
    hessians = {name: p.get_submodule(h) for name, h in state.hessians.items()}
    extra = Recorder()
    state.plan_transforms = [extra]
    kinds = [type(t) for t in transforms(state, hessians)]
    assert kinds == [SmoothQuantTransform, GPTQTransform, Recorder]
    dtypes = {c.name: torch.int8 for c in state.chains}
    plan = LayerPlan(p, state, state.chains, state.observers, dtypes, hessians)
    assert "fc" in plan.smoothing and "fc" in plan.weight_scales
    # The state's transform saw the smoothed, GPTQ-rounded weight that ships.
    assert torch.equal(extra.seen["fc"], plan.weights["fc"])


def test_convert_builds_what_the_last_transform_left():
    p = _prepared()
    plain = qfuse.convert(p)
    get_state(p).plan_transforms = [Recorder()]
    scaled = qfuse.convert(p)
    x_scale = lambda qmodel: float(qmodel.get_submodule("fc").x_scale)  # noqa: E731
    assert x_scale(scaled) == 2 * x_scale(plain)
