"""Single kernels and GEMM chains against cuBLAS, cuDNN, torch and the previous qfuse path."""
