"""Triton kernels only. Nothing here imports torch.nn or qfuse modules above ``kernels``."""
