"""qfuse.export.tensors: enumerate, de-alias and replace the tensors of a graph module."""

import doctest
import warnings

import torch
from torch import fx, nn

import qfuse.export.tensors as tensors_module
from qfuse.export.tensors import (
    get_tensor,
    graph_tensors,
    set_tensor,
    split_aliases,
    to_cpu_unshared,
)


class WithEverything(nn.Module):
    """A parameter, a non-persistent buffer, a tied parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.register_buffer("ids", torch.arange(3), persistent=False)

    def forward(self, x):
        return self.b(self.a(x)) + self.ids


def _traced():
    gm = fx.symbolic_trace(WithEverything())
    gm.register_buffer("ids", torch.arange(3), persistent=False)  # fx drops the flag
    # A plain tensor attribute read by get_attr, as torch.export lifts constants (fx warns).
    gm.const = torch.tensor([1.0, 2.0, 3.0])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        const = gm.graph.get_attr("const")
        total = gm.graph.call_function(torch.add, (out.args[0], const))
    out.args = (total,)
    gm.recompile()
    return gm


def test_graph_tensors_finds_what_state_dict_misses():
    gm = _traced()
    found = graph_tensors(gm)
    assert "ids" not in gm.state_dict() and "const" not in gm.state_dict()
    assert list(found) == sorted(["a.weight", "a.bias", "b.weight", "b.bias", "ids", "const"])
    assert found["b.weight"] is found["a.weight"]


def test_split_aliases_keeps_the_first_name():
    gm = _traced()
    unique, aliases = split_aliases(graph_tensors(gm))
    assert aliases == {"b.weight": "a.weight"}
    assert "b.weight" not in unique and unique["a.weight"] is gm.a.weight


def test_to_cpu_unshared_clones_views_of_one_storage():
    base = torch.arange(6.0)
    out = to_cpu_unshared({"x": base[:3], "y": base[3:], "z": torch.ones(2)})
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptrs) == 3
    assert torch.equal(out["y"], torch.tensor([3.0, 4.0, 5.0]))
    assert out["z"].data_ptr() != 0


def test_set_tensor_replaces_without_writing_into_the_old_tensor():
    gm = _traced()
    old_weight, old_ids = gm.a.weight, gm.ids
    snapshot = old_weight.detach().clone()
    set_tensor(gm, "a.weight", torch.zeros(3, 3))
    set_tensor(gm, "ids", torch.zeros(3, dtype=torch.long))
    set_tensor(gm, "const", torch.zeros(3))
    assert torch.equal(old_weight, snapshot) and torch.equal(old_ids, torch.arange(3))
    assert isinstance(gm.a.weight, nn.Parameter) and gm.a.weight.requires_grad
    assert "ids" in gm._non_persistent_buffers_set
    assert torch.equal(gm.const, torch.zeros(3))


def test_set_tensor_with_a_parameter_ties_names_again():
    gm = _traced()
    set_tensor(gm, "a.weight", torch.ones(3, 3))
    set_tensor(gm, "b.weight", get_tensor(gm, "a.weight"))
    assert gm.b.weight is gm.a.weight


def test_docstring_examples():
    assert doctest.testmod(tensors_module).failed == 0
