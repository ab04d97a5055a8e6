"""qfuse's attention for transformers models: decode steps through ``qfuse::decode_attention``.

transformers' SDPA attention copies the whole static KV cache G = H // Hkv times per layer and
decode step (``repeat_kv``: with a mask present, SDPA's own GQA path would fall back to its math
kernel), then runs a masked SDPA over the copy. ``qfuse::decode_attention`` reads the
[B, Hkv, L, D] cache in place for all G query heads of a kv head.

``install(model)`` switches a model whose attention is ``"sdpa"`` to ``"qfuse"``: the function
below, registered in transformers' ``AttentionInterface``, with ``sdpa_mask`` registered under the
same name in ``AttentionMaskInterface`` so the model builds the masks it builds for SDPA. A call
goes to the kernel when it is a decode-sized call the kernel computes exactly as SDPA would:
at most ``MAX_QUERY`` query positions, no dropout, no autograd, no ``output_attentions``,
``position_bias``, ``softcap`` or attention sinks, equal key and value head dims up to 256, a
mask that is None (one query position: SDPA is not causal there either), boolean or additive and
broadcastable to [B, H, Sq, L]. Every other call (prefill above all) goes to transformers'
``sdpa_attention_forward`` unchanged.

``QFUSE_DECODE_ATTENTION=0``: ``install`` leaves (or puts) the model on ``"sdpa"``.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from qfuse.kernels.attention.decode import DTYPES, MAX_HEAD_DIM, MAX_ROWS
from qfuse.ops import decode_attention as _op  # noqa: F401 - registers qfuse::decode_attention

NAME = "qfuse"
MAX_QUERY = 16
# Keyword arguments that change the math when set; SDPA ignores the others (the mask already
# holds a sliding window, for one).
_MATH_KWARGS = ("softcap", "s_aux", "sinks", "head_mask", "attention_bias", "alibi")


def enabled() -> bool:
    """False when ``QFUSE_DECODE_ATTENTION=0``."""
    return os.environ.get("QFUSE_DECODE_ATTENTION", "1") != "0"


def _decode_call(query, key, value, attention_mask, dropout, is_causal, position_bias,
                 kwargs) -> bool:
    """Whether ``qfuse::decode_attention`` computes this call as SDPA would."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    B, H, Sq, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    if (
        Sq > MAX_QUERY or dropout != 0.0 or position_bias is not None
        or kwargs.get("output_attentions", False)
        or any(kwargs.get(name) is not None for name in _MATH_KWARGS)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
        or key.shape[0] != B or tuple(value.shape[:3]) != (B, Hkv, L)
        or key.shape[3] != D or value.shape[3] != D or D > MAX_HEAD_DIM
        or Hkv == 0 or H % Hkv != 0 or (H // Hkv) * Sq > MAX_ROWS
        or query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
        or key.device != query.device or value.device != query.device
    ):
        return False
    if attention_mask is None:
        # SDPA applies a causal mask to a longer query with no mask: left to it.
        return Sq == 1 or is_causal is False
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() > 4
            or attention_mask.device != query.device
            or not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point())):
        return False
    full = (B, H, Sq, L)[4 - attention_mask.dim():]
    return all(m in (1, f) for m, f in zip(attention_mask.shape, full, strict=True))


def qfuse_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                            scaling=None, is_causal=None, position_bias=None, **kwargs):
    """``sdpa_attention_forward``'s signature and result, (out [B, Sq, H, D], None): decode
    calls through ``qfuse::decode_attention``, the rest through SDPA."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if _decode_call(query, key, value, attention_mask, dropout, causal, position_bias, kwargs):
        out = torch.ops.qfuse.decode_attention(query, key, value, attention_mask, scaling)
        return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal,
                                  position_bias=position_bias, **kwargs)


def register() -> bool:
    """Register ``"qfuse"`` in transformers' attention and mask interfaces (idempotent).
    False while transformers cannot give them yet: qfuse's quantizer hook runs inside
    ``transformers.modeling_utils``' own import, before that module defines
    ``AttentionInterface`` (``_RetryRegister`` then registers on a later import)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    masking_utils = sys.modules.get("transformers.masking_utils")
    if modeling_utils is None or masking_utils is None:
        import transformers.masking_utils
        import transformers.modeling_utils

        modeling_utils, masking_utils = transformers.modeling_utils, transformers.masking_utils
    interface = getattr(modeling_utils, "AttentionInterface", None)
    masks = getattr(masking_utils, "AttentionMaskInterface", None)
    sdpa_mask = getattr(masking_utils, "sdpa_mask", None)
    if interface is None or masks is None or sdpa_mask is None:
        return False
    interface.register(NAME, qfuse_attention_forward)
    masks.register(NAME, sdpa_mask)
    return True


class _RetryRegister(importlib.abc.MetaPathFinder):
    """Retries ``register`` at each later import until it succeeds, then does nothing (it
    stays in ``sys.meta_path``: removing a finder while the import system walks that list
    would skip the next one). Finds no module itself."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, fullname, path, target=None):
        if not self.done:
            self.done = True  # a nested import inside register() must not re-enter
            try:
                self.done = register()
            except ImportError:
                self.done = False
        return None


def install(model) -> bool:
    """Switch ``model`` (a transformers ``PreTrainedModel``) from ``"sdpa"`` attention to
    ``"qfuse"``. Returns whether it runs qfuse's attention now; eager, flash and flex models
    and models that cannot switch are left as they are; ``QFUSE_DECODE_ATTENTION=0`` leaves
    SDPA (and switches a model installed earlier back to it).

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        ...     vocab_size=64, attn_implementation="sdpa")
        >>> model = transformers.LlamaForCausalLM(config)
        >>> install(model), model.config._attn_implementation
        (True, 'qfuse')
    """
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if not callable(getattr(model, "set_attn_implementation", None)) or not register():
        return False
    if not enabled():
        if current == NAME:  # switched earlier (a pickled model): back to transformers' SDPA
            model.set_attn_implementation("sdpa")
        return False
    if current == NAME:
        return True
    if current != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME


# A pickled or saved model may carry "qfuse" in its config: registered whenever qfuse's
# transformers integration loads (it imports this module), or on the next import after that
# when transformers was still defining its interfaces.
if not register():
    sys.meta_path.append(_RetryRegister())
