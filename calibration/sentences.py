"""English sentences for calibrating and evaluating the MiniLM sentence-embedding recipe.

Two disjoint sets, one sentence per line in ``calibration/data/`` (UTF-8): ``calibration``
(348) feeds the observers, ``heldout`` (185) measures the quantized model, so the reported
quality is never measured on data the scales were fitted to. The sentences were written by the
qfuse developers for this purpose (see calibration/README.md): varied topics, lengths (3 to 60
words), questions, numbers, names, code, typos and all-caps shouting, so that activation ranges
see the spread of inputs a general-purpose embedding model gets.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"


def _read(name: str) -> list[str]:
    return (DATA_DIR / name).read_text(encoding="utf-8").splitlines()


def calibration_sentences() -> list[str]:
    """The sentences to run through a prepared model before ``qfuse.convert``.

    Example:
        >>> sentences = calibration_sentences()
        >>> len(sentences), sentences[0][:40]
        (348, 'The mitochondria produce most of the che')
    """
    return _read("sentences_calibration.txt")


def heldout_sentences() -> list[str]:
    """Sentences for evaluating the quantized model; none of them is in the calibration set.

    Example:
        >>> held = heldout_sentences()
        >>> len(held), set(held).isdisjoint(calibration_sentences())
        (185, True)
    """
    return _read("sentences_heldout.txt")
