"""One attempt of a job: start the plan, relay the ranks' output, stop them, summarize.

Every rank runs under :mod:`dtrain.launch.rank`, whose report lines say when
it started (its trainer's pid) and how it ended. The launcher talks to those
wrappers with two signals: SIGUSR2 asks them to stop gently (the trainers save
a checkpoint after their step), SIGUSR1 makes them end their trainers within
``contract.ABORT_GRACE_S`` seconds.
Ranks on this machine are started by the launcher itself, each wrapper in its
own session, and get the signals one by one; under mlx.launch they go to the
whole process group (mlx.launch itself ignores them), and ranks it started over
ssh get a Ctrl-C byte on their terminal instead (a stop); mpirun forwards both to
its ranks, so under MPI they go to mpirun only, once every rank reported its start
(a wrapper without its handlers dies of them). Every wrapper also watches the
launcher (:data:`dtrain.contract.LAUNCHER_VAR`): when the launcher is gone, whatever
ended it, its ranks save and stop.

The first rank that fails on its own makes the launcher abort the others
(a survivor stuck in a collective with a dead peer would otherwise wait for
its watchdog); a wrapper the launcher started that ends without its report
(killed) fails its rank, and its trainer is asked to save after its step, as
the abort asks the others. Trainer processes on this machine that outlive their wrapper
(mpirun kills wrappers when a rank fails) are killed before the attempt ends,
so a restart never meets a rank of the previous attempt.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..contract import (ABORT_GRACE_S, ERROR_PREFIX, EXIT_AFTER_RANK0, EXIT_LOST_PEER, EXIT_TIMEOUT, EXIT_USER_ERROR,
                        GROUP_KILL_MARGIN_S, JOB_VAR, LAUNCH_TMP_VAR, LAUNCHER_VAR, STOP_TIMEOUT_VAR, rank_from_env)
from ..errors import UserError
from .plan import Plan, command_with_env
from .rank import MARK, WRAPPER_SIGNALS, Report, alive, parse_report, say, write

NAMES = set(signal.Signals.__members__)  # a wrapper's stop that is a signal's name, not "launcher gone"
LEFTOVER_GRACE_S = 5.0  # seconds a trainer whose wrapper is gone gets before it is killed


def describe_status(code: int) -> str:
    """``killed by SIGKILL``, ``exit status 3 (collective watchdog: a peer stalled)``, ..."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    meaning = {EXIT_USER_ERROR: "user error", EXIT_TIMEOUT: "collective watchdog: a peer stalled",
               EXIT_LOST_PEER: "lost a peer", EXIT_AFTER_RANK0: "after rank 0's error"}.get(code)
    return f"exit status {code}" + (f" ({meaning})" if meaning else "")


@dataclass
class Outcome:
    """How an attempt ended.

    ``code``: the launcher's exit status (0, the failed rank's status, 128+signal).
    ``failed``: ranks that failed on their own (not stopped, aborted or killed by
    the launcher), first-reported first; ``missing``: ranks that never reported.
    ``stopped_by``: the signal that stopped the job for good, if any.
    """

    code: int
    reports: dict = field(default_factory=dict)
    failed: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    stopped_by: Optional[int] = None

    @property
    def user_error(self) -> bool:
        """Some rank ended with a user error (bad input): a restart would only repeat it."""
        return any(self.reports[r].code in (EXIT_USER_ERROR, EXIT_AFTER_RANK0) for r in self.failed)

    @property
    def restartable(self) -> bool:
        return self.code != 0 and self.stopped_by is None and not self.user_error

    def cause(self) -> str:
        """The failure in words: the first failed rank that is not a consequence (a lost peer, a pointer to rank 0)."""
        roots = [r for r in self.failed if self.reports[r].code not in (EXIT_LOST_PEER, EXIT_AFTER_RANK0)] or self.failed
        if roots:
            return f"rank {roots[0]} failed ({describe_status(self.reports[roots[0]].code)})"
        if self.missing:
            return f"rank(s) {', '.join(map(str, self.missing))} ended without reporting"
        return f"the launcher's command failed (exit status {self.code})"


class Attempt:
    """Run ``plan`` once (see the module docstring); :meth:`stop` and :meth:`abort` may come from a signal handler."""

    def __init__(self, plan: Plan, stop_timeout: float):
        self.plan, self.stop_timeout = plan, stop_timeout
        self.job = uuid.uuid4().hex[:12]  # this attempt's identity: its ranks pair with no other job's
        self.reports: dict = {}  # rank -> exit Report
        self.order: list = []  # ranks in the order their exit reports came
        self.started: dict = {}  # rank -> start Report
        self.stopped_by: Optional[int] = None
        self.aborted_at: Optional[float] = None
        self.procs: list = []  # mlx.launch, mpirun or the one rank; or each rank's wrapper (plan.direct)
        self.orphaned: dict = {}  # rank -> when its wrapper ended without reporting (its trainer was told to stop)
        self.signalled: dict = {}  # rank -> the stop signal its trainer saved on ("signal" report; see _summarize)
        self._lock = threading.Lock()
        self._errors: dict = {}  # a `dtrain: error:` line shown -> it and its indented lines: every rank may meet it

    def run(self) -> Outcome:
        """Start the ranks, wait for them (and any leftover trainer), summarize."""
        for path, content in self.plan.files.items():
            Path(path).write_text(content)
        ours = {STOP_TIMEOUT_VAR: str(self.stop_timeout), LAUNCHER_VAR: f"{socket.gethostname()}:{os.getpid()}",
                JOB_VAR: self.job}
        env = {**os.environ, **self.plan.explicit, **ours}
        if self.plan.tmpdir:  # a wrapper that outlives the launcher (kill -9) removes it
            env[LAUNCH_TMP_VAR] = self.plan.tmpdir
        # a wrapper the launcher starts itself (each rank's, or the one rank's) starts with the stop signals blocked
        # (a mask survives exec) and unblocks them once its handlers are in place: one sent while its Python starts
        # waits instead of killing it
        own = self.plan.direct or self.plan.backend == "none"
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WRAPPER_SIGNALS) if own else None
        try:
            if self.plan.direct:
                self.procs = [subprocess.Popen(self.plan.command, env={**env, **rank_env}, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                              for rank_env in self.plan.direct]
            else:
                # mlx.launch must outlive the ranks to relay their last lines, so it ignores the launcher's stop
                # signals (inherited SIG_IGN, _ignore_signals); mpirun handles them and forwards SIGUSR1/2.
                # mlx.launch's stdin is a pipe: it copies what comes there to every rank (_send).
                shield = self.plan.backend not in ("mpi", "none")
                self.procs = [subprocess.Popen(command_with_env(self.plan, ours), env={**env, **self.plan.command_env},
                                               stdin=subprocess.PIPE if shield else subprocess.DEVNULL,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                               preexec_fn=_ignore_signals if shield else None)]
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        # a stop or abort that came while the ranks were being started found no process to tell
        if self.aborted_at is not None:
            self._send(signal.SIGUSR1)
        elif self.stopped_by is not None:
            self._send(signal.SIGUSR2)
        # stdout comes through the launcher too: mpirun, handed a closed stdout (``| head`` ended),
        # can die of SIGPIPE while it shuts down after every rank saved; write() drops such output.
        # rank r's wrapper is procs[r]: each rank's (plan.direct), or the one rank's
        wrapped = range(len(self.procs)) if self.plan.direct or self.plan.backend == "none" else [None]
        relays = [threading.Thread(target=self._relay, args=(p.stderr.fileno(), rank), daemon=True)
                  for p, rank in zip(self.procs, wrapped)]
        # mlx.launch reaches a host over `ssh -tt`: the rank's pseudo-terminal sends its stderr, reports
        # included, to the client's stdout, so reports are read there too
        out = _copy_out if self.plan.direct or self.plan.backend in ("mpi", "none") else \
            lambda fd: self._relay(fd, None, sys.stdout)
        relays += [threading.Thread(target=out, args=(p.stdout.fileno(),), daemon=True) for p in self.procs]
        for relay in relays:
            relay.start()
        while any(p.poll() is None for p in self.procs):
            if self.aborted_at is not None and time.monotonic() - self.aborted_at > ABORT_GRACE_S + GROUP_KILL_MARGIN_S:
                for p in self.procs:
                    signal_group(p.pid, signal.SIGKILL)
            time.sleep(0.1)
        for relay in relays:
            relay.join(timeout=5)
        for p in self.procs:
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:  # a Ctrl-C byte still buffered for an mlx.launch that is gone (EPIPE)
                    pass
        self._kill_leftovers()
        return self._summarize()

    def stop(self, signum: int) -> None:
        """The first Ctrl-C/SIGTERM: ask every rank to save and stop."""
        self.stopped_by = signum
        say(f"launch: {signal.Signals(signum).name}: stopping {self.plan.world_size} rank(s) after their step; "
            f"a rank that uses no CPU for {self.stop_timeout:g} s is killed (Ctrl-C again to kill now)")
        self._send(signal.SIGUSR2)

    def abort(self, why: str, announce: bool = True) -> None:
        """End every rank's trainer within seconds (a rank failed, or a second Ctrl-C); ``why`` is printed
        unless ``announce`` is off."""
        with self._lock:
            if self.aborted_at is not None:
                return
            self.aborted_at = time.monotonic()
        if announce:
            say(f"launch: {why}" + ("; stopping the other rank(s)" if self.plan.world_size > 1 else ""))
        self._send(signal.SIGUSR1)

    def _send(self, sig: int) -> None:
        if self.plan.backend == "mpi" and len(self.started) < self.plan.world_size:
            # mpirun forwards it to every rank's wrapper, and kills the job when one whose handlers are not in
            # place yet dies of it: it is sent when the last start report comes (_on_report)
            return
        for p in self.procs:
            if p.poll() is not None:
                continue
            if self.plan.backend == "mpi" or self.plan.direct:
                _signal(p.pid, sig)
                continue
            signal_group(p.pid, sig)  # its ranks on this machine (ssh name 127.0.0.1), or the one rank's wrapper
            if p.stdin is None:  # the one rank: no mlx.launch, no ssh terminal
                continue
            # A rank on a host reached over ssh is in a session there, which no signal from here reaches (and
            # ssh keeps the SIG_IGN it inherited). mlx.launch runs it on `ssh -tt`'s terminal and copies its
            # stdin there: a Ctrl-C byte is SIGINT to the rank's wrapper, a stop after its step (an abort too).
            try:
                p.stdin.write(b"\x03")
                p.stdin.flush()
            except (OSError, ValueError):  # mlx.launch gone, or its stdin closed
                pass

    def _relay(self, fd: int, rank: Optional[int] = None, stream=None) -> None:
        """Copy the ranks' stderr to ours (or ``fd`` to ``stream``), taking out report lines; abort on the first
        failure. ``rank``: the rank whose wrapper alone writes to ``fd`` (plan.direct), which failed when it ends
        without its report."""
        mark, buf = MARK.encode(), b""
        # an error's lines so far (its first, then its indented lines: a list of problems); held: a rank showed
        # its first line already, so the block is shown at its end only where it differs from that rank's
        block, held = None, False
        for chunk in iter(lambda: os.read(fd, 65536), b""):
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                line = line.removesuffix(b"\r")  # a rank over ssh -tt: its terminal ends lines in \r\n
                report = parse_report(line.decode(errors="replace"))
                if report is None and block is not None and line.startswith(b" "):
                    block.append(line)
                    if not held:
                        write(line + b"\n", stream)
                    continue
                if held:
                    self._show_if_new(block, stream)
                block, held = None, False
                if report is None and line.startswith(ERROR_PREFIX.encode()):
                    block, held = self._error_block(line)
                    if held:
                        continue
                if report is None:
                    write(line + b"\n", stream)
                else:
                    before = line[: line.index(mark)]  # another process's text ahead of the mark
                    if before.strip():
                        write(before + b"\n", stream)
                    self._on_report(report)
            if buf and mark[:1] not in buf and not held:  # progress bars end in \r, not \n: pass them on now
                write(buf, stream)
                buf = b""
        if held:
            self._show_if_new(block, stream)
        if buf:
            write(buf, stream)
        if rank is not None and rank not in self.reports and self.stopped_by is None:
            # the wrapper was killed: its trainer, in a session of its own, would train on with the others
            self.abort(f"rank {rank}'s wrapper ended without reporting")
            self._stop_orphan(rank)

    def _stop_orphan(self, rank: int) -> None:
        """Do for ``rank``'s trainer what its killed wrapper would on the abort: ask it to save after its step
        (SIGHUP: its output has no reader now, and a trainer points it at /dev/null on that signal, so a write
        there does not end it before its save); :meth:`_kill_leftovers` kills it ``ABORT_GRACE_S`` later."""
        start = self.started.get(rank)
        if start is not None and start.host == socket.gethostname() and _is_trainer(start.pid):
            self.orphaned[rank] = time.monotonic()
            _signal(start.pid, signal.SIGHUP)
            say(f"launch: asked rank {rank}'s trainer (pid {start.pid}) to save after its step and stop "
                f"(its own lines have no reader now)")

    def _error_block(self, line: bytes) -> tuple:
        """``(lines, held)`` of the error block ``line`` starts: the list its relay fills, and whether a rank
        showed the same first line already (the ranks' relays run in threads of their own)."""
        with self._lock:
            if line in self._errors:
                return [line], True
            self._errors[line] = [line]
            return self._errors[line], False

    def _show_if_new(self, block: list, stream=None) -> None:
        """Show a held error block unless it is the block shown under its first line (every line the same)."""
        with self._lock:
            same = block == self._errors.get(block[0])
        if not same:
            write(b"".join(line + b"\n" for line in block), stream)

    def _on_report(self, report: Report) -> None:
        if report.event == "start":
            self.started[report.rank] = report
            # its handlers are in place now: a stop or abort sent before may have been lost (under mlx.launch a
            # wrapper starts with SIGUSR1/2 ignored, and a Ctrl-C byte before ssh's terminal is the rank's)
            if self.aborted_at is not None:
                self._send(signal.SIGUSR1)
            elif self.stopped_by is not None:
                self._send(signal.SIGUSR2)
            return
        if report.event == "signal":  # its trainer saved on a stop signal it received (ours, or one from elsewhere)
            self.signalled.setdefault(report.rank, report.stop)
            return
        self.reports[report.rank] = report
        self.order.append(report.rank)
        if report.code != 0 and report.stop in NAMES and report.killed is None:
            with self._lock:
                elsewhere = self.stopped_by is None and self.aborted_at is None
                if elsewhere:
                    self.stopped_by = signal.Signals[report.stop]
            if elsewhere:  # a stop signal sent to this rank that ended it unsaved (in its start-up): not a failure
                say(f"launch: rank {report.rank} got {report.stop} from outside the launcher and ended "
                    f"({describe_status(report.code)}): stopping every rank, as on the launcher's own {report.stop} "
                    f"(no restart)")
                self._send(signal.SIGUSR2)
                return
        # a rank pointing to rank 0's error: rank 0 ends with that error by itself, and an abort would
        # reach it while it exits (reported as stopped by the launcher, not as the rank that failed)
        if report.code not in (0, EXIT_AFTER_RANK0) and self.stopped_by is None and report.killed is None:
            # one rank: nothing else to stop, and the summary names the failure
            self.abort(f"rank {report.rank} failed ({describe_status(report.code)})", self.plan.world_size > 1)

    def _kill_leftovers(self) -> None:
        """Kill this machine's trainers whose wrapper died without reporting (e.g. killed by mpirun)."""
        here = socket.gethostname()
        # one already exiting (its command line reads empty) still holds its files: it is waited for below
        pids = {s.rank: s.pid for s in self.started.values()
                if s.host == here and s.rank not in self.reports and (_is_trainer(s.pid) or _dying(s.pid))}
        end = time.monotonic() + (LEFTOVER_GRACE_S if self.stopped_by is not None and self.aborted_at is None else 0)
        end = max([end, *(at + ABORT_GRACE_S for rank, at in self.orphaned.items() if rank in pids)])
        while any(_is_trainer(p) for p in pids.values()) and time.monotonic() < end:
            time.sleep(0.2)
        for rank, pid in sorted(pids.items()):
            if _is_trainer(pid):
                _signal(pid, signal.SIGKILL)
                say(f"launch: killed rank {rank}'s trainer (pid {pid}), left running after its wrapper ended")
        # SIGKILL lands asynchronously, and a killed process frees its memory (its command line then
        # reads empty) before it closes its files: wait until each is a zombie or gone, so that a restart
        # or the next run does not meet a trainer that still holds the output folder's lock
        end = time.monotonic() + LEFTOVER_GRACE_S
        while any(alive(p) for p in pids.values()) and time.monotonic() < end:
            time.sleep(0.05)

    def _summarize(self) -> Outcome:
        code = next((p.returncode for p in self.procs if p.returncode != 0), 0)
        stopped_by = self.stopped_by
        if stopped_by is None and self.aborted_at is None:
            # a stop signal sent to a rank's trainer or wrapper, not to us: every rank saved after its step and
            # exited 0; the job stopped as our own signal stops it (128 + the signal, no restart)
            elsewhere = {**self.signalled, **{r: self.reports[r].stop for r in self.order
                                              if self.reports[r].code == 0 and self.reports[r].stop in NAMES}}
            if elsewhere:
                rank, name = min(elsewhere.items())
                say(f"launch: rank {rank} got {name} from outside the launcher: every rank stopped after its step, "
                    f"as on the launcher's own {name} (no restart)")
                stopped_by = signal.Signals[name]
        outcome = summarize(self.plan.world_size, self.reports, self.order, code, stopped_by,
                            self.aborted_at is not None)
        # a rank that sent its start report was started by ssh: its exit report is lost when mlx.launch ends its
        # ssh session (it does as soon as another rank fails)
        remote = sorted({self.plan.hosts[r] for r in outcome.missing if r not in self.started}
                        - {"127.0.0.1", "localhost"})
        if remote and self.plan.backend != "mpi":  # mlx.launch hides ssh's own error (LogLevel=QUIET)
            say(f"launch: no report from {', '.join(remote)}: where ssh could not start a rank (mlx.launch hides its "
                f"error), check that `ssh HOST` logs in from here without a password and that {sys.executable} and "
                f"{os.getcwd()} exist there")
        return outcome


def summarize(world_size: int, reports: dict, order: list, launcher_code: int, stopped_by: Optional[int],
              aborted: bool = False) -> Outcome:
    """Print what went wrong, if anything, and return the :class:`Outcome`.

    Args:
        reports: rank -> exit :class:`Report`; ``order``: ranks as their reports came.
        launcher_code: exit status of mlx.launch / mpirun / the single rank's wrapper.
        stopped_by: the signal that stopped the job for good, or None.
        aborted: the launcher aborted the attempt (a rank failed).
    """
    # a gentle stop during an abort is the abort's: a rank over ssh gets it as a Ctrl-C byte, mpirun sends SIGTERM
    by_abort = aborted and stopped_by is None
    ended = [r for r in order if reports[r].code != 0 and reports[r].killed is None
             and (reports[r].stop is None or by_abort)]
    # rank 0's own error ahead of the ranks pointing to it, whichever report came first
    failed = sorted((r for r in ended if not reports[r].aborted and reports[r].stop is None),
                    key=lambda r: reports[r].code == EXIT_AFTER_RANK0)
    for r in failed:
        rep = reports[r]
        what = ("failed with " if rep.code > 0 else "was ") + describe_status(rep.code)
        if rep.code in (EXIT_USER_ERROR, EXIT_AFTER_RANK0):  # one line "dtrain: error: ...", relayed above as it came
            say(f"launch: rank {r} {what}; its message is above")
            continue
        say(f"launch: rank {r} {what}" + ("; its last lines:" if rep.tail else ""))
        for line in rep.tail[-10:]:
            say(f"  [rank {r}] {line}")
    killed = sorted(r for r in reports if reports[r].killed == "abort")
    if killed:
        say(f"launch: rank(s) {', '.join(map(str, killed))} killed by the launcher")
    on_abort = sorted(r for r in ended if r not in failed)  # exit status (SIGINT, a lost peer): the abort's doing
    if on_abort:
        say(f"launch: rank(s) {', '.join(map(str, on_abort))} stopped by the launcher")
    for r in sorted(r for r in reports if reports[r].killed not in (None, "abort")):
        say(f"launch: rank {r} was killed before it saved: {reports[r].killed}")
    stopped = sorted(r for r in reports if reports[r].code != 0 and reports[r].stop is not None
                     and reports[r].killed is None and r not in on_abort)
    if stopped:
        say(f"launch: rank(s) {', '.join(map(str, stopped))} stopped by a signal "
            f"({', '.join(describe_status(reports[r].code) for r in stopped)})")
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        say(f"launch: rank(s) {', '.join(map(str, missing))} did not report an exit status"
            + (f" ({describe_status(launcher_code)})" if launcher_code else ""))
    if stopped_by:
        code = 128 + stopped_by
    elif failed:
        first = reports[failed[0]].code
        code = first if first > 0 else 128 - first
    elif killed or on_abort or stopped or missing or launcher_code != 0:
        code = 128 - launcher_code if launcher_code < 0 else launcher_code or 1  # killed by a signal: 128 + N
    else:
        code = 0
    return Outcome(code, dict(reports), failed, missing, stopped_by)


def _copy_out(fd: int) -> None:
    """Copy what a started command writes to its stdout to the launcher's stdout."""
    for chunk in iter(lambda: os.read(fd, 65536), b""):
        write(chunk, sys.stdout)


def _ignore_signals() -> None:
    """mlx.launch's shield: the launcher's stop and abort (SIGUSR2, SIGUSR1 to its process group) are for the
    ranks; it and its ssh clients keep them ignored. Not SIGTERM: mlx.launch ends a failed job's other ranks
    with it, and an ssh client (or the bash that runs it, which cannot undo an ignore it started with) that
    ignores it leaves mlx.launch waiting on it until the collective watchdog fires."""
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group gone, or left with unreaped processes only, is no error
    (macOS fails killpg with EPERM there: XNU's ``killpg1`` skips zombies; Linux signals them)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _is_trainer(pid: int, proc: Path = Path("/proc")) -> bool:
    """Process ``pid`` is alive and (where its command line can be read: ``proc``, else ``ps``) runs dtrain:
    a pid the trainer left may be another program's by now."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    if not proc.is_dir():  # macOS
        out = subprocess.run(["ps", "-ww", "-o", "command=", "-p", str(pid)], capture_output=True)
        return _runs_dtrain_train(out.stdout.decode(errors="replace").split())
    try:
        cmdline = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return True
    return _runs_dtrain_train(cmdline.decode(errors="replace").split("\0"))


def _runs_dtrain_train(args: list) -> bool:
    """A command line's words run ``dtrain train`` (``python -m dtrain train``, or the ``dtrain`` script): not
    any word that holds "dtrain", which a checkout's own path (``~/dtrain/.venv/bin/python``) would give every
    program run from it."""
    return any(a.rpartition("/")[2] == "dtrain" and b == "train" for a, b in zip(args, args[1:]))


PF_EXITING = 0x4  # /proc/PID/stat's flags (field 9): the process has begun to exit


def _dying(pid: int) -> bool:
    """Process ``pid`` has begun to exit and is not yet a zombie (Linux /proc; elsewhere False): its
    command line may already read empty while it still holds its files. Read after the command line."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return fields[0] not in ("Z", "X") and bool(int(fields[6]) & PF_EXITING)
    except (OSError, IndexError, ValueError):
        return False


def find_trainers(marker: str, proc: Path = Path("/proc")) -> dict:
    """``{rank: pid}`` of this machine's live ``dtrain train`` processes (not their rank wrappers)
    whose command line mentions ``marker`` (e.g. the output folder); the rank is read from each
    process's environment: from ``proc`` (Linux), else from ``ps -E`` (macOS, which has no /proc).
    Tests and bench/endurance.py use it to hurt one rank.
    """
    if not proc.is_dir():
        return _trainers_from_ps(marker)
    found = {}
    for p in proc.iterdir():
        if not p.name.isdigit():
            continue
        try:
            args = (p / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if not _trainer_words(args) or not any(marker in a for a in args):
                continue
            env = dict(x.split("=", 1) for x in (p / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in x)
            found[rank_from_env(env)] = int(p.name)
        except (OSError, UserError):  # gone, not ours to read, or a rank that is no number (it stops at its start)
            continue
    return found


def _trainer_words(words: list) -> bool:
    """A command line's words are a trainer's, ``python -m dtrain train ...``: its first ``-m`` names the module
    (a rank wrapper's is dtrain.launch.rank, whose command holds its trainer's words after it)."""
    module = words.index("-m") if "-m" in words else -1
    return words[module:module + 3] == ["-m", "dtrain", "train"]


def _trainers_from_ps(marker: str) -> dict:
    """:func:`find_trainers` from ``ps -E`` (macOS): each command line followed by its environment, joined by
    spaces; shown for this user's processes only, so others' are left out (their rank would read as 0)."""
    out = subprocess.run(["ps", "-A", "-ww", "-E", "-o", "pid=,uid=,command="], capture_output=True, text=True,
                         check=True, env={**os.environ, "LC_ALL": "C"}).stdout
    found = {}
    for line in out.splitlines():
        pid, uid, *words = line.split()
        if int(uid) != os.getuid() or not _trainer_words(words) or marker not in line:
            continue
        try:
            found[rank_from_env(dict(w.split("=", 1) for w in words if "=" in w))] = int(pid)
        except UserError:  # a rank that is no number (it stops at its start)
            continue
    return found
