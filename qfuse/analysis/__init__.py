"""What a converted model is and where its error comes from: ``summary`` (per layer: what ran,
which backend), ``sensitivity`` (per-layer quantization error), ``fallback`` (the fewest float
layers that meet an accuracy budget) and ``routing`` (which layers run faster in bf16)."""
