"""Diagnostics: where a number comes from (profiles, host time, error growth, register use)."""
