"""qfuse.fileio: atomic writes (all or nothing on disk) and the cache directory."""

import doctest
import os
import warnings

import pytest

import qfuse.fileio as atomic
from qfuse.errors import QFuseError
from qfuse.fileio import atomic_path


def test_success_moves_the_temp_file_onto_the_target(tmp_path):
    target = tmp_path / "model.pt2"
    with atomic_path(target) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)  # same directory: os.replace is atomic
        assert tmp.endswith(".pt2") and os.path.basename(tmp).startswith(".model.pt2.")
        assert not os.path.exists(tmp)  # the writer creates it
        with open(tmp, "wb") as f:
            f.write(b"new")
        assert not target.exists()  # nothing visible until the block ends
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["model.pt2"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failure_midway_keeps_the_old_file_and_removes_the_temp(tmp_path, error):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(type(error)):
        with atomic_path(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise error
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_failure_before_anything_was_written(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "m.ts"):
            raise RuntimeError("tracing failed")
    assert not os.listdir(tmp_path)


def test_a_missing_directory_is_created_and_a_directory_refused(tmp_path):
    with atomic_path(tmp_path / "no" / "such" / "m.ts") as tmp:  # issue 23: save into a new dir
        open(tmp, "wb").close()
    assert (tmp_path / "no" / "such" / "m.ts").is_file()
    with pytest.raises(QFuseError, match="is a folder"):
        with atomic_path(tmp_path / "no") as tmp:
            open(tmp, "wb").close()


def test_docstring_examples():
    assert doctest.testmod(atomic).failed == 0


def test_one_cache_directory_for_tuning_and_routing(tmp_path, monkeypatch):
    from qfuse.analysis.routing import CostModel
    from qfuse.fileio import cache_dir
    from qfuse.kernels import tuning

    monkeypatch.delenv("QFUSE_CACHE", raising=False)
    monkeypatch.setenv("QFUSE_CACHE_DIR", str(tmp_path / "new"))
    assert cache_dir() == str(tmp_path / "new")
    assert os.path.dirname(tuning._cache_path()) == str(tmp_path / "new")
    assert str(CostModel.cache_path("NVIDIA H200").parent) == str(tmp_path / "new")
    assert CostModel(measured={"k": 1.0}).save("NVIDIA H200").exists()
    assert os.listdir(tmp_path / "new") == ["costs-NVIDIA_H200.json"]  # no temp file left


def test_the_old_cache_variable_warns_and_names_the_new_one(tmp_path, monkeypatch):
    from qfuse.fileio import cache_dir

    monkeypatch.delenv("QFUSE_CACHE_DIR", raising=False)
    monkeypatch.setenv("QFUSE_CACHE", str(tmp_path / "old"))  # the routing cache's older name
    with pytest.warns(FutureWarning, match="QFUSE_CACHE_DIR.*read for now"):
        assert cache_dir() == str(tmp_path / "old")  # honoured while the new one is unset
    monkeypatch.setenv("QFUSE_CACHE_DIR", str(tmp_path / "new"))
    with pytest.warns(FutureWarning, match="ignored: QFUSE_CACHE_DIR is set"):
        assert cache_dir() == str(tmp_path / "new")
    monkeypatch.setenv("QFUSE_CACHE", str(tmp_path / "new"))  # the same folder: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache_dir() == str(tmp_path / "new")
