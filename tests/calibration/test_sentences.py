"""The MiniLM calibration and held-out sentence sets: sizes, variety and no leakage."""

import pytest
from qfuse.calibration.sentences import calibration_sentences, heldout_sentences

SETS = {"calibration": (calibration_sentences, 300), "heldout": (heldout_sentences, 150)}


@pytest.mark.parametrize("name", SETS)
def test_enough_clean_sentences(name):
    load, minimum = SETS[name]
    sentences = load()
    assert len(sentences) >= minimum
    for s in sentences:
        assert s and s == s.strip() and "  " not in s, repr(s)
        assert 3 <= len(s.split()) <= 60, repr(s)


@pytest.mark.parametrize("name", SETS)
def test_no_duplicates_within_a_set(name):
    sentences = [s.casefold() for s in SETS[name][0]()]
    duplicates = sorted({s for s in sentences if sentences.count(s) > 1})
    assert duplicates == []


def test_no_sentence_in_both_sets():
    calibration = {s.casefold() for s in calibration_sentences()}
    assert [s for s in heldout_sentences() if s.casefold() in calibration] == []


@pytest.mark.parametrize("name", SETS)
def test_sets_vary_in_form(name):
    sentences = SETS[name][0]()
    lengths = [len(s.split()) for s in sentences]
    assert min(lengths) <= 4 and max(lengths) >= 40
    assert sum(s.endswith("?") for s in sentences) >= 0.08 * len(sentences)
    assert sum(any(c.isdigit() for c in s) for s in sentences) >= 0.08 * len(sentences)
    assert any(s.isupper() for s in sentences)  # shouted text reaches the observers too
