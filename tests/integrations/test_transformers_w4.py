"""4-bit models (``QLinear4``) through transformers' save_pretrained -> from_pretrained: qfuse's
own format (``quant_method="qfuse"``) keeps the merged Q/K/V, the gated MLP and W4A8 layers,
which compressed-tensors' pack_quantized cannot (``qfuse.export_compressed_tensors`` writes that
for W4A16 serving engines), and gives back the codes, group scales, zero points, group size and
activation bits exactly."""

import json

import pytest
import torch

import qfuse
from qfuse.nn.base import QuantizedModule
from qfuse.nn.qlinear4 import QLinear4
from qfuse.nn.siblings import QSibling

transformers = pytest.importorskip("transformers")

VOCAB = 64
CONFIGS = {
    "w4a16_g32": qfuse.QConfig.w4a16(32),
    "w4a16_g32_asym": qfuse.QConfig.w4a16(32, symmetric=False),
    "w4a16_channel": qfuse.QConfig.w4a16(None),
    "w4a8_g16_static_asym": qfuse.QConfig.w4a8(16, symmetric=False, dynamic=False),
    "w4a8_g32_dynamic": qfuse.QConfig.w4a8(32),
}


def _tokens(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 7), generator=g)


def _converted(config):
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)).eval()
    example = {"input_ids": _tokens(1)}
    prepared = qfuse.prepare(llama, config, (), example_kwargs=example,
                             dynamic_shapes={"input_ids": {}})
    prepared(input_ids=_tokens(2))
    return qfuse.convert(prepared, output="model")


def _w4(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QLinear4)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_4_bit_save_pretrained_round_trips_exactly(tmp_path, name):
    qmodel = _converted(CONFIGS[name])
    layers = _w4(qmodel)
    assert layers and all(type(m).__name__ in ("QLinear4", "SwappedQLinear4")
                          for m in layers.values())
    qmodel.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert record["quant_method"] == "qfuse"
    kinds = json.dumps(record["modules"])
    assert '"QLinear4"' in kinds and '"QSibling"' in kinds and '"QGatedMLP"' in kinds
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    back = _w4(loaded)
    assert sorted(back) == sorted(layers)
    for path, mine in layers.items():
        theirs = back[path]
        assert type(theirs) is type(mine), path  # float-facing where it was
        assert (theirs.group_size, theirs.act_bits, theirs.in_features, theirs.out_features,
                theirs.activation) == (mine.group_size, mine.act_bits, mine.in_features,
                                       mine.out_features, mine.activation), path
        for buf, tensor in mine._buffers.items():  # codes, scales, zero points, x_scale
            other = theirs._buffers[buf]
            if tensor is None:
                assert other is None, (path, buf)
            else:
                assert other.dtype == tensor.dtype and torch.equal(other, tensor), (path, buf)
    assert {n: type(m).__name__ for n, m in loaded.named_modules()
            if isinstance(m, QuantizedModule | QSibling)} == \
        {n: type(m).__name__ for n, m in qmodel.named_modules()
         if isinstance(m, QuantizedModule | QSibling)}
    before, after = qmodel.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    ids = _tokens(3)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)
    assert [(r["name"], r["precision"]) for r in qfuse.summary(loaded).rows] == \
        [(r["name"], r["precision"]) for r in qfuse.summary(qmodel).rows]


def test_a_4_bit_layer_of_an_unknown_kind_is_refused_naming_it(tmp_path):
    """A file from a newer qfuse (a module kind this one does not know) is refused, naming the
    module path and the fix, not loaded as a float model with random weights."""
    _converted(CONFIGS["w4a16_g32"]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules"]["model.layers.0.self_attn.o_proj"]["module"] = \
        "QLinear2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(qfuse.QFuseError, match=r"self_attn\.o_proj.*QLinear2.*upgrade qfuse"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
