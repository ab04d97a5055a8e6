"""Where the layers above the flows hook in: ``AFTER_SWAP`` holds callables run on every model
``convert(..., output="model")`` returns (``qfuse.integrations`` registers transformers'
quantizer and decode graphs there). A module of its own so that registering costs no import of
the flows themselves (``import qfuse`` registers, and loads the flows only when used)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

AFTER_SWAP: list[Callable[[nn.Module], None]] = []
