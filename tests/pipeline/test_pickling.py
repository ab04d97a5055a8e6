"""Converted models as whole modules: ``pickle``, ``torch.save`` / ``torch.load`` and
``copy.deepcopy`` give a model with bit-identical outputs, for the graph and for
``output="model"`` (``qfuse.pipeline.pickling``, ``qfuse.shapes.ShapeGuard``)."""

import copy
import io
import pickle

import pytest
import torch

import qfuse
from qfuse.errors import QFuseError, ShapeError
from tests.cnn_blocks import TinyResNet
from tests.models import MLPBlock, randomize_batchnorm, tiny_bert, token_batch


def _pickled(m):
    return pickle.loads(pickle.dumps(m))


def _torch_saved(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _outputs(out):
    for key in ("last_hidden_state", "logits"):
        if hasattr(out, key):
            return getattr(out, key)
    return out


def _mlp():
    torch.manual_seed(0)
    return MLPBlock().eval(), (torch.randn(4, 7, 32),), {}


def _cnn():
    torch.manual_seed(0)
    return randomize_batchnorm(TinyResNet()), (torch.randn(2, 3, 16, 16),), {}


def _bert():
    return tiny_bert(), (), token_batch()


def _llama():
    """Gate/up as one GEMM (QGatedMLP), merged Q/K/V, and what the transformers integration
    attaches to a swapped model (its quantizer, decode graphs)."""
    from tests.zoo_models import build

    model, make_inputs, _ = build("llama")
    return model, (), make_inputs()


@pytest.mark.parametrize("output", ["graph", "model"])
@pytest.mark.parametrize("make", [_mlp, _cnn, _bert, _llama], ids=["mlp", "cnn", "bert", "llama"])
def test_converted_models_pickle_save_and_deepcopy(make, output):
    model, args, kwargs = make()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=args,
                             example_kwargs=kwargs)
    with torch.no_grad():
        prepared(*args, **kwargs)
        qmodel = qfuse.convert(prepared, output=output)
        ref = _outputs(qmodel(*args, **kwargs))
        for copier in (_pickled, _torch_saved, copy.deepcopy):
            again = copier(qmodel)
            assert torch.equal(_outputs(again(*args, **kwargs)), ref), copier.__name__
            assert str(qfuse.summary(again)) == str(qfuse.summary(qmodel))
    if make is _llama and output == "model":  # a copy generates the same tokens
        greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        ids = kwargs["input_ids"][:, :5]
        with torch.no_grad():
            assert torch.equal(_torch_saved(qmodel).generate(ids, **greedy),
                               qmodel.generate(ids, **greedy))
    if output == "graph":  # a copy of a copy, and its shape guards still name the input
        twice = _pickled(_torch_saved(qmodel))
        with torch.no_grad():
            assert torch.equal(_outputs(twice(*args, **kwargs)), ref)


def test_a_pickled_graph_keeps_its_shape_guards_and_saves():
    model, (x,), _ = _mlp()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
    prepared(x)
    again = _pickled(qfuse.convert(prepared))
    with pytest.raises(ShapeError, match="dimension 2 is 31"):
        again(torch.randn(4, 7, 31))
    buf = io.BytesIO()
    torch.save(again.state_dict(), buf)  # and what qfuse.save reads is all there
    assert qfuse.summary(again).rows


def test_guards_that_cannot_be_read_back_name_qfuse_save():
    model, (x,), _ = _mlp()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), example_inputs=(x,))
    prepared(x)
    qmodel = qfuse.convert(prepared)
    qmodel._guards_fn.checks = None  # as for guards whose source did not compile back the same
    with pytest.raises(QFuseError, match="qfuse.save"):
        pickle.dumps(qmodel)
