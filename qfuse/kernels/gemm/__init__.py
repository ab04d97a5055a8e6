"""The fused quantized GEMM: ``call`` (a layer's call, described once), ``dispatch`` (picks a
family and schedule, launches), ``kernel`` (the one kernel) and its families' main loops
(``mma``: tensor-core tiles; ``decode``: weight streaming for a few rows; ``tma``: host-side
tensor descriptors), ``eager`` (cached launches without the dispatcher) and ``opaque`` (launches
``torch.compile`` cannot express through ``wrap_triton``)."""
