"""The process every rank runs in: ``python -m dtrain.launch.rank -- CMD ...``.

It runs ``CMD`` (``dtrain train ...``, which unblocks :data:`dtrain.contract.STOP_SIGNALS`: the child
starts with them blocked, so a stop during its start-up is no traceback) as a child in its own session (where
Linux groups the scheduler by session, ``sched_autogroup``, each rank then gets
a session's share of the CPU, not a share of its launcher's), copies
its stdout and stderr through (keeping stderr's last lines; a closed terminal
or a launcher gone never reaches the child as a failed write), and writes two
report lines to stderr that the launcher reads::

    \\x1edtrain-rank {"event": "start", "rank": 1, "pid": 4242, "host": "mac2"}
    \\x1edtrain-rank {"event": "exit", "rank": 1, "code": 2, "tail": [...], "stop": null, "killed": null}

(a trainer that saved on a stop signal it received writes ``{"event": "signal", "rank": 1, "stop": "SIGTERM"}``
the same way, relayed with its other lines).

Signals (the launcher's, or a hung-up ssh session's):

- SIGINT, SIGTERM, SIGHUP, SIGUSR2: stop gently. The child gets one SIGINT and
  saves a checkpoint after its step. It is killed only when it stops making
  progress: when its CPU time has not grown for ``DTRAIN_STOP_TIMEOUT`` seconds
  (default 60). A rank computing a step or writing a checkpoint uses CPU, and so
  does one waiting in a ring or MPI collective for a slower peer (both poll);
  a process that uses none for that long is stuck (e.g. its host went to sleep).
- The launcher gone (``DTRAIN_LAUNCHER`` names its host and pid; checked every
  second on that host), whatever ended it, SIGKILL included: stop gently, as above;
  once the child ended, the launcher's temporary folder (``DTRAIN_LAUNCH_TMP``) is removed.
- SIGUSR1: abort (another rank failed, or a second Ctrl-C): the child gets SIGINT and is
  killed ``ABORT_GRACE_S`` seconds later unless it ended by then, which a rank whose peer
  died usually does at once, through its own error path (closing its files); a child
  already stopping gently ends at once (its second SIGINT, ``stop.StopRequest``).

The report says which happened (``stop``: the signal, ``killed``: why, ``aborted``: the
abort came while the child ran, so its exit status is the launcher's doing). It
exists because ``mlx.launch`` exits 0 even when a rank fails (mlx 0.32:
``_launch_with_io`` only logs a warning) and mixes the ranks' output without
saying which rank wrote what; mpirun forwards SIGUSR1/SIGUSR2 to its ranks.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from ..contract import (ABORT_GRACE_S, LAUNCH_TMP_VAR, LAUNCHER_VAR, RANK_TMPDIR_VAR, STOP_SIGNALS, STOP_TIMEOUT_VAR,
                        rank_from_env)
from ..files import to_devnull

MARK = "\x1edtrain-rank "
TAIL_LINES = 15
DEFAULT_STOP_TIMEOUT = 60.0
CPU_STEP = 0.02  # CPU seconds per sample that count as progress (an idle Python process uses ~0)
GENTLE = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
WRAPPER_SIGNALS = (*GENTLE, signal.SIGUSR1)  # what the wrapper handles


@dataclass
class Report:
    """One report line: ``event`` is ``start`` (with ``pid``, ``host``) or ``exit`` (with the rest)."""

    event: str
    rank: int
    code: Optional[int] = None  # the child's exit status; negative: killed by that signal
    tail: list = field(default_factory=list)
    stop: Optional[str] = None  # why it stopped gently: the signal, e.g. "SIGINT", or "launcher gone"
    killed: Optional[str] = None  # why this wrapper killed the child, e.g. "abort"
    aborted: Optional[bool] = None  # the launcher's abort (SIGUSR1) came while the child ran
    pid: Optional[int] = None
    host: Optional[str] = None


def report_line(report: Report) -> str:
    d = {k: v for k, v in report.__dict__.items() if v is not None and v != []}
    return MARK + json.dumps(d) + "\n"


def parse_report(line: str) -> Optional[Report]:
    """The :class:`Report` at the end of ``line`` (after :data:`MARK`), or None for any other line.

    The mark may follow other text on the line: mlx.launch writes its own
    warnings without a newline before the next rank's output.
    """
    if MARK not in line:
        return None
    try:
        d = json.loads(line[line.index(MARK) + len(MARK):])
        return Report(**{**d, "rank": int(d["rank"]), "tail": list(d.get("tail", []))})
    except (ValueError, KeyError, TypeError):
        return None


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU seconds of process ``pid`` (Linux: /proc; elsewhere: ps), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
    except FileNotFoundError:
        if sys.platform.startswith("linux"):
            return None
    except (OSError, IndexError, ValueError):
        return None
    # LC_ALL=C: macOS's ps writes the locale's decimal point (0:01,50 under de_DE), which float() refuses
    out = subprocess.run(["ps", "-o", "time=", "-p", str(pid)], capture_output=True, text=True,
                         env={**os.environ, "LC_ALL": "C"}).stdout.strip()
    return ps_seconds(out) if out else None


def ps_seconds(text: str) -> float:
    """Seconds of a ``ps -o time=`` field, ``[[DD-]HH:]MM:SS[.ss]`` (procps, macOS under ``LC_ALL=C``)."""
    days, _, clock = text.rpartition("-")
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds + 86400 * int(days or 0)


class Watch:
    """The stop state of one child: signals received, and when it last made progress."""

    def __init__(self, stop_timeout: float):
        self.stop_timeout = stop_timeout
        self.stop: Optional[str] = None
        self.abort_at: Optional[float] = None  # when SIGUSR1 came
        self.aborted: Optional[bool] = None  # it came while the child ran (or before it started)
        self.killed: Optional[str] = None
        self._cpu, self._progress_at = -1.0, 0.0

    def overdue(self, pid: int, now: float) -> bool:
        """True when the child used no CPU for ``stop_timeout`` seconds since the stop signal."""
        cpu = cpu_seconds(pid)
        if cpu is None:
            return False
        if cpu > self._cpu + CPU_STEP or self._cpu < 0:
            self._cpu, self._progress_at = cpu, now
        return now - self._progress_at > self.stop_timeout


def launcher_pid(env) -> Optional[int]:
    """The launcher's pid from ``DTRAIN_LAUNCHER`` (``HOST:PID``) when it runs on this host, else None."""
    host, _, pid = env.get(LAUNCHER_VAR, "").rpartition(":")
    return int(pid) if pid.isdigit() and host == socket.gethostname() else None


def alive(pid: int) -> bool:
    """Process ``pid`` exists (possibly another user's); a zombie counts as gone where /proc tells."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def trainer_env(env) -> dict:
    """``env`` with the TMPDIR in :data:`dtrain.contract.RANK_TMPDIR_VAR` (unset where it is empty), when the
    launcher set it: mlx.launch runs with TMPDIR in the launcher's temporary folder, removed at the job's end."""
    env = dict(env)
    given = env.pop(RANK_TMPDIR_VAR, None)
    if given is not None:
        env.pop("TMPDIR", None)
        env.update({"TMPDIR": given} if given else {})
    return env


def run(cmd: list) -> int:
    """Run ``cmd``, relay its output and signals, report; returns its exit code (128+N for signal N)."""
    rank = rank_from_env(os.environ)
    watch = Watch(float(os.environ.get(STOP_TIMEOUT_VAR, DEFAULT_STOP_TIMEOUT)))
    launcher = launcher_pid(os.environ)
    started: list = []

    def on_signal(signum, _frame):
        if signum == signal.SIGUSR1:
            if watch.abort_at is None:
                watch.abort_at = time.monotonic()
                if not started or started[0].poll() is None:
                    watch.aborted = True
                for proc in started:
                    _send(proc, signal.SIGINT)
        elif watch.stop is None:
            watch.stop = signal.Signals(signum).name
            for proc in started:
                _send(proc, signal.SIGINT)

    # Handlers first: the launcher may start us with these signals ignored, and
    # an ignored signal stays ignored across exec; a handled one resets to default.
    for sig in WRAPPER_SIGNALS:
        signal.signal(sig, on_signal)
    # the launcher starts its local wrappers with these blocked: one that came meanwhile is handled now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WRAPPER_SIGNALS)
    # the child starts with the stop signals blocked (a mask survives exec) and dtrain's main() unblocks them:
    # our SIGINT while its Python starts or imports waits there, rather than ending it in a traceback
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env=trainer_env(os.environ))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    started.append(proc)
    write(report_line(Report("start", rank, pid=proc.pid, host=socket.gethostname())).encode())
    if watch.stop is not None or watch.abort_at is not None:  # a signal came while starting
        _send(proc, signal.SIGINT)
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    partial, fd, out_fd, checked, looked = b"", proc.stderr.fileno(), proc.stdout.fileno(), 0.0, 0.0
    open_fds = [fd, out_fd]
    while fd in open_fds:
        now = time.monotonic()
        if launcher is not None and watch.stop is None and now - looked >= 1.0:
            looked = now
            if not alive(launcher):
                watch.stop = "launcher gone"
                _send(proc, signal.SIGINT)
        if proc.poll() is None and watch.killed is None:
            if watch.abort_at is not None and now - watch.abort_at >= ABORT_GRACE_S:
                watch.killed = "abort"
            elif watch.stop is not None and now - checked >= 1.0:
                checked = now
                if watch.overdue(proc.pid, now):
                    watch.killed = f"no CPU use for {watch.stop_timeout:g} s after {watch.stop}"
            if watch.killed is not None:
                _send(proc, signal.SIGKILL)
        try:
            ready = select.select(open_fds, [], [], 0.5)[0]
        except InterruptedError:
            continue
        for ready_fd in ready:
            chunk = os.read(ready_fd, 65536)
            if not chunk:
                open_fds.remove(ready_fd)
            elif ready_fd == out_fd:
                write(chunk, sys.stdout)
            else:
                write(chunk)
                *lines, partial = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
                tail.extend(x.decode(errors="replace")[:300] for x in lines if x.strip())
    while out_fd in open_fds:  # stderr closed first: the rest of stdout
        chunk = os.read(out_fd, 65536)
        if not chunk:
            break
        write(chunk, sys.stdout)
    if partial.strip():
        tail.append(partial.decode(errors="replace")[:300])
    code = proc.wait()
    if watch.stop is None and watch.abort_at is None and code - 128 in STOP_SIGNALS:
        watch.stop = signal.Signals(code - 128).name  # `dtrain: interrupted`: a signal sent to the trainer itself
    write(report_line(Report("exit", rank, code, list(tail), watch.stop, watch.killed, watch.aborted)).encode())
    if launcher is not None and not alive(launcher) and os.environ.get(LAUNCH_TMP_VAR):
        shutil.rmtree(os.environ[LAUNCH_TMP_VAR], ignore_errors=True)  # the launcher was killed before removing it
    return code if code >= 0 else 128 - code


def _send(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def write(data: bytes, stream=None) -> None:
    """Write ``data`` to stderr (or ``stream``) and flush; a reader gone never stops the caller.

    A reader gone for good (EPIPE: ``| head`` ended, or a launcher gone; EIO: a closed
    terminal) points the stream at /dev/null, so this and later writes, the exit's
    flush included, are dropped without error; any other failure drops this write.
    """
    stream = stream or sys.stderr
    try:
        stream.buffer.write(data)
        stream.buffer.flush()
    except OSError as err:
        if err.errno in (errno.EPIPE, errno.EIO):
            to_devnull(stream.fileno())
    except ValueError:  # closed
        pass


def say(line: str, stream=None) -> None:
    """Print ``line`` to stderr (or ``stream``) through :func:`write`; a path's bytes that are not UTF-8 (Python's
    surrogate escapes) are shown escaped, as Python's stderr writes them."""
    write(f"{line}\n".encode(errors="backslashreplace"), stream)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m dtrain.launch.rank -- COMMAND ...", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    status = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # No interpreter shutdown: it restores default signal handlers, and a SIGUSR1 from the
    # launcher arriving then would end this process with that signal after its report.
    os._exit(status)
