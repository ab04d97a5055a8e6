"""Calibration and evaluation data the recipes use (see calibration/README.md for provenance)."""
