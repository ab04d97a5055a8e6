"""Quantized convolutions on channels-last: ``implicit`` (implicit GEMM, and the dispatcher),
``tma`` (1×1 convolutions as TMA GEMMs), ``depthwise``, ``stem`` (7×7 patches gathered from the
float input) and ``im2col``."""
