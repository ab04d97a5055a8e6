"""DecodeGraphs' bookkeeping on the CPU, through transformers' own generate(): a stand-in graph
replays by running the captured call again and writing its output into the captured output
tensors, as a CUDA graph's replay writes into its buffers; the compiled forward is the eager one
(Dynamo's part is the GPU test's, ``test_gpu_generate_tokens_equal``).

What must hold: tokens equal the uncompiled generate(); one warm-up and one capture per input
signature, the rest replays; a replaced weight or a new cache captures again, an in-place weight
update does not; ineligible calls take the fallback; copies and pickles carry no graph."""

import copy
import gc
import pickle
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench.models import generate_parity  # noqa: E402
from qfuse.integrations import decode_graphs  # noqa: E402
from qfuse.integrations.decode_graphs import DecodeGraphs  # noqa: E402

NEW = 6


class _RerunGraph:
    """Capturing ran the call once (a CUDA graph's capture runs nothing, its first replay
    does), so the first replay here has nothing left to do."""

    def __init__(self, fn, out):
        self.fn, self.out, self.ran = fn, out, True

    def replay(self):
        if self.ran:
            self.ran = False
            return
        new = torch.utils._pytree.tree_leaves(self.fn())
        old = torch.utils._pytree.tree_leaves(self.out)
        for o, n in zip(old, new, strict=True):
            if isinstance(o, torch.Tensor) and o is not n:
                o.copy_(n)


class CpuGraphs(DecodeGraphs):
    device_type = "cpu"

    def _compiled_fn(self):
        return self._model().__call__

    def _fallback_fn(self):
        return self._model().__call__

    @staticmethod
    def capture(fn, device):
        out = fn()
        return _RerunGraph(fn, out), out


@pytest.fixture(scope="module")
def qmodel():
    _, model, ids = generate_parity.quantized_llama("int8_dynamic")
    return model, ids[:2]


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              cache_implementation="static", **kw)


def _graphed(model):
    """``model`` with the CPU stand-in installed where transformers looks for its compiled call,
    and a compile config that lets transformers compile on the CPU."""
    runner = CpuGraphs(model)
    model._compiled_call = runner
    config = transformers.CompileConfig()
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    return runner


def test_convert_installs_the_runner(qmodel, monkeypatch):
    model, _ = qmodel
    assert isinstance(model._compiled_call, DecodeGraphs)
    assert model.get_compiled_call(None) is model._compiled_call
    monkeypatch.setenv("QFUSE_DECODE_GRAPHS", "0")
    assert decode_graphs.install(copy.deepcopy(model)) is None


def test_generate_replays_and_matches_eager(qmodel):
    model, ids = qmodel
    model = copy.deepcopy(model)
    expect = _generate(model, ids, disable_compile=True)
    runner = _graphed(model)
    assert torch.equal(_generate(model, ids), expect)
    # decode steps: NEW - 1 calls (the first token comes from the prefill)
    assert runner.stats == {"warm": 1, "capture": 1, "replay": NEW - 2}
    # generate() builds a new static cache each call: warm up and capture again, as
    # torch.compile's CUDA-graph trees re-record for the cache's new addresses
    assert torch.equal(_generate(model, ids), expect)
    assert runner.stats == {"warm": 2, "capture": 2, "replay": 2 * NEW - 4}


def _lockstep(model, runner, ids, steps, edit=None, reference=None):
    """Greedy decode steps through ``runner`` and, beside them on a cache of their own, through
    ``reference`` (the model itself); ``edit(model, step)`` runs before each step. Returns the
    captures taken and whether every step's logits were equal."""
    reference = reference or model
    caches = [transformers.StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    with torch.no_grad():
        toks = [model(input_ids=ids, past_key_values=c, use_cache=True).logits[:, -1:].argmax(-1)
                for c in caches]
        equal = True
        for step in range(steps):
            if edit is not None:
                edit(model, step)
            got = runner(input_ids=toks[0], past_key_values=caches[0], use_cache=True).logits
            ref = reference(input_ids=toks[1], past_key_values=caches[1], use_cache=True).logits
            equal &= torch.equal(got, ref)
            toks = [got[:, -1:].argmax(-1), ref[:, -1:].argmax(-1)]
    return runner.stats["capture"], equal


def test_weights_replaced_capture_again_in_place_does_not(qmodel):
    model, ids = qmodel
    model = copy.deepcopy(model)
    buffers = model.model.layers[0].self_attn.o_proj._buffers  # .weight faces float users

    def in_place(m, step):
        if step == 3:
            buffers["weight"].copy_(torch.flip(buffers["weight"], [0]))  # same tensor

    def replaced(m, step):
        if step == 3:
            buffers["weight"] = torch.flip(buffers["weight"], [0])  # the graph reads the old

    def new_module(m, step):
        if step == 3:
            m.model.layers[1].mlp = copy.deepcopy(m.model.layers[1].mlp)

    assert _lockstep(model, CpuGraphs(model), ids, 6) == (1, True)
    assert _lockstep(model, CpuGraphs(model), ids, 6, in_place) == (1, True)
    assert _lockstep(model, CpuGraphs(model), ids, 6, replaced) == (2, True)
    assert _lockstep(model, CpuGraphs(model), ids, 6, new_module) == (2, True)


def test_graphs_of_dropped_caches_are_dropped(qmodel):
    model, ids = qmodel
    model = copy.deepcopy(model)
    runner = _graphed(model)
    _generate(model, ids)
    (key, entry), = runner._entries.items()

    class Gone:
        pass

    gone = Gone()
    entry.caches = [decode_graphs.weakref.ref(gone)]  # the captured cache, since dropped
    del gone
    assert entry.dead()
    _generate(model, ids)  # a new cache: a new signature, and the dead graph goes
    assert key not in runner._entries and len(runner._entries) == 1
    runner.reset()
    assert not runner._entries


def test_a_graph_holds_its_cache_weakly(qmodel):
    """A graph checks the cache's tensors before a replay but does not keep them: a dropped
    cache's memory (gigabytes on a large model) is freed at once, not at the next capture."""
    model, ids = qmodel
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    entry = decode_graphs._Entry([ids])
    tensors = entry.record(model, [cache])
    assert len(tensors) >= 2 * model.config.num_hidden_layers and entry.valid([cache])
    layer = cache.layers[0]
    layer.keys = layer.keys.clone()  # a cache tensor replaced: the graph would write the old one
    assert not entry.valid([cache])
    probe = weakref.ref(tensors[-1])
    del tensors, layer, cache
    gc.collect()
    assert probe() is None and entry.dead()


def test_ineligible_calls_fall_back(qmodel):
    model, ids = qmodel
    runner = CpuGraphs(model)
    with torch.enable_grad():
        runner(input_ids=ids)
    runner(input_ids=ids, logits_to_keep=slice(-1, None))  # an input that cannot be keyed
    assert runner.stats == {"fallback": 2}


def test_copies_and_pickles_carry_no_graph(qmodel):
    model, ids = qmodel
    model = copy.deepcopy(model)
    _graphed(model)
    _generate(model, ids)
    twin = copy.deepcopy(model)
    assert isinstance(twin._compiled_call, CpuGraphs)
    assert twin._compiled_call._model() is twin and not twin._compiled_call._entries
    # (transformers' models themselves do not pickle: their output-capturing hooks are local)
    small = torch.nn.Linear(2, 2)
    small._compiled_call = CpuGraphs(small)
    back = pickle.loads(pickle.dumps(small))
    assert back._compiled_call._model() is back and not back._compiled_call._entries


def test_mode_without_graphs_uses_the_plain_compile(qmodel, monkeypatch):
    from qfuse.kernels import grid

    model, _ = qmodel
    runner = DecodeGraphs(model, {"backend": "inductor", "mode": "default"})
    assert runner._graphed_options() is None
    runner = DecodeGraphs(model, {"backend": "inductor", "mode": "reduce-overhead",
                                  "fullgraph": True})
    # Inductor's programmatic dependent launch on (``_with_pdl``), unless QFUSE_PDL=0
    assert runner._graphed_options() == {"backend": "inductor", "mode": None, "fullgraph": True,
                                         "options": {"triton.enable_pdl": True}}
    monkeypatch.setattr(grid, "PDL_ENABLED", False)
    assert runner._graphed_options() == {"backend": "inductor", "mode": None, "fullgraph": True}
    monkeypatch.setattr(grid, "PDL_ENABLED", True)
    runner = DecodeGraphs(model, {"backend": "inductor", "mode": "max-autotune"})
    opts = runner._graphed_options()
    assert opts["mode"] is None and opts["options"]["triton.enable_pdl"]
    assert opts["options"]["max_autotune"] and "triton.cudagraphs" not in opts["options"]


@pytest.mark.gpu
def test_gpu_generate_replays_graphs_equal_to_transformers_own(qmodel):
    """Real CUDA graphs: a converted model's generate() replays them (no fallback) and gives
    the tokens and scores of transformers' own compiled decode (CUDA-graph trees), the same
    Inductor kernels; bf16 through ``install`` likewise."""
    from generate_parity import set_exact

    for model in (copy.deepcopy(qmodel[0]), generate_parity.quantized_llama("int8_static")[0]):
        set_exact(model, True)
        model = model.cuda()
        runner = decode_graphs.install(model) if not hasattr(model, "_compiled_call") else (
            model._compiled_call)
        ids = qmodel[1].cuda()
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  cache_implementation="static", return_dict_in_generate=True)
        with torch.no_grad():
            ours = model.generate(ids, **kw)
            assert runner.stats == {"warm": 1, "capture": 1, "replay": 6}, runner.stats
            model.__dict__.pop("_compiled_call")
            torch._dynamo.reset()
            theirs = model.generate(ids, **kw)
        assert torch.equal(ours.sequences, theirs.sequences)
        assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


@pytest.mark.gpu
def test_gpu_replaced_weight_is_not_read_from_the_old_address(qmodel):
    """With real graphs a stale capture reads the old weight's memory: the replaced weight must
    make the next call capture again, and the logits follow the new weight."""
    model = copy.deepcopy(qmodel[0]).cuda()
    buffers = model.model.layers[0].self_attn.o_proj._buffers

    def replaced(m, step):
        if step == 3:
            buffers["weight"] = torch.flip(buffers["weight"], [0])

    runner = DecodeGraphs(model)
    plain = torch.compile(model.__call__)  # the same Inductor kernels, no graphs
    assert _lockstep(model, runner, qmodel[1].cuda(), 6, replaced, plain) == (2, True)
