"""Attention kernels: ``encoder`` (flash attention writing the next layer's int8/fp8 input) and
``decode`` (flash-decoding over the GQA static cache); both share one online-softmax tile step."""
