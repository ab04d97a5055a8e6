"""``skip_full_masks``: a converted encoder passes SDPA no mask in plain eager calls when every
position is kept, and the boolean mask everywhere else, with the same outputs either way."""

import pytest
import torch

import qfuse
from qfuse.ops.attention import attention_quant_call, drop_full_mask
from tests.models import tiny_bert, token_batch

transformers = pytest.importorskip("transformers")


def _bert():
    return tiny_bert(2)


def _inputs(pad: bool, seed: int = 0):
    return token_batch(seed, pad)


@pytest.fixture(scope="module")
def converted():
    model = _bert()
    dyn = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), example_kwargs=_inputs(True),
                             dynamic_shapes={"input_ids": dyn, "attention_mask": dyn})
    for seed in range(3):
        prepared(**_inputs(seed % 2 == 0, seed))
    return model, qfuse.convert(prepared)


def test_every_attention_reads_one_shared_dropped_mask(converted):
    _, gm = converted
    drops = [n for n in gm.graph.nodes if n.target is drop_full_mask]
    sdpa = [n for n in gm.graph.nodes  # SDPA, or the attention fused with its quantize
            if n.target in (torch.ops.aten.scaled_dot_product_attention.default,
                            attention_quant_call)]
    assert len(drops) == 1 and len(sdpa) == 2
    assert all(drops[0] in n.all_input_nodes for n in sdpa)


@pytest.mark.parametrize("pad", [False, True], ids=["full", "padded"])
def test_outputs_equal_the_masked_call(converted, pad):
    """Dropping an all-ones mask changes which SDPA kernel runs, not what it computes; a padded
    batch keeps its mask."""
    import copy

    _, gm = converted
    inputs = _inputs(pad, seed=7)
    masked = copy.deepcopy(gm)  # the same graph with every mask kept
    for node in list(masked.graph.nodes):
        if node.target is drop_full_mask:
            node.replace_all_uses_with(node.args[0])
            masked.graph.erase_node(node)
    masked.recompile()
    full = inputs["attention_mask"].bool()[:, None, None, :].expand(2, 1, 9, 9)
    assert (drop_full_mask(full) is None) == (not pad)
    with torch.no_grad():
        out, ref = gm(**inputs)[0], masked(**inputs)[0]
    # another SDPA kernel rounds differently; a requantized int8 code may flip at a tie
    assert float((out - ref).norm() / ref.norm()) < 1e-3


def test_traced_and_compiled_calls_keep_the_mask():
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    traced = torch.jit.trace(lambda m: drop_full_mask(m).logical_not(), (mask,),
                             check_trace=False)
    assert traced(mask).shape == mask.shape
    compiled = torch.compile(lambda m: drop_full_mask(m), backend="eager", fullgraph=True)
    assert compiled(mask) is not None
    assert drop_full_mask(mask.float()) is not None  # float masks are the caller's own
