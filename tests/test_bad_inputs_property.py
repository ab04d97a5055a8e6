"""Random bad input to prepare / the prepared model / convert / the converted model / save /
load: every call either answers as the float model does or raises a ``QFuseError`` — never a raw
torch error, never a silently wrong answer.

The models are built once per module (a prepare costs about a second); hypothesis varies what
goes into them. About 600 examples in all, most of them calls of the converted models."""

import math
import os

import pytest
import torch
from torch import nn

import qfuse
from tests.optional import HealthCheck, given, settings, st

FEATURES = 8
FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.bool, torch.uint8, torch.complex64]
# Huge finite values are left out: a static scale saturates them by design (clipping to the
# calibrated range is what static quantization is), which no bound on the error would allow.
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(FEATURES, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _cnn():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(1),
                         nn.Linear(4 * 4 * 4, 3))


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    out = {}
    for arch, model, x in (("mlp", MLP().eval(), torch.randn(4, 3, FEATURES)),
                           ("cnn", _cnn().eval(), torch.randn(4, 2, 4, 4))):
        for name, cfg in (("int8_static", qfuse.QConfig.int8_static()),
                          ("fp8_dynamic", qfuse.QConfig.fp8_dynamic())):
            prepared = qfuse.prepare(model, cfg, (x,))
            prepared(torch.cat([x, 1.5 * torch.randn(64, *x.shape[1:])]))  # ranges to spare
            out[arch, name] = (model, x, prepared, qfuse.convert(prepared),
                               qfuse.convert(prepared, output="model"))
    return out


@st.composite
def tensors(draw, base_shape):
    """A tensor near ``base_shape``: maybe another rank, size or an empty batch, another dtype,
    NaN/Inf/huge values, or on the meta device."""
    shape = list(base_shape)
    kind = draw(st.sampled_from(["ok", "rank", "size", "empty", "batch"]))
    if kind == "rank":
        shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=5))
    elif kind == "size":
        i = draw(st.integers(0, len(shape) - 1))
        shape[i] = draw(st.integers(1, 9))
    elif kind == "empty":
        shape[0] = 0
    elif kind == "batch":
        shape[0] = draw(st.integers(1, 7))
    dtype = draw(st.sampled_from(DTYPES[:1] * 6 + DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=g)
    if x.numel() and draw(st.booleans()):
        flat = x.view(-1)
        for _ in range(draw(st.integers(1, 3))):
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    if dtype.is_complex:
        x = x.to(dtype)
    elif not dtype.is_floating_point:
        x = x.clamp(-100, 100).nan_to_num(0.0).to(dtype)
    else:
        x = x.to(dtype)
    if draw(st.integers(0, 9)) == 0:
        x = x.to("meta")
    return x


def _float_answer(model, x):
    """The float model's output on ``x``, or None where it raises (the input is bad)."""
    try:
        with torch.no_grad():
            return model(x)
    except Exception:  # noqa: BLE001 — any float failure means "bad input"
        return None


def _check_answer(y, ref, x):
    assert isinstance(y, torch.Tensor) and y.shape == ref.shape and y.device == ref.device
    if ref.device.type == "meta":
        return
    y, ref = y.float(), ref.float()
    bad_ref = ~ref.isfinite()
    assert (~y.isfinite())[bad_ref].all(), "finite output where the float model is not"
    rows = ref.isfinite().flatten(1).all(1) if ref.dim() > 1 else ref.isfinite()
    if ref.dim() > 1:
        y_rows, ref_rows = y[rows], ref[rows]
    else:
        y_rows, ref_rows = y[rows], ref[rows]
    if ref_rows.numel() == 0:
        return
    # where both are finite, the quantized answer is the float one up to quantization error
    ok = y_rows.isfinite()
    scale = ref_rows.abs().max().clamp_min(1e-3)
    err = ((y_rows[ok] - ref_rows[ok]).abs().max() / scale) if ok.any() else 0.0
    # (static scales saturate values far outside calibration: the bound is for garbage, not
    # for quantization error)
    assert err < 0.5 or not math.isfinite(float(scale)), f"relative error {err}"


def _run(fn):
    """``fn()``'s value, or the QFuseError it raised; any other exception fails the test."""
    try:
        return fn()
    except qfuse.QFuseError as exc:
        return exc


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize("config", ["int8_static", "fp8_dynamic"])
@settings(FAST, max_examples=80)
@given(data=st.data())
def test_converted_models_answer_or_raise_qfuse_errors(built, arch, config, data):
    model, x, _, graph, swapped = built[arch, config]
    bad = data.draw(tensors(tuple(x.shape)))
    ref = _float_answer(model, bad.float() if bad.dtype.is_floating_point else bad)
    for qmodel in (graph, swapped):
        with torch.no_grad():
            y = _run(lambda q=qmodel: q(bad))
        if isinstance(y, qfuse.QFuseError):
            continue
        assert ref is not None, f"{type(qmodel).__name__} answered where float fails: {bad}"
        assert bad.dtype.is_floating_point, f"{bad.dtype} input accepted"
        _check_answer(y, ref, bad)


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@settings(FAST, max_examples=40)
@given(data=st.data())
def test_the_prepared_model_answers_or_raises(built, arch, data):
    model, x, prepared, _, _ = built[arch, "int8_static"]
    bad = data.draw(tensors(tuple(x.shape)))
    from qfuse.observers.base import observers_disabled

    with observers_disabled(prepared), torch.no_grad():  # calibration stays as it was
        y = _run(lambda: prepared(bad))
    ref = _float_answer(model, bad.float() if bad.dtype.is_floating_point else bad)
    if not isinstance(y, qfuse.QFuseError):
        assert ref is not None and bad.dtype.is_floating_point
        assert y.shape == ref.shape


@settings(FAST, max_examples=40)
@given(data=st.data())
def test_calibration_on_bad_batches_answers_or_raises(built, data):
    model, x, _, _, _ = built["mlp", "int8_static"]
    prepared = built["mlp", "fp8_dynamic"][2]  # its own observers: the others stay clean
    bad = data.draw(tensors(tuple(x.shape)))
    with torch.no_grad():
        y = _run(lambda: prepared(bad))
    if not isinstance(y, qfuse.QFuseError):
        assert bad.dtype.is_floating_point


@settings(FAST, max_examples=60)
@given(
    keep=st.lists(st.sampled_from(["up", "down", "nope", "", "up.weight", "*"]), max_size=3),
    dtype=st.sampled_from([torch.int8, torch.float8_e4m3fn, torch.float16, torch.int4, None]),
    output=st.sampled_from(["graph", "model", "torchscript", "", "Graph"]),
)
def test_convert_arguments_answer_or_raise(built, keep, dtype, output):
    model, x, prepared, _, _ = built["mlp", "int8_static"]
    layer_dtypes = {"up": dtype} if dtype is not None else None
    q = _run(lambda: qfuse.convert(prepared, keep_float={k: "test" for k in keep},
                                   layer_dtypes=layer_dtypes, output=output))
    if isinstance(q, qfuse.QFuseError):
        return
    assert set(keep) <= {"up", "down"} and output in ("graph", "model")
    assert dtype in (None, torch.int8, torch.float8_e4m3fn)
    with torch.no_grad():
        _check_answer(q(x), model(x), x)


@settings(FAST, max_examples=25)
@given(data=st.data())
def test_prepare_on_bad_examples_answers_or_raises(built, data):
    model, x, _, _, _ = built["mlp", "int8_static"]
    kind = data.draw(st.sampled_from(["dtype", "empty", "meta", "rank", "size", "nan"]))
    bad = x.clone()
    if kind == "dtype":
        bad = bad.to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.bool])))
    elif kind == "empty":
        bad = bad[:0]
    elif kind == "meta":
        bad = bad.to("meta")
    elif kind == "rank":
        bad = bad.reshape(-1)
    elif kind == "size":
        bad = torch.randn(4, 3, data.draw(st.integers(1, 7)))
    else:
        bad[0, 0, 0] = float("nan")
    prepared = _run(lambda: qfuse.prepare(model, qfuse.QConfig.int8_static(), (bad,)))
    if isinstance(prepared, qfuse.QFuseError):
        return
    assert kind == "nan"  # a NaN in the example is data, not a shape: prepare takes it
    err = _run(lambda: prepared(bad))  # and calibration on it says so
    assert isinstance(err, qfuse.QFuseError) or torch.isnan(err).any()


@settings(FAST, max_examples=12)
@given(where=st.sampled_from(["new/deeper", "is_a_dir", "plain", "file_as_dir"]),
       ext=st.sampled_from([".safetensors", ".bin", ""]))
def test_save_and_load_answer_or_raise(built, tmp_path_factory, where, ext):
    model, x, _, graph, _ = built["mlp", "int8_static"]
    root = tmp_path_factory.mktemp("save")
    (root / "a_file").write_text("x")
    path = {"new/deeper": root / "new" / "deeper" / f"m{ext}", "is_a_dir": root,
            "plain": root / f"m{ext}", "file_as_dir": root / "a_file" / f"m{ext}"}[where]
    saved = _run(lambda: qfuse.save(graph, path))
    if isinstance(saved, qfuse.QFuseError):
        assert where in ("is_a_dir", "file_as_dir")
        assert not [p for p in os.listdir(root) if p.startswith(".")]  # no temp file left
        return
    assert where in ("new/deeper", "plain")
    bad_x = torch.randn(4, 3, FEATURES + 1)
    assert isinstance(_run(lambda: qfuse.load(path, model, (bad_x,))), qfuse.QFuseError)
    loaded = qfuse.load(path, model, (x,))
    with torch.no_grad():
        assert torch.equal(loaded(x), graph(x))
