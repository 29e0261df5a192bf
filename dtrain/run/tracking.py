"""TensorBoard scalars (tensorboardX) and progress bars (tqdm), rank 0 only.

Each run gets a new directory under ``OUTPUT_DIR/tb``, created with an
exclusive ``mkdir`` so two runs never share one, even in the same second. A
resumed run passes the directory of the run it continues.

Events are written synchronously with tensorboardX's record writer and
summary builders, not through ``SummaryWriter``: its writer thread keeps
events in a queue that ``flush()`` does not drain, so a process killed right
after a checkpoint could lose steps the checkpoint covers. Here
:meth:`RunLogger.flush` puts every logged event on disk (fsync) and the
trainer calls it before a checkpoint is declared complete. The hparams record
goes into the same event file (``SummaryWriter.add_hparams`` writes a second
run ``<run>/<name>``), so TensorBoard lists one run per training run.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import yaml

from ..files import OutputDir, StorageError, fsync_path, storage
from ..notices import notice


def new_run_dir(root: Path) -> Path:
    """Create and return ``root/YYYYmmdd-HHMMSS-N``, the first N that is free.

    Raises:
        StorageError: the folder cannot be created.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    n = 0
    with storage(f"create a TensorBoard folder in {root}"):
        root.mkdir(parents=True, exist_ok=True)
        while True:
            path = root / f"{stamp}-{n}"
            try:
                path.mkdir()
                return path
            except FileExistsError:
                n += 1


def tensorboard_dir(out: Path, kept: Optional[str]) -> Path:
    """The run's TensorBoard folder: ``out / kept`` when it exists there, else a new one under ``out/tb``.

    ``kept`` is ``RunState.tensorboard_run``, relative to the output folder, so
    a copied folder logs into its own ``tb/``. An absolute path (older state)
    counts only when it lies inside ``out``.
    """
    path = Path(kept) if kept else None
    if path is not None and path.is_absolute():
        path = path.relative_to(out.resolve()) if path.is_relative_to(out.resolve()) else None
    if path is not None and (out / path).is_dir():
        return out / path
    return new_run_dir(OutputDir(out).tb)


class EventFile:
    """One TensorBoard event file, written synchronously.

    The name follows TensorBoard's ``events.out.tfevents.<time>.<host>`` with
    the pid appended, so a run resumed within the same second never truncates
    the file of the process it continues.

    Every file opens with a ``SessionLog.START`` event, as TensorFlow's writers
    do: TensorBoard's loader takes a run's first START for the run's own start
    and purges only at a later one (``plugin_event_accumulator``), so a resume's
    START purges only when the first file had one too.

    Args:
        run_dir: the run's folder.
        purge_step: when set (a resume), the START is at this step and makes
            TensorBoard drop events at or after it from earlier files
            (``SummaryWriter(purge_step=...)`` writes the same two events); a new run's is at step 0.
    """

    def __init__(self, run_dir: Path, purge_step: Optional[int] = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.record_writer import RecordWriter

        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        # a second run in the same process and second (a resume through the Python API) gets its own file
        self.path = next(p for n in itertools.count() if not (p := Path(run_dir) / (stem + (f".{n}" if n else ""))).exists())
        self.failed = False  # a write failed: close() then releases the file without writing again
        with self._storage():
            self._writer = RecordWriter(str(self.path))
        self._event = Event
        self.write(Event(wall_time=time.time(), step=purge_step or 0, file_version="brain.Event:2"))
        self.write(Event(wall_time=time.time(), step=purge_step or 0, session_log=SessionLog(status=SessionLog.START)))

    @contextlib.contextmanager
    def _storage(self):
        """A failed write or flush is one StorageError naming the file (files.storage)."""
        try:
            with storage(f"write TensorBoard events {self.path}", "; the checkpoints are intact"):
                yield
        except BaseException:
            self.failed = True
            raise

    def write(self, event) -> None:
        with self._storage():
            self._writer.write(event.SerializeToString())

    def summary(self, summary, step: int) -> None:
        self.write(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        """Everything written so far is on disk when this returns."""
        with self._storage():
            self._writer.flush()
            fsync_path(self.path)

    def close(self) -> None:
        if self.failed:  # the failure is already being reported; do not raise a second one on the way out
            with contextlib.suppress(OSError):
                self._writer.close()
            return
        self.flush()
        with self._storage():
            self._writer.close()


def flat_hparams(resolved: dict) -> dict:
    """``{"section.key": value}`` with values TensorBoard's hparams accept (others as text)."""
    flat = {}
    for section, values in resolved.items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


class RunLogger:
    """Writes scalars, text, the resolved config and hparams; a no-op off rank 0.

    Args:
        run_dir: TensorBoard directory of this run (None disables writing).
        total_steps: for the progress bar.
        progress: show tqdm bars on stderr (training steps; evaluations apart).
        first_step: steps already done (a resumed run).
        purge_step: on resume, the first step this run will log.
        hold: given a failed write's ``StorageError`` instead of raising it, after which the event file is
            written no more (the trainer's ``StopRequest.fail`` with several ranks); None: raised.
    """

    def __init__(self, run_dir: Optional[Path], total_steps: int, progress: bool = True, first_step: int = 0,
                 purge_step: Optional[int] = None, hold: Optional[Callable[[Exception], None]] = None):
        self.run_dir, self.hold = run_dir, hold
        self.events = EventFile(run_dir, purge_step) if run_dir is not None else None
        self.bar = None
        self.train_seconds, self.timed_steps = 0.0, 0  # optimizer steps only, evaluation excluded
        if self.events is not None and progress:
            from tqdm import tqdm

            # no tqdm rate: it would count evaluations in; the postfix gives s/step of training. {desc} is
            # set_description's text, which tqdm ends with ": " itself
            self.bar = tqdm(total=total_steps, initial=first_step, file=sys.stderr, dynamic_ncols=True, unit="step",
                            bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            self.bar.set_description("train")

    def config(self, resolved: dict, auto: dict | None = None) -> None:
        """The run's config as TensorBoard text; ``auto``: what its device-dependent ``auto`` values became."""
        chosen = f"\n\nauto on this device:\n```\n{yaml.safe_dump(auto, sort_keys=False)}```" if auto else ""
        self.text("config", "```\n" + yaml.safe_dump(resolved, sort_keys=False) + "\n```" + chosen, 0)

    def text(self, tag: str, text: str, step: int) -> None:
        """A TensorBoard text entry (markdown) under ``tag`` at ``step``."""
        if self.events is not None:
            from tensorboardX.summary import text as text_summary

            self._write(lambda: self.events.summary(text_summary(tag, text), step))

    def scalars(self, step: int, values: dict) -> None:
        """All ``values`` at ``step`` as one event (one record and checksum per step, not per scalar)."""
        if self.events is None:
            return
        from tensorboardX.proto.summary_pb2 import Summary

        # the Summary.Value tensorboardX.summary.scalar builds, without its check_nan: a skipped step's non-finite
        # metrics are logged on purpose and would each print "NaN or Inf found in input tensor."
        self._write(lambda: self.events.summary(Summary(value=[Summary.Value(tag=key, simple_value=float(value))
                                                               for key, value in values.items()]), step))

    def step_rate(self) -> Optional[float]:
        """Mean seconds per optimizer step so far in this process (evaluations excluded)."""
        return self.train_seconds / self.timed_steps if self.timed_steps else None

    def progress(self, step: int, values: dict) -> None:
        """Advance the step bar; ``values["perf/step_seconds"]`` feeds the step rate."""
        self.train_seconds += values.get("perf/step_seconds", 0.0)
        self.timed_steps += 1
        if self.bar is not None:  # one redraw per step (update's), not three
            self.bar.set_description("train", refresh=False)
            self.bar.set_postfix_str(f"{self.step_rate():.2f} s/step, loss {values.get('loss', float('nan')):.4f}",
                                     refresh=False)
            self.bar.update(1)

    def doing(self, text: str) -> None:
        """Say what the run is doing now (the step bar's label, or a line without a bar)."""
        if self.bar is not None:
            self.bar.set_description(text)
            self.bar.refresh()
        elif self.events is not None:
            self.message(text)

    def eval_bar(self, step: int, pairs: int, unit: str = "pair"):
        """A bar of its own for one evaluation (None when bars are off); call ``update(n)`` per pair
        (``unit``: what it counts, sft's rows or pairs)."""
        if self.bar is None:
            return None
        from tqdm import tqdm

        return tqdm(total=pairs, desc=f"eval at step {step}", unit=unit, file=sys.stderr, dynamic_ncols=True,
                    leave=False)

    def message(self, text: str) -> None:
        """A notice (:func:`dtrain.notices.notice`) from the logger of rank 0; silent on the other ranks."""
        if self.events is not None:
            notice(text)

    def hparams(self, resolved: dict, final: dict, step: int) -> None:
        """Record the flattened config with the final metrics (TensorBoard HPARAMS), in this run.

        The experiment, session-start and session-end summaries of
        ``tensorboardX.summary.hparams`` and the ``hparam/<metric>`` scalars
        they point at all go into this run's event file.
        """
        if self.events is None:
            return
        from tensorboardX.summary import hparams

        metrics = {f"hparam/{k}": v for k, v in final.items() if isinstance(v, float)}
        for summary in hparams(flat_hparams(resolved), metrics):
            self._write(lambda: self.events.summary(summary, step))
        self.scalars(step, metrics)

    def flush(self) -> None:
        """Put every event logged so far on disk (called before a checkpoint is complete)."""
        if self.events is not None:
            self._write(self.events.flush)

    def _write(self, write: Callable[[], None]) -> None:
        """``write`` to the event file; a failure goes to ``hold`` when one is given (nothing is written after it)."""
        if self.hold is not None and self.events.failed:  # held already
            return
        try:
            write()
        except StorageError as err:
            if self.hold is None:
                raise
            self.hold(err)

    def close(self, quiet: bool = False) -> None:
        """Close the bar and the event file; ``quiet`` (the run is failing already): a failed write of the
        event file raises nothing, so the run's own error stays the one reported."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.events is not None:
            self.events.failed |= quiet
            self.events.close()
            self.events = None


def peak_memory_gb() -> float:
    import mlx.core as mx

    return mx.get_peak_memory() / 1e9


def read_events(run_dir: Path):
    """Every ``Event`` in the event files of ``run_dir`` (not its subfolders), file by file.

    Reads the TFRecord framing (u64 length, u32 crc, payload, u32 crc) and
    parses each payload with tensorboardX's ``Event`` protobuf. A last record cut
    short (a full disk's short write) is skipped, as TensorBoard does.
    """
    import struct

    from tensorboardX.proto.event_pb2 import Event

    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            if pos + 12 + length + 4 > len(data):
                break
            payload = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            yield Event.FromString(payload)


def read_scalars(run_dir: Path) -> dict:
    """Scalars from the event files in ``run_dir``: tag -> [(step, value)].

    Like TensorBoard's loader, a ``SessionLog.START`` event at step ``s`` (written
    with ``purge_step``) discards values logged earlier at steps ``>= s``, except
    the run's first START (the run's own start).
    """
    out: dict = {}
    started = False
    for event in read_events(run_dir):
        if event.HasField("session_log") and event.session_log.status == event.session_log.START:
            if started:
                out = {tag: [(s, v) for s, v in vals if s < event.step] for tag, vals in out.items()}
            started = True
        for v in event.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out
