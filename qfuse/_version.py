"""The package version, for the modules that record it in what they write (one place)."""

__version__ = "0.1.0"
