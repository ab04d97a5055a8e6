"""qfuse.export.checks: converted-model check, input normalisation, output equality."""

import pytest
import torch
from torch import nn

import qfuse
from qfuse.export.checks import converted_state, normalize_inputs, same_outputs
from tests.optional import needs


def test_converted_state_names_what_it_got():
    with pytest.raises(qfuse.QFuseError, match="caller expects .*got a Linear"):
        converted_state(nn.Linear(2, 2), "caller")


def test_normalize_inputs_wraps_a_lone_tensor():
    x = torch.ones(2)
    assert normalize_inputs(x, None) == ((x,), {})
    assert normalize_inputs(None, {"y": x}) == ((), {"y": x})


def test_same_outputs_compares_leaves_not_containers():
    BaseModelOutput = needs("transformers", None).modeling_outputs.BaseModelOutput
    a, b = torch.randn(2, 3), torch.randn(2)
    assert same_outputs(BaseModelOutput(last_hidden_state=a), {"last_hidden_state": a.clone()})
    assert same_outputs((a, b), [a.clone(), b.clone()])


@pytest.mark.parametrize(
    "other",
    [
        lambda a: torch.where(a == a[0, 0], torch.nextafter(a, a + 1), a),  # one ulp, one value
        lambda a: a.double(),  # same values, other dtype
        lambda a: a.reshape(3, 2),  # same values, other shape
        lambda a: (a, a),  # extra output
    ],
)
def test_same_outputs_is_strict(other):
    a = torch.randn(2, 3)
    assert not same_outputs(a, other(a))
