"""The fused quantized GEMM: ``dispatch`` (picks a family and schedule, launches), the families
(``mma``: tensor-core tiles; ``decode``: weight streaming for a few rows; ``tma``: host-side
tensor descriptors), ``eager`` (cached launches without the dispatcher) and ``opaque`` (launches
``torch.compile`` cannot express through ``wrap_triton``)."""
