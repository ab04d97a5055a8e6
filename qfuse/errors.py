"""The typed errors qfuse raises. Every message names the layer (where there is one) and the fix."""


class QFuseError(Exception):
    """Base class of every error qfuse raises on purpose."""


class CalibrationError(QFuseError):
    """Observers saw no data, bad data (NaN/Inf) or a degenerate range."""


class CaptureError(QFuseError):
    """The model could not be captured as a graph."""


class UnsupportedError(QFuseError):
    """A dtype, layer, option or backend that qfuse does not implement."""


class BackendError(QFuseError):
    """A backend was forced where it cannot run (e.g. Triton on CPU without the interpreter)."""


class ShapeError(QFuseError):
    """A runtime input does not match what the quantized layer was built for."""


class FormatError(QFuseError):
    """A saved qfuse file is unreadable, from a newer format version or does not match the model."""


class ModeError(QFuseError):
    """The model is in the wrong train/eval mode for this step (QAT trains in train mode,
    converts in eval mode)."""


class GraphMismatchError(QFuseError):
    """A graph pass recorded one rewrite and its replay found another (QAT's train-mode graph vs
    the eval-mode graph convert captures)."""


class DeviceError(QFuseError):
    """An input on another device than the model (or on ``meta``, which holds no data)."""


class WeightsError(FormatError):
    """A checkpoint (safetensors shards) that does not hold what the prepared model needs: a
    missing key, another shape or dtype, or a path with no safetensors files."""
