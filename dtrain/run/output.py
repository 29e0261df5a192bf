"""The output folder's ownership and free-space check, taken before a run writes anything.

:func:`prepare_output` takes an exclusive ``flock`` on ``OUTPUT_DIR/.dtrain.lock``
(:class:`OutputLock`), so a second run into the same folder stops before it
writes; under the lock it checks the folder is writable, has room for what the
run will save (:class:`DiskPlan`) and holds no earlier run's checkpoints or adapter.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mlx.utils import tree_flatten

from ..errors import UserError
from ..files import OutputDir, absent_folders, clear_set_aside, output_dir_problem, remove_folders, storage
from ..lora import ADAPTER_CONFIG
from .checkpoint import PREFIX, find_latest, list_checkpoints, step_of, validate

WRITE_TEST = ".write-test-"  # check_output_dir's probe file, then its pid


def estimate_bytes(model) -> int:
    """Bytes one checkpoint needs: adapter + two AdamW moments + the best adapter, plus 1 MiB of metadata."""
    n = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    return 4 * n + (1 << 20)  # with the best step's adapter (train.keep_best)


@dataclass(frozen=True)
class DiskPlan:
    """What a run will still write into its output folder, for the free-space check.

    ``checkpoint_bytes``: one checkpoint (:func:`estimate_bytes`).
    ``steps``, ``save_every``: ``train.steps`` and ``train.save_every``; the steps that save a checkpoint are
    ``save_every``'s multiples and the last.
    ``keep_last``: ``train.keep_last``.
    ``adapters``: adapter folders written at the end (2 with ``train.keep_best``: ``adapters/`` and
    ``adapters-last/``).
    ``cache_bytes``: the tokenized pairs' cache entries the run writes into ``data_cache/`` once it owns the
    folder (``data.cache.entries_bytes``): written first, they would take the room its checkpoints need.
    """

    checkpoint_bytes: int
    steps: int
    save_every: int
    keep_last: int
    adapters: int = 1
    cache_bytes: int = 0

    def need(self, kept: int, done_step: int) -> tuple[int, int]:
        """``(bytes, new checkpoints on disk at the peak)`` still needed after step ``done_step``.

        Each save writes a new checkpoint before the oldest beyond ``keep_last``
        is pruned, so at the peak ``keep_last + 1`` coexist: the ``kept``
        checkpoints already on disk (a resume's, the one it will prune
        included) count toward them, and a save ahead adds one to however
        many are there (more than ``keep_last`` after it was lowered). Each
        adapter folder at the end takes a quarter of a checkpoint
        (:func:`estimate_bytes`: the weights without AdamW's two moments and
        the best step's copy).
        """
        every, last = self.save_every, self.steps
        # counted, not listed: train.steps may be huge (a run ended by early_stop_evals)
        multiples = last // every - done_step // every if every else 0
        ahead = 0 if done_step >= last else multiples + (1 if not every or last % every else 0)
        # the first save writes before it prunes, also when more than keep_last are on disk (keep_last lowered)
        peak = max(min(self.keep_last + 1, kept + ahead), kept + min(ahead, 1))
        more = peak - kept
        return more * self.checkpoint_bytes + self.adapters * (self.checkpoint_bytes // 4) + self.cache_bytes, more


class OutputLock:
    """Exclusive ownership of an output folder, held until :meth:`release` (or process exit).

    ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``OUTPUT_DIR/.dtrain.lock``: atomic,
    released by the kernel when the process dies (even by SIGKILL), and
    exclusive between two open files even within one process. The file
    stays (deleting it would let a third run lock a new inode while the
    second still holds the old one); it names the holder for the message.
    Only folders made for it (``made``) that hold nothing else when it is
    released go, the file with them: a refused start leaves no new folder.
    """

    def __init__(self, out: Path, made: tuple = ()):
        self.path = OutputDir(Path(out).absolute()).lock  # absolute: lost() holds after a chdir
        self.made = made  # the folders made for it, deepest first: a run that wrote nothing there removes them
        try:  # not through a link: the holder's name would replace the content of the file it points to
            self._fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError:
            if not (self.path.is_symlink() or self.path.is_dir()):
                raise  # the folder's own problem (not writable, full): the caller names it
            raise UserError(f"{self.path} is {'a link' if self.path.is_symlink() else 'a folder'}, not dtrain's lock "
                            f"file; remove it, then start the run again") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            self._fd = None
            raise UserError(f"output folder {out} is in use by another dtrain run ({holder}); wait for it to end, "
                            f"or choose another train.output_dir") from None
        except OSError as err:  # ENOLCK, ENOTSUP: some network file systems (SMB, NFS without lockd) have no flock
            os.close(self._fd)
            self._fd = None
            raise UserError(f"output folder {out} cannot be locked ({err.strerror or err}): its file system does not "
                            f"support locks (a network share?); choose a train.output_dir on a local disk") from None
        name = f"pid {os.getpid()} on {socket.gethostname()}".encode()
        try:
            # padded over what a longer earlier name left, then cut: a reader sees one whole name, never none
            os.pwrite(self._fd, name.ljust(os.fstat(self._fd).st_size), 0)
            os.ftruncate(self._fd, len(name))
        except OSError:  # a full disk: the caller names it; the lock goes with the descriptor
            self.release()
            raise

    def _holder(self, wait_s: float = 2.0) -> str:
        """The holder's name; a holder that has just locked a new file may not have written it yet."""
        end = time.monotonic() + wait_s
        while True:
            text = os.pread(self._fd, 200, 0).decode("utf-8", "replace").strip()
            if text or time.monotonic() > end:
                return text or "another process"
            time.sleep(0.02)

    def lost(self) -> bool:
        """Whether ``OUTPUT_DIR/.dtrain.lock`` is no longer the file held (the folder was removed or replaced)."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        held = os.fstat(self._fd)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def release(self) -> None:
        if self._fd is None:
            return
        try:  # a start refused after the lock: no new folder stays behind, holding only the lock file
            if self.made and os.listdir(self.path.parent) == [self.path.name]:
                self.path.unlink()  # while held: no other run holds it
                remove_folders(self.made)
        except OSError:  # something else was written there meanwhile
            pass
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None


def prepare_output(out: Path, plan: DiskPlan, resuming: bool) -> OutputLock:
    """Take ownership of ``out``, remove what a killed run left half-written, then check it: writable, room
    for a checkpoint, no earlier run's checkpoints or adapter (unless resuming from its checkpoints).

    A fresh run into a folder holding another run's checkpoints would mix the
    two (``resume: auto`` would later pick the other run's newest step); one
    into a folder holding an adapter (``adapters/``, ``adapters-last/``) but no
    checkpoint (deleted to save space) would replace it at its end. The
    checks run under the lock, so no other run can change the answer.

    Args:
        plan: what the run will write (the free-space check counts the
            checkpoints already there, the ones a resume will prune included).
        resuming: ``train.resume`` is set (earlier checkpoints are then
            checked by :func:`resume`).
    Returns:
        The held lock; release it when the run ends.
    Raises:
        UserError: ``out`` is an adapter folder; another run holds ``out``; not writable (a killed run's
            leftovers too); too little space; earlier checkpoints and not ``resuming``; an adapter folder
            and no checkpoint; an adapter folder that is a mounted disk's root.
    """
    # runs/demo/adapters given for runs/demo: checkpoints/, tb/ and data_cache/ would go into the adapter
    if (out / ADAPTER_CONFIG).is_file():
        raise UserError(f"train.output_dir {out} is an adapter folder ({ADAPTER_CONFIG}), not a run's output folder; "
                        f"choose another train.output_dir (the run writes adapters/, checkpoints/ and tb/ into it)")
    made = tuple(absent_folders(out.absolute()))
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = OutputLock(out, made)
    except OSError as err:
        raise UserError(output_dir_problem(out, err)) from None
    try:
        # what a killed run left half-written (files.atomic_folder's adapter and checkpoint folders, new and set
        # aside, the caches' temporary files, the write test's probe); under the lock no other run writes here.
        # Before the checkpoints are looked at: a step-N/ set aside whose replacement never took its name is the
        # one to resume from
        with storage(f"remove what a killed run left in {out}"):
            clear_set_aside(out, "adapters*")
            if OutputDir(out).checkpoints.is_dir():
                clear_set_aside(OutputDir(out).checkpoints, f"{PREFIX}*")
            for debris in [*OutputDir(out).data_cache.glob(".tmp-*"), *out.glob(f"{WRITE_TEST}*")]:
                debris.unlink(missing_ok=True)
        with storage(f"read the checkpoints in {OutputDir(out).checkpoints}"):  # another user's, chmod 000
            earlier = find_latest(OutputDir(out).checkpoints, report=lambda _: None)
        if not resuming and earlier is not None:
            raise UserError(f"{out} already holds checkpoints of an earlier run (newest {earlier.name}); "
                            f"continue it with --train.resume auto, or choose another train.output_dir")
        made = [p for p in (OutputDir(out).adapters, OutputDir(out).adapters_last) if _holds_something(p)]
        if earlier is None and made:
            # a damaged checkpoint is named: "no checkpoint" beside one would send the user looking elsewhere
            damaged = [f"{p.name}: {validate(p)}" for p in reversed(list_checkpoints(OutputDir(out).checkpoints))]
            why = f"no valid checkpoint ({'; '.join(damaged)})" if damaged else "no checkpoint"
            raise UserError(f"{out} holds an earlier run's adapter ({made[0].name}/) and {why} to continue "
                            f"that run from, so this run would replace it; choose another train.output_dir, or "
                            f"remove {made[0]} to train anew here")
        for p in (OutputDir(out).adapters, OutputDir(out).adapters_last):  # else EBUSY at the run's end
            if os.path.ismount(os.path.realpath(p)):  # files.atomic_folder renames the folder a link names
                raise UserError(f"{p} names {os.path.realpath(p)}, the root of a mounted disk, which the run's adapter "
                                f"cannot replace (it is written beside it and renamed into its place); link {p.name} "
                                f"to a folder on that disk instead")
        kept = [p for p in list_checkpoints(OutputDir(out).checkpoints) if validate(p) is None] if earlier else []
        need, more = plan.need(len(kept), step_of(earlier) if earlier else 0)
        check_output_dir(out, need, f"{more} new checkpoint(s) of {plan.checkpoint_bytes / 1e6:.1f} MB before the "
                                    f"oldest beyond train.keep_last={plan.keep_last} is pruned ({len(kept)} on disk "
                                    f"now), and the adapter"
                                    + (f" folders ({plan.adapters})" if plan.adapters > 1 else "")
                                    + (f"; and {plan.cache_bytes / 1e6:.1f} MB of tokenized pairs for "
                                       f"{OutputDir(out).data_cache}" if plan.cache_bytes else ""))
    except BaseException:
        lock.release()
        raise
    return lock


def _holds_something(path: Path) -> bool:
    """``path`` exists and is not an empty folder (an empty one, or a link to one on another disk, is where a
    run's adapter goes, as files.atomic_folder writes through a link); an unreadable folder counts as full."""
    try:
        return path.exists() and (not path.is_dir() or any(path.iterdir()))
    except OSError:
        return True


def check_output_dir(out: Path, need_bytes: int, what: str = "a checkpoint") -> None:
    """Stop early when ``out`` is not writable or has less than ``need_bytes`` free (``what`` says for what).

    Raises:
        UserError: naming the folder and the bytes needed/free.
    """
    probe = out / f"{WRITE_TEST}{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        try:
            probe.write_bytes(b"ok")
        finally:
            probe.unlink(missing_ok=True)  # also after a failed write: its open may have created the file
    except OSError as err:
        raise UserError(output_dir_problem(out, err)) from None
    free = shutil.disk_usage(out).free
    if free < need_bytes:
        raise UserError(f"output folder {out} has {free / 1e6:.1f} MB free; this run needs about "
                        f"{need_bytes / 1e6:.1f} MB there: {what}")
