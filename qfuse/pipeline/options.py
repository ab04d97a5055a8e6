"""``PipelineOptions``: which graph passes run, as one frozen, validated, versioned object.

``qfuse.prepare`` / ``qfuse.prepare_qat`` build it (``merge_siblings=`` and ``pipeline=``),
``qfuse.convert`` finishes it (``fuse_norms=`` / ``fuse_pools=``), ``qfuse.save`` writes it into
the file and the QAT record keeps it, and ``qfuse.load`` and QAT's lowering run exactly it again.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from qfuse.errors import UnsupportedError, check_version

PIPELINE_VERSION = 1


@dataclass(frozen=True)
class PipelineOptions:
    """The optional graph passes (``qfuse.pipeline.PASSES`` lists every pass, with its option).

    ``merge_gated``: the gate and up projections of a gated MLP become one layer with a gated
    epilogue (``fusion.gated``). ``merge_siblings``: Linears that read one input and end there
    (Q, K, V) become one layer (``fusion.siblings``). ``fuse_pools``: a conv read only through a
    max-pool by fused convs requantizes for them and the pool runs on int8/fp8
    (``fusion.pool_quant``). ``fuse_norms``: a LayerNorm / RMSNorm read by static quantized layers
    quantizes its output for them in the same kernel (``fusion.norm_quant``). ``fuse_attention``:
    an encoder's SDPA read by a static quantized Linear writes that Linear's int8/fp8 input
    (``fusion.attention_quant``).

    Example:
        >>> import qfuse
        >>> opts = qfuse.PipelineOptions(fuse_norms=False)
        >>> sorted(k for k, v in opts.to_dict().items() if v is True)
        ['fuse_attention', 'fuse_pools', 'merge_gated', 'merge_siblings']
        >>> qfuse.PipelineOptions.from_dict(opts.to_dict()) == opts
        True
    """

    merge_gated: bool = True
    merge_siblings: bool = True
    fuse_pools: bool = True
    fuse_norms: bool = True
    fuse_attention: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise UnsupportedError(f"PipelineOptions.{f.name}={value!r}: give True or False.")

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"version": PIPELINE_VERSION, **values}

    @classmethod
    def from_dict(cls, data: dict) -> PipelineOptions:
        """The options of ``to_dict``; options a version-1 dict lacks take their defaults."""
        data = dict(data)
        check_version(
            data.pop("version", None), PIPELINE_VERSION, "PipelineOptions version", UnsupportedError
        )
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise UnsupportedError(
                f"PipelineOptions has no options {unknown}; known: {[f.name for f in fields(cls)]}."
            )
        return cls(**data)


def resolve_options(
    pipeline: PipelineOptions | None, merge_siblings: bool | None
) -> PipelineOptions:
    """The options of ``prepare(..., merge_siblings=..., pipeline=...)``: ``merge_siblings``
    switches both merges (gate/up and Q/K/V); None leaves ``pipeline`` (default: every pass)."""
    if pipeline is not None and not isinstance(pipeline, PipelineOptions):
        raise UnsupportedError(
            f"pipeline must be a qfuse.PipelineOptions, got {type(pipeline).__name__}."
        )
    options = pipeline or PipelineOptions()
    if merge_siblings is None:
        return options
    if not isinstance(merge_siblings, bool):
        raise UnsupportedError(f"merge_siblings={merge_siblings!r}: give True or False.")
    merged = replace(options, merge_gated=merge_siblings, merge_siblings=merge_siblings)
    if pipeline is not None and merged != pipeline:
        raise UnsupportedError(
            f"merge_siblings={merge_siblings} contradicts pipeline={pipeline}; set the merges in "
            "one place (PipelineOptions(merge_gated=..., merge_siblings=...))."
        )
    return merged
