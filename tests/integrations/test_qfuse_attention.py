"""qfuse's attention in a transformers model (``integrations.attention``): a tiny GQA Llama
generates the tokens its SDPA twin generates, with every decode step's attention through
``qfuse::decode_attention`` (counted at the dispatcher) and prefill through SDPA; what is not
decode-sized, eager models and ``QFUSE_DECODE_ATTENTION=0`` stay on transformers' paths."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.optional import reason

transformers = pytest.importorskip("transformers", reason=reason("transformers", None))

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import qfuse  # noqa: E402
from qfuse.integrations import attention  # noqa: E402

VOCAB, NEW = 96, 8
GREEDY = dict(cache_implementation="static", max_new_tokens=NEW, do_sample=False, pad_token_id=0)


class OpCount(TorchDispatchMode):
    """Counts ``qfuse::decode_attention`` and SDPA calls as the dispatcher sees them."""

    def __init__(self):
        super().__init__()
        self.decode = self.sdpa = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.decode += name == "qfuse::decode_attention"
        self.sdpa += "scaled_dot_product" in name
        return func(*args, **(kwargs or {}))


def llama(impl="sdpa", seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB, bos_token_id=0, eos_token_id=None,
                                      pad_token_id=0, attn_implementation=impl)
    return transformers.LlamaForCausalLM(config).eval()


def tokens(B, S, seed=1):
    return torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    """An SDPA Llama and a copy switched to qfuse's attention."""
    ref = llama()
    model = llama()
    model.load_state_dict(ref.state_dict())
    assert attention.install(model) and model.config._attn_implementation == "qfuse"
    assert attention.install(model)  # idempotent
    return ref, model


def test_greedy_tokens_equal_and_decode_through_the_op(models):
    ref, model = models
    ids = tokens(1, 7)
    with torch.no_grad():
        expected = ref.generate(ids, **GREEDY)
        with OpCount() as count:
            out = model.generate(ids, **GREEDY)
    assert torch.equal(out, expected)
    # NEW - 1 decode steps x 2 layers; the prefill (7 query positions, no mask) went to SDPA
    assert count.decode == (NEW - 1) * 2 and count.sdpa == 2


def test_left_padded_batch(models):
    ref, model = models
    ids = tokens(2, 20, seed=2)  # a prompt longer than MAX_QUERY: its prefill is SDPA's
    ids[1, :4] = 0
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, **GREEDY)
        with OpCount() as count:
            out = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(out, expected)
    assert count.decode == (NEW - 1) * 2 and count.sdpa == 2


def test_the_kernel_through_the_model(models):
    """The Triton kernel itself (the interpreter on CPU) inside generate()."""
    if not qfuse.ops.decode_attention.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1")
    ref, model = models
    ids = tokens(1, 5, seed=3)
    greedy = dict(GREEDY, max_new_tokens=3)
    with torch.no_grad(), qfuse.use_backend("triton"):
        out = model.generate(ids, **greedy)
    with torch.no_grad():
        assert torch.equal(out, ref.generate(ids, **greedy))


def _layer_call(model, Sq, L, mask, **kwargs):
    layer = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, Sq, 4, 16, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 2, 2, L, 16, generator=g).unbind(0)
    with OpCount() as count:
        out, _ = attention.qfuse_attention_forward(layer, q, k, v, mask, scaling=0.25, **kwargs)
    expected, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    return count.decode


def test_what_is_not_decode_sized_goes_to_sdpa(models):
    _, model = models
    keep = torch.ones(2, 1, 3, 20, dtype=torch.bool).tril(diagonal=17)
    assert _layer_call(model, 1, 20, None) == 1  # one query: SDPA is not causal either
    assert _layer_call(model, 3, 20, keep) == 1
    assert _layer_call(model, 3, 20, keep[:, :, :, :1]) == 1  # broadcast over keys
    assert _layer_call(model, 3, 3, None) == 0  # no mask, several queries: causal, SDPA's
    assert _layer_call(model, 20, 20, None) == 0  # prefill
    assert _layer_call(model, 3, 20, keep, dropout=0.0, output_attentions=True) == 0
    with pytest.raises(RuntimeError, match="must match"):  # SDPA's own error, not a guess
        _layer_call(model, 3, 20, keep[:, :, :2])
    bias = torch.zeros(1, 4, 3, 20)
    assert _layer_call(model, 3, 20, None, position_bias=bias) == 0


def test_traceable_with_fullgraph(models):
    """Dynamo traces the dispatch decision and the op call without a graph break."""
    _, model = models
    layer = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 4, 16, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 2, 2, 20, 16, generator=g).unbind(0)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[..., 15:] = False

    def step(q, k, v, mask):
        return attention.qfuse_attention_forward(layer, q, k, v, mask, scaling=0.25,
                                                 position_ids=None)[0]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, mask),
                               sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)[0],
                               rtol=1e-5, atol=1e-5)


def test_eager_and_disabled_models_are_left_alone(models, monkeypatch):
    eager = llama("eager")
    assert not attention.install(eager) and eager.config._attn_implementation == "eager"
    monkeypatch.setenv("QFUSE_DECODE_ATTENTION", "0")
    plain = llama()
    assert not attention.install(plain) and plain.config._attn_implementation == "sdpa"
    switched = llama()
    monkeypatch.delenv("QFUSE_DECODE_ATTENTION")
    assert attention.install(switched)
    monkeypatch.setenv("QFUSE_DECODE_ATTENTION", "0")
    assert not attention.install(switched) and switched.config._attn_implementation == "sdpa"


def test_converted_model_saved_and_loaded_keeps_it(tmp_path):
    """convert(output="model") attaches qfuse's quantizer, which installs the attention; the
    saved config does not carry it, loading through the quantizer installs it again."""
    model = llama()
    ids = tokens(2, 7, seed=4)
    example = {"input_ids": ids}
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_dynamic(), (), example_kwargs=example,
                             dynamic_shapes={"input_ids": {}})
    prepared(**example)
    qmodel = qfuse.convert(prepared, output="model")
    assert qmodel.config._attn_implementation == "qfuse"
    qmodel.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "qfuse"
    with torch.no_grad(), OpCount() as count:
        out = loaded.generate(ids[:1], **dict(GREEDY, max_new_tokens=3))
    assert count.decode == 2 * 2
    with torch.no_grad():
        assert torch.equal(out, qmodel.generate(ids[:1], **dict(GREEDY, max_new_tokens=3)))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_generate_static_cache_compiled(batch):
    """On CUDA, generate() with a static cache compiles its decode step (fullgraph): the kernel
    inside the compiled step gives the SDPA model's tokens (float32, so no rounding tie flips a
    greedy choice)."""
    ref = llama().cuda()
    model = llama().cuda()
    model.load_state_dict(ref.state_dict())
    assert attention.install(model)
    ids = tokens(batch, 20, seed=6).cuda()
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    greedy = dict(GREEDY, max_new_tokens=12)
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, **greedy)
        out = model.generate(ids, attention_mask=mask, **greedy)
    assert torch.equal(out, expected)


def test_registration_waits_for_transformers_interfaces(monkeypatch):
    """qfuse's quantizer hook runs inside transformers.modeling_utils' own import (transformers
    5.17), before AttentionInterface exists there: registering then reports False instead of
    failing the import (which would lose the quantizer too), and a later import registers."""
    import sys
    import types

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from qfuse.integrations import attention

    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._global_mapping, attention.NAME)
    partial = types.ModuleType("transformers.modeling_utils")  # mid-import: no interface yet
    real = sys.modules["transformers.modeling_utils"]
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", partial)
    assert attention.register() is False
    retry = attention._RetryRegister()
    assert retry.find_spec("json", None) is None and not retry.done
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", real)
    assert retry.find_spec("json", None) is None and retry.done  # registered, finds nothing
    assert ALL_ATTENTION_FUNCTIONS._global_mapping[attention.NAME] is (
        attention.qfuse_attention_forward)
