"""Per-stage checkpoints of a sequential calibration, so an interrupted run resumes where it
stopped.

``<dir>/manifest.json`` names the stages and the batch count; ``<dir>/stage-NNN.pt`` holds one
finished stage: its recorders' state dicts and GPTQ's cached results (compact: grid codes). Every
file is written to a temp name and renamed, so a file that exists is complete. GPTQ's input
Hessians (``[K, K]`` float32 each, ~0.7 GB per 7B layer) are kept only with
``save_hessians=True``: once a stage is rounded, convert takes the cached result and never
reads them, unless it asks for something else (another ``layer_dtypes``), which then fails
with a ``CalibrationError`` instead of rounding without statistics.
"""

from __future__ import annotations

import json
import os

import torch

from qfuse.errors import FormatError
from qfuse.fileio import atomic_path, atomic_write_text

VERSION = 1


def _stage_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"stage-{index:03d}.pt")


def check_manifest(directory: str, stages: list[str], batches: int) -> None:
    """Write the manifest of a new run, or check that an existing one describes this run."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "manifest.json")
    mine = {"version": VERSION, "stages": stages, "batches": batches}
    if not os.path.exists(path):
        atomic_write_text(path, json.dumps(mine, indent=1))
        return
    with open(path) as f:
        theirs = json.load(f)
    if theirs != mine:
        diff = [k for k in mine if theirs.get(k) != mine[k]]
        raise FormatError(
            f"checkpoint_dir {directory} holds a calibration of another run (its {diff} differ: "
            f"{[theirs.get(k) for k in diff]} vs {[mine[k] for k in diff]}). Resume with the "
            "same model, blocks and batches, or point checkpoint_dir at a new directory."
        )


def done_stages(directory: str | None, count: int) -> int:
    """How many leading stages have a checkpoint."""
    done = 0
    while directory is not None and done < count and os.path.exists(_stage_path(directory, done)):
        done += 1
    return done


def save_stage(directory: str, index: int, recorders: dict, save_hessians: bool) -> None:
    """``recorders``: module target -> recorder (observers and Hessians) of stage ``index``."""
    state = {"version": VERSION, "recorders": {}, "solved": {}}
    for target, rec in recorders.items():
        sd = {k: v.detach().cpu() for k, v in rec.state_dict().items()}
        if "hessian" in sd and not save_hessians:
            sd["hessian"] = torch.zeros(0, 0)
        state["recorders"][target] = sd
        if getattr(rec, "solved", None):
            state["solved"][target] = dict(rec.solved)
    with atomic_path(_stage_path(directory, index)) as tmp:
        torch.save(state, tmp)


def load_stage(directory: str, index: int, recorders: dict) -> None:
    path = _stage_path(directory, index)
    try:
        # Our own file: it holds GPTQ's cached results (dataclasses), not only tensors.
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as exc:  # torch.load raises many types for a damaged file
        raise FormatError(
            f"{path}: unreadable checkpoint ({exc}); delete it to redo the stage."
        ) from exc
    if state.get("version") != VERSION or set(state["recorders"]) != set(recorders):
        raise FormatError(
            f"{path} does not hold this stage's recorders; delete the checkpoint directory "
            "(or point checkpoint_dir elsewhere) to calibrate afresh."
        )
    for target, rec in recorders.items():
        device = rec.num_batches.device
        rec.load_state_dict(state["recorders"][target])
        rec.to(device)
        if hasattr(rec, "solved"):
            rec.solved.clear()
            rec.solved.update(state["solved"].get(target, {}))
