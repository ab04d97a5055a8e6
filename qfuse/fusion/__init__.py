"""Fusible chains as data, the matcher that finds them, and graph passes (BatchNorm folding)."""
