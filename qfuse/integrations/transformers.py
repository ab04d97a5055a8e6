"""transformers' ``save_pretrained`` / ``from_pretrained`` for ``convert(output="model")`` results.

qfuse registers a transformers quantizer, ``quant_method="qfuse"``. A converted
``PreTrainedModel`` carries it (``model.hf_quantizer``), so ``save_pretrained`` writes the
quantized buffers under the model's own names (``...q_proj.merged.weight`` is int8) and records in
``config.json`` the scheme (``QConfig.to_dict()``) and, per swapped module path, what was put there
(``qfuse.integrations.layout``). ``from_pretrained`` reads that record, builds the float skeleton,
swaps the same qfuse modules in before the weights are read (as transformers' torchao and fbgemm
quantizers do), loads their buffers, and returns the quantized model running qfuse's kernels,
bit for bit the one that was saved. ``import qfuse`` registers the quantizer (when transformers
is imported, before or after qfuse).

Example:
    >>> import tempfile, torch, qfuse, transformers
    >>> config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=64, vocab_size=64)
    >>> model = transformers.BertModel(config, add_pooling_layer=False).eval()
    >>> ids = torch.randint(0, 64, (2, 8))
    >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (), {"input_ids": ids})
    >>> _ = prepared(input_ids=ids)
    >>> qmodel = qfuse.convert(prepared, output="model")
    >>> path = tempfile.mkdtemp()
    >>> qmodel.save_pretrained(path)
    >>> loaded = transformers.AutoModel.from_pretrained(path)
    >>> type(loaded).__name__, type(loaded.encoder.layer[0].output.dense).__name__
    ('BertModel', 'SwappedQLinear')
    >>> out = loaded(input_ids=ids).last_hidden_state
    >>> torch.equal(out, qmodel(input_ids=ids).last_hidden_state)
    True
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from qfuse._version import __version__
from qfuse.config import QConfig
from qfuse.errors import FormatError, QFuseError
from qfuse.fusion.patterns import Skipped
from qfuse.integrations import attention as qfuse_attention
from qfuse.integrations import decode_graphs
from qfuse.integrations.layout import LAYOUT_VERSION, describe, finish, rebuild
from qfuse.state import LayerRecord, QFuseState, get_state, set_state

QUANT_METHOD = "qfuse"


class QFuseConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a qfuse model in ``config.json``: the scheme, the swapped
    modules' layout, and what ``qfuse.summary`` reports per layer."""

    def __init__(self, config: dict | None = None, modules: dict | None = None,
                 layers: list | None = None, skipped: list | None = None,
                 folded_batchnorms: list | None = None, layout_version: int = LAYOUT_VERSION,
                 qfuse_version: str = "", quant_method: str = QUANT_METHOD, **unused) -> None:
        self.quant_method = quant_method
        self.layout_version = layout_version
        self.qfuse_version = qfuse_version
        self.config = config or {}
        self.modules = modules or {}
        self.layers = layers or []
        self.skipped = skipped or []
        self.folded_batchnorms = folded_batchnorms or []

    @classmethod
    def of(cls, model) -> QFuseConfig:
        """The record of converted ``model`` (``QFuseError`` if a swapped module cannot be
        described)."""
        state = get_state(model)
        if state is None or state.stage != "converted":
            raise QFuseError(
                f"save_pretrained: {type(model).__name__} carries qfuse's quantizer but no "
                "qfuse record; convert it with qfuse.convert(prepared, output='model')."
            )
        return cls(
            config=state.config.to_dict(),
            modules=describe(model),
            layers=[dataclasses.asdict(r) for r in state.layers],
            skipped=[dataclasses.asdict(s) for s in state.skipped],
            folded_batchnorms=list(state.folded_batchnorms),
            qfuse_version=__version__,
        )

    def state(self) -> QFuseState:
        """The qfuse record a loaded model carries (for ``qfuse.summary`` and a later save)."""
        return QFuseState(
            config=QConfig.from_dict(self.config),
            stage="converted",
            chains=[],
            skipped=[Skipped(**s) for s in self.skipped],
            layers=[LayerRecord(**r) for r in self.layers],
            folded_batchnorms=list(self.folded_batchnorms),
        )


class QFuseHfQuantizer(HfQuantizer):
    """Loads (and saves) models quantized by ``qfuse.convert(output="model")``; it quantizes
    nothing itself: calibrate with ``qfuse.prepare`` first."""

    requires_calibration = True

    def validate_environment(self, *args, **kwargs) -> None:
        version = self.quantization_config.layout_version
        if version > LAYOUT_VERSION:
            raise FormatError(
                f"this model's qfuse quantization_config has layout_version {version}; this "
                f"qfuse reads up to {LAYOUT_VERSION}. Upgrade qfuse to load it."
            )

    def _process_model_before_weight_loading(self, model, **kwargs):
        modules = self.quantization_config.modules
        rebuild(model, modules)
        # A swapped layer holds its own quantized weight: tying it to the float embedding again
        # (GPT-2's lm_head) would replace the int8 buffer by the float parameter.
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        for target in [t for t, s in tied.items() if _under(t, modules) or _under(s, modules)]:
            tied.pop(target)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        finish(model, self.quantization_config.modules)
        set_state(model, self.quantization_config.state())
        decode_graphs.install(model)
        qfuse_attention.install(model)
        return model

    def get_state_dict_and_metadata(self, model):
        """The record goes into ``model.config`` (written after this) and the state dict gets
        a copy of any tensor two qfuse buffers share (a dynamic layer's ``scale`` is its
        ``weight_scale``): safetensors refuses shared storage, and transformers only resolves
        ties it declared."""
        self.quantization_config = QFuseConfig.of(model)
        model.config.quantization_config = self.quantization_config
        state_dict = model.state_dict()
        modules = self.quantization_config.modules
        seen = {_storage(t) for n, t in state_dict.items() if not _under(n, modules)}
        for name, tensor in state_dict.items():
            if _under(name, modules):
                key = _storage(tensor)
                if key in seen:
                    state_dict[name] = tensor.clone()
                seen.add(key)
        return state_dict, {}

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # every quantized tensor is read from the checkpoint as saved

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _under(name: str, modules: dict) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in modules for i in range(1, len(parts)))


def _storage(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


def attach(model) -> None:
    """Give a converted ``PreTrainedModel`` qfuse's quantizer, so that ``save_pretrained``
    writes what ``from_pretrained`` rebuilds (or refuses, naming the module it cannot), and
    ``generate()`` its decode graphs (``decode_graphs``)."""
    from transformers import PreTrainedModel  # not at import: modeling_utils imports us

    if isinstance(model, PreTrainedModel):
        model.hf_quantizer = QFuseHfQuantizer(QFuseConfig(), pre_quantized=True)
        decode_graphs.install(model)
        qfuse_attention.install(model)


def register() -> None:
    """Register ``quant_method="qfuse"`` with transformers (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(QFuseConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(QFuseHfQuantizer)


register()
