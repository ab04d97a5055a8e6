"""Schedule search (the tuned tables in qfuse.kernels) and cost models checked by measurement."""
