"""Calibration-time algorithms that change weights or scales before ``convert``: SmoothQuant's
activation-to-weight scale migration (``smoothquant``), AWQ's activation-aware scales and clips
for 4-bit weights (``awq``) and GPTQ's error-compensating weight rounding (``gptq``). Each is a
transform over the per-layer plan (``qfuse.flows.plan``)."""
