"""One graph pipeline for ``prepare``, ``prepare_qat``, ``convert``, QAT's lowering and ``load``:
the passes registered once (``passes``), run from one ``PipelineOptions`` (``options``) by
``run_capture`` / ``run_fused`` (``run``)."""

from qfuse.pipeline.options import PIPELINE_VERSION, PipelineOptions, resolve_options
from qfuse.pipeline.passes import CAPTURE, FUSED, PASSES, GraphPass, PassContext, register
from qfuse.pipeline.run import StageRun, mismatches, run_capture, run_fused

__all__ = [
    "CAPTURE",
    "FUSED",
    "PASSES",
    "PIPELINE_VERSION",
    "GraphPass",
    "PassContext",
    "PipelineOptions",
    "StageRun",
    "mismatches",
    "register",
    "resolve_options",
    "run_capture",
    "run_fused",
]
