"""What a restart resumes from, and its record in the run's TensorBoard folder.

The launcher reads the newest valid checkpoint under ``OUTPUT_DIR/checkpoints``
(``dtrain.run.checkpoint.find_latest``: manifest and checksums verified) when the
output folder is on this machine, which it is for ``-n`` and MPI runs on one
host. A restart is recorded as a TensorBoard text entry (tag ``launch/restarts``)
in the run folder named by that checkpoint, at the checkpoint's step: the
resumed rank 0 continues the same folder from the next step, and its
``purge_step`` (which drops earlier events at later steps) leaves the entry alone.
The entry goes into an event file of its own (suffix ``.launch``), so the
launcher never touches the trainer's files. A restart before any checkpoint starts
from step 0 and continues the TensorBoard run the failed attempt began
(:data:`dtrain.contract.TB_RUN_VAR`), whose earlier steps its START drops: one run, not an orphan beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TAG = "launch/restarts"


@dataclass(frozen=True)
class ResumePoint:
    """The newest valid checkpoint: its ``step``, folder, and the TensorBoard run it belongs to."""

    step: int
    path: Path
    tensorboard_dir: Optional[Path]


def resume_point(output_dir: Path, named: Optional[Path] = None) -> Optional[ResumePoint]:
    """The checkpoint folder ``named``, else the one ``train.resume: auto`` continues; None when there is none."""
    from ..run.checkpoint import STATE, RunState, find_latest
    from ..files import OutputDir

    path = named if named is not None else find_latest(OutputDir(Path(output_dir)).checkpoints, report=lambda _: None)
    if path is None:
        return None
    state = RunState.from_json((path / STATE).read_text(), str(path / STATE))
    # tensorboard_run is relative to the output folder (an older absolute one stays absolute under /)
    return ResumePoint(state.step, path, Path(output_dir) / state.tensorboard_run if state.tensorboard_run else None)


def tensorboard_runs(output_dir: Path) -> set:
    """The TensorBoard run folders under ``OUTPUT_DIR/tb``, relative to ``output_dir``."""
    from ..files import OutputDir

    tb = OutputDir(Path(output_dir)).tb
    return {p.relative_to(output_dir) for p in tb.iterdir() if p.is_dir()} if tb.is_dir() else set()


def named_checkpoint(resume: Optional[str]) -> Optional[Path]:
    """The valid checkpoint folder ``train.resume`` names; None for none, ``auto`` or a folder the trainer refuses."""
    from ..files import home_path
    from ..run.checkpoint import validate

    path = home_path(resume, "train.resume") if resume not in (None, "auto") else None
    return path if path is not None and path.is_dir() and validate(path) is None else None


def newest_manifest(output_dir: Path) -> Optional[bytes]:
    """The newest valid checkpoint's ``manifest.json`` (None: none); while it reads the same, the run saved nothing."""
    from ..run.checkpoint import MANIFEST, find_latest
    from ..files import OutputDir

    path = find_latest(OutputDir(Path(output_dir)).checkpoints, report=lambda _: None)
    return None if path is None else (path / MANIFEST).read_bytes()


def describe_loss(output_dir: Optional[Path], named: Optional[Path] = None) -> str:
    """What a job that ended without its final save loses, in words (``output_dir`` None: not on this machine;
    ``named``: the checkpoint its restart would continue, see ``main.run_job``)."""
    if output_dir is None:
        return "the work after rank 0's newest checkpoint is lost; continue from it with --train.resume auto"
    point = resume_point(output_dir, named)
    if point is None:
        # a stop during start-up ends a job before any step: "its steps are lost" would say it trained some
        return (f"no checkpoint was saved in {Path(output_dir) / 'checkpoints'}: the steps it trained, if any, are "
                "lost; run it again to start from step 0")
    how = f"--train.resume {named}" if named is not None else "--train.resume auto"
    return f"the work after step {point.step} ({point.path}) is lost; continue from there with {how}"


def record(point: Optional[ResumePoint], text: str) -> Optional[Path]:
    """Add ``text`` to the run's TensorBoard folder at the resumed step; returns the folder or None."""
    if point is None or point.tensorboard_dir is None or not point.tensorboard_dir.is_dir():
        return None
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(logdir=str(point.tensorboard_dir), filename_suffix=".launch")
    try:
        writer.add_text(TAG, text, point.step)
    finally:
        writer.close()
    return point.tensorboard_dir
