"""convert(output="model") through transformers' save_pretrained -> from_pretrained: the same
quantized model back, bit for bit, of the user's class, running qfuse's modules."""

import json

import pytest
import torch

import qfuse
from qfuse.integrations.decode_graphs import DecodeGraphs
from qfuse.nn import QLinear
from qfuse.nn.base import QuantizedModule
from qfuse.nn.siblings import QSibling
from qfuse.state import get_state

transformers = pytest.importorskip("transformers")

VOCAB = 64
CONFIGS = ("int8_static", "int8_dynamic", "fp8_static")


def _tokens(seed):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (2, 7), generator=g)}


def _bert():
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB)
    return transformers.BertModel(config, add_pooling_layer=False), _tokens


def _vit():
    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=32,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=64)

    def images(seed):
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}

    return transformers.ViTModel(config, add_pooling_layer=False), images


def _gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), _tokens


def _llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config), _tokens


MODELS = {"bert": _bert, "vit": _vit, "gpt2": _gpt2, "llama": _llama}
AUTO = {"bert": transformers.AutoModel, "vit": transformers.AutoModel,
        "gpt2": transformers.AutoModelForCausalLM, "llama": transformers.AutoModelForCausalLM}
LOAD_KWARGS = {"bert": {"add_pooling_layer": False}, "vit": {"add_pooling_layer": False}}


def converted(name, config_name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    example = inputs(1)
    # Static shapes: capture is 3x faster, and the swapped model runs eagerly at any shape.
    prepared = qfuse.prepare(model, getattr(qfuse.QConfig, config_name)(), (),
                             example_kwargs=example, dynamic_shapes={k: {} for k in example})
    prepared(**inputs(2))
    keep = {}
    if name == "vit" and "dynamic" in config_name:  # Conv2d takes static scales only
        keep = {"embeddings.patch_embeddings.projection": "static scales only"}
    return qfuse.convert(prepared, output="model", keep_float=keep), inputs


def _first(output):
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _quantized(model):
    return {n: type(m).__name__ for n, m in model.named_modules()
            if isinstance(m, QuantizedModule | QSibling)}


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("name", list(MODELS))
def test_save_pretrained_from_pretrained_round_trip(tmp_path, name, config_name):
    qmodel, inputs = converted(name, config_name)
    qmodel.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert record["quant_method"] == "qfuse"
    assert record["config"] == get_state(qmodel).config.to_dict()
    auto = AUTO[name]
    loaded = auto.from_pretrained(tmp_path, **LOAD_KWARGS.get(name, {}))
    assert type(loaded) is type(qmodel)
    assert _quantized(loaded) == _quantized(qmodel) and _quantized(qmodel)
    before, after = qmodel.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    x = inputs(3)
    with torch.no_grad():
        assert torch.equal(_first(loaded(**x)), _first(qmodel(**x)))
    assert [r["name"] for r in qfuse.summary(loaded).rows] == \
        [r["name"] for r in qfuse.summary(qmodel).rows]
    loaded.save_pretrained(tmp_path / "again")  # a loaded model saves as it loaded
    again = auto.from_pretrained(tmp_path / "again", **LOAD_KWARGS.get(name, {}))
    torch.save(qmodel, tmp_path / "model.pt")  # eager torch.save: a pickled module
    pickled = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(_first(again(**x)), _first(qmodel(**x)))
        assert torch.equal(_first(pickled(**x)), _first(qmodel(**x)))
    if name in ("gpt2", "llama"):
        greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert torch.equal(loaded.generate(x["input_ids"], **greedy),
                               qmodel.generate(x["input_ids"], **greedy))
        # generate()'s decode steps go through qfuse's graphs on a loaded (or pickled) model too
        for model in (qmodel, loaded, pickled):
            runner = model.__dict__.get("_compiled_call")
            assert isinstance(runner, DecodeGraphs) and runner._model() is model


def test_save_pretrained_refuses_what_it_cannot_describe(tmp_path):
    qmodel, _ = converted("bert", "int8_dynamic")
    merged = QLinear.from_float(torch.randn(64, 32), None, x_scale=None, x_zero_point=None)
    attention = qmodel.encoder.layer[0].attention.self
    attention.key = QSibling.group(merged, [32, 32])[1]  # its merged GEMM is not in the model
    with pytest.raises(qfuse.UnsupportedError, match="attention.self.key.*merged GEMM"):
        qmodel.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    del qmodel.__dict__["qfuse_state"]
    with pytest.raises(qfuse.QFuseError, match="output='model'"):
        qmodel.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_on_cuda(tmp_path, name, config_name):
    """Saved from CUDA, loaded and moved to CUDA: the same outputs through qfuse's Triton
    kernels (device_map= would need accelerate, which qfuse does not depend on)."""
    qmodel, inputs = converted(name, config_name)
    qmodel.to("cuda")
    qmodel.save_pretrained(tmp_path)
    loaded = AUTO[name].from_pretrained(tmp_path, **LOAD_KWARGS.get(name, {})).to("cuda")
    assert {t.device.type for t in loaded.state_dict().values()} == {"cuda"}
    kernels = [r["kernel"] for r in qfuse.summary(loaded).rows]
    assert kernels == [r["kernel"] for r in qfuse.summary(qmodel).rows]
    x = {k: v.cuda() for k, v in inputs(3).items()}
    with torch.no_grad():
        assert torch.equal(_first(loaded(**x)), _first(qmodel(**x)))
        if name in ("gpt2", "llama"):
            greedy = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
            assert torch.equal(loaded.generate(x["input_ids"], **greedy),
                               qmodel.generate(x["input_ids"], **greedy))
