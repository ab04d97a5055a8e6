"""The flows a user drives: ``prepare`` (capture, fold, observe), ``plan`` (per-layer scales and
weights from what calibration saw), ``convert`` (the fused graph) and ``swap`` (the user's own
model with quantized layers in place, ``output="model"``), both built by ``build``; ``qat``
(fake-quant training that converts through the same path)."""
