"""NaN and ±Inf through converted models (qfuse.fusion.nonfinite): where the float model's
output is non-finite the quantized one's is NaN, never a plausible finite number; the other
samples of the batch are untouched."""

import pytest
import torch
from torch import nn

import qfuse
from qfuse.ops.nonfinite import nonfinite_rows, poison_rows

CONFIGS = {
    "int8_static": qfuse.QConfig.int8_static(),
    "int8_dynamic": qfuse.QConfig.int8_dynamic(),
    "fp8_static": qfuse.QConfig.fp8_static(),
    "fp8_dynamic": qfuse.QConfig.fp8_dynamic(),
}
VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


class MLP(nn.Module):
    """Two Linears with an int8 hand-over between them (static configs)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64, 3),
    )


def _converted(model, x, config):
    prepared = qfuse.prepare(model, config, (x,))
    prepared(x)
    return {output: qfuse.convert(prepared, output=output) for output in ("graph", "model")}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    mlp, cnn = MLP().eval(), _cnn().eval()
    xs = {"mlp": torch.randn(3, 4, 16), "cnn": torch.randn(3, 2, 4, 4)}
    built = {}
    for name, cfg in CONFIGS.items():
        for arch, model in (("mlp", mlp), ("cnn", cnn)):
            for output, qmodel in _converted(model, xs[arch], cfg).items():
                built[arch, name, output] = qmodel
    return {"mlp": mlp, "cnn": cnn}, xs, built


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("output", ["graph", "model"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_non_finite_input_gives_nan_where_float_is_non_finite(models, arch, config, output,
                                                                value):
    floats, xs, built = models
    qmodel, fmodel = built[arch, config, output], floats[arch]
    clean = xs[arch].clone()
    where = (1, 2, 5) if arch == "mlp" else (1, 0, 2, 3)
    clean[where] = 0.0  # the same batch but for one value, so the dynamic scales agree
    bad = clean.clone()
    bad[where] = VALUES[value]
    with torch.no_grad():
        y, ref, f = qmodel(bad), qmodel(clean), fmodel(bad)
    token = (1, 2) if arch == "mlp" else (1,)
    assert (~f[token].isfinite()).all()  # the float model: non-finite there
    assert y[token].isnan().all()  # NaN, whatever the sign of the Inf
    assert (~y.isfinite())[~f.isfinite()].all()  # non-finite wherever float is
    # Wider than float only inside the marked sample (the graph marks a whole sample across an
    # int8 hand-over; the swapped layers mark their own rows, exactly the float model's)
    assert y[[0, 2]].isfinite().all()
    if arch == "cnn" and "dynamic" in config:
        # per-tensor dynamic scales are the batch's: the marked sample's NaN activations are
        # left out of the next layer's amax, so the others move by a quantization step
        err = (y[[0, 2]] - ref[[0, 2]]).norm() / ref[[0, 2]].norm()
        assert err < 0.05
    else:
        assert torch.equal(y[[0, 2]], ref[[0, 2]])
        finite = y[1].isfinite()
        assert torch.equal(y[1][finite], ref[1][finite])
    if arch == "mlp" and output == "model":
        assert torch.equal(~y.isfinite(), ~f.isfinite())


def test_non_finite_marks_survive_save_and_load(models, tmp_path):
    floats, xs, built = models
    path = tmp_path / "cnn.safetensors"
    qfuse.save(built["cnn", "int8_static", "graph"], path)
    loaded = qfuse.load(path, floats["cnn"], (xs["cnn"],))
    bad = xs["cnn"].clone()
    bad[0, 1, 0, 0] = float("inf")
    with torch.no_grad():
        y = loaded(bad)
    assert y[0].isnan().all() and y[1:].isfinite().all()


class Masked(nn.Module):
    """An additive -inf mask before softmax is finite in float: nothing to mark."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.proj(torch.softmax(x + mask, dim=-1))


def test_an_additive_minus_inf_mask_marks_nothing():
    torch.manual_seed(0)
    model, x = Masked().eval(), torch.randn(2, 3, 8)
    mask = torch.zeros(2, 3, 8)
    mask[..., 5:] = float("-inf")
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x, mask))
    prepared(x, mask)
    with torch.no_grad():
        y, f = qfuse.convert(prepared)(x, mask), model(x, mask)
    assert f.isfinite().all() and y.isfinite().all()


@pytest.mark.parametrize("config", ["int8_static", "fp8_dynamic"])
def test_the_triton_path_keeps_the_marks(models, config):
    """The same models with the Triton kernels (the interpreter on CPU): the kernels quantize a
    NaN to a finite code, the graph's marks put it back."""
    floats, xs, built = models
    bad = xs["mlp"][:2, :2].clone()
    bad[1, 0, 3] = float("nan")
    for output in ("graph", "model"):
        qmodel = built["mlp", config, output]
        with qfuse.use_backend("triton"), torch.no_grad():
            y = qmodel(bad)
        with qfuse.use_backend("reference"), torch.no_grad():
            ref = qmodel(bad)
        assert y[1, 0].isnan().all() and y[0].isfinite().all()
        assert torch.equal(y.isnan(), ref.isnan())


def test_marks_by_hand():
    x = torch.tensor([[1.0, float("inf")], [2.0, 3.0]])
    mark = nonfinite_rows(x, 1)
    assert mark.tolist() == [True, False]
    y = poison_rows(torch.ones(2, 5), mark)
    assert y[0].isnan().all() and (y[1] == 1).all()
    assert poison_rows(torch.ones(2, 5, dtype=torch.int32), mark).eq(1).all()  # ints unchanged
    assert nonfinite_rows(torch.empty(0, 4), 1).shape == (0,)


class Tokens(nn.Module):
    """Fed token ids: every float is computed from the weights, nothing can bring NaN in."""

    def __init__(self):
        super().__init__()
        self.emb, self.mlp = nn.Embedding(20, 16), MLP()

    def forward(self, ids):
        return self.mlp(self.emb(ids))


@pytest.mark.parametrize("config", ["int8_static", "fp8_dynamic"])
def test_marks_only_where_a_float_input_reaches(models, config):
    """A model fed token ids gets no marks and no hooks (each costs a pass over a float tensor
    on the GPU); one with a float input keeps them."""
    from qfuse.fusion.nonfinite import _poison_hook

    def counts(model, x):
        prepared = qfuse.prepare(model, CONFIGS[config], (x,))
        prepared(x)
        graph, swapped = (qfuse.convert(prepared, output=o) for o in ("graph", "model"))
        marks = sum(n.target is nonfinite_rows for n in graph.graph.nodes)
        hooks = sum(_poison_hook in m._forward_hooks.values() for m in swapped.modules())
        return marks, hooks

    torch.manual_seed(0)
    assert counts(Tokens().eval(), torch.randint(0, 20, (3, 4))) == (0, 0)
    floats, xs, _ = models
    marks, hooks = counts(floats["mlp"], xs["mlp"])
    assert marks > 0 and hooks > 0
