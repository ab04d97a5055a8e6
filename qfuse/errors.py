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


def check_version(
    version, newest: int, what: str, error: type[QFuseError] = QFuseError, written_by: str = ""
) -> int:
    """``version`` when this qfuse reads it (an int from 1 to ``newest``), else ``error``.

    One rule for everything qfuse writes with a version and reads back (the ``.safetensors``
    metadata, ``PipelineOptions``): a newer version may have changed a field's meaning, so it is
    refused rather than misread. ``what`` names the field in the message, ``written_by`` (e.g.
    ``" (written by qfuse 0.3)"``) follows the version.

    Example:
        >>> check_version(2, 2, "format_version")
        2
        >>> check_version(3, 2, "format_version")
        Traceback (most recent call last):
        ...
        qfuse.errors.QFuseError: format_version 3 is newer than this qfuse reads (2). Upgrade ...
    """
    if not isinstance(version, int) or version < 1:
        raise error(
            f"{what} {version!r} is not a valid version: it was not written by qfuse or is "
            "corrupted. Re-save it."
        )
    if version > newest:
        raise error(
            f"{what} {version}{written_by} is newer than this qfuse reads ({newest}). Upgrade "
            "qfuse to read it."
        )
    return version
