"""The one way tests wait on the wall clock: for a line a process prints, a file
that stays, or a process's exit.

A wait fails at once, with the process's exit status and last output, when the
process it waits on has ended without the event (one last look is taken first,
so an event written just before the exit still counts). Its time limit bounds the
product, not the machine: each limit below is what a tiny job must never exceed,
several times what it takes on a loaded 2-core machine (docs/reliability.md), so a
slow machine never fails a test and a hang still ends. Wait only on events that
stay true once they happened: a printed line (the log file keeps it), a file
nothing deletes, an exit; never on a file that is pruned later (a checkpoint
with ``keep_last``) or on a moment.

Children started with :func:`spawn` write to files, never to a pipe that can fill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

import pytest

T = TypeVar("T")

POLL_S = 0.05
JOB_S = 300.0  # a tiny job (a few steps of the 2-layer test model), start to end, 1-3 ranks
START_S = 180.0  # a process reaching its first step or first line
STOP_S = 120.0  # a signalled job saving and ending
TAIL_LINES = 30


class Child(subprocess.Popen):
    """A process whose stdout and stderr go to ``<folder>/<name>.out`` and ``.err``."""

    def __init__(self, cmd: list, folder: Path, name: str = "child", **popen_kw):
        folder.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = folder / f"{name}.out", folder / f"{name}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            super().__init__([str(c) for c in cmd], stdout=out, stderr=err, stdin=subprocess.DEVNULL, **popen_kw)

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")


def spawn(cmd: list, folder: Path, name: str = "child", **popen_kw) -> Child:
    """Start ``cmd`` with its output in files under ``folder`` (see :class:`Child`)."""
    return Child(cmd, folder, name, **popen_kw)


def last_output(proc: Optional[subprocess.Popen], lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines ``proc`` wrote (stdout then stderr); a piped process only once it ended."""
    if proc is None:
        return ""
    if isinstance(proc, Child):
        texts = [proc.out(), proc.err()]
    elif proc.poll() is not None and (proc.stdout or proc.stderr):
        try:
            texts = [t.decode(errors="replace") if isinstance(t, bytes) else (t or "")
                     for t in proc.communicate(timeout=5)]
        except (subprocess.TimeoutExpired, ValueError):
            texts = []
    else:
        texts = []
    tail = [x for t in texts for x in t.splitlines()][-lines:]
    return "\n".join(tail)


def _describe_exit(proc: subprocess.Popen) -> str:
    code = proc.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return f"process {proc.pid} {how}"


def wait_until(probe: Callable[[], T], what: str, proc: Optional[subprocess.Popen] = None,
               limit: float = JOB_S) -> T:
    """Poll ``probe()`` until it returns something truthy, and return that.

    ``OSError`` from the probe counts as not yet (a file being replaced, a
    server not listening yet). Fails the test at once when ``proc`` has ended
    (after one last probe), and after ``limit`` seconds.
    """
    end = time.monotonic() + limit
    while True:
        ended = proc is not None and proc.poll() is not None
        try:
            got = probe()
        except OSError:
            got = None
        if got:
            return got
        if ended:
            pytest.fail(f"{_describe_exit(proc)} before {what}; its last output:\n{last_output(proc)}", pytrace=False)
        if time.monotonic() > end:
            tail = f"; its last output:\n{last_output(proc)}" if isinstance(proc, Child) else ""
            pytest.fail(f"gave up waiting for {what} after {limit:g} s{tail}", pytrace=False)
        time.sleep(POLL_S)


def wait_for_line(proc: Child, text: str, limit: float = START_S, stream: str = "err") -> str:
    """The first line of ``proc``'s stderr (``stream="out"``: stdout) that contains ``text``."""

    def probe():
        content = proc.err() if stream == "err" else proc.out()
        return next((line for line in content.splitlines() if text in line), None)

    return wait_until(probe, f"a line with {text!r}", proc, limit)


def wait_for_path(path: Path, proc: Optional[subprocess.Popen] = None, limit: float = START_S) -> Path:
    """``path`` once it exists; only for files nothing removes later."""
    return wait_until(lambda: path if path.exists() else None, f"{path}", proc, limit)


def wait_exit(proc: subprocess.Popen, limit: float = JOB_S) -> int:
    """``proc``'s exit status; after ``limit`` seconds it (and its process group, if its own) is killed and the test fails."""
    try:
        return proc.wait(limit)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"process {proc.pid} still running after {limit:g} s; its last output:\n{last_output(proc)}",
                    pytrace=False)


def finish(proc: subprocess.Popen, limit: float = JOB_S) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)`` of ``proc`` (a :class:`Child` or a piped Popen) once it ended."""
    if isinstance(proc, Child):
        code = wait_exit(proc, limit)
        return code, proc.out(), proc.err()
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"process {proc.pid} still running after {limit:g} s; its last output:\n{(out or '')[-2000:]}"
                    f"{(err or '')[-3000:]}", pytrace=False)
    return proc.returncode, out, err


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, and its process group when it leads one."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone; macOS: EPERM for a group of unreaped processes only
        pass
    proc.kill()
    proc.wait()


SESSION_VAR = "DTRAIN_TEST_SESSION"  # set by conftest for this pytest run; every child inherits it
TEST_VAR = "DTRAIN_TEST_NODE"  # the test that was running when a child started
LEFTOVER_GRACE_S = 5.0  # a child may still be ending when its test returns (reaped by init, a final write)


def marked_processes(session: str) -> dict:
    """``{pid: (test id, command line)}`` of live processes whose environment holds ``SESSION_VAR=session`` (Linux /proc;
    none where there is no /proc, e.g. macOS, so the leftover check is Linux-only).

    A process that ended but is not reaped (a zombie) has no environment and is not listed.
    """
    found, me, needle = {}, os.getpid(), f"{SESSION_VAR}={session}".encode()
    proc = Path("/proc")
    if not proc.is_dir():  # else every test of the suite errors in conftest's autouse check
        return found
    for p in proc.iterdir():
        if not p.name.isdigit() or int(p.name) == me:
            continue
        try:
            environ = (p / "environ").read_bytes().split(b"\0")
            if needle not in environ:
                continue
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended meanwhile, or not ours
            continue
        test = next((e.split(b"=", 1)[1].decode(errors="replace") for e in environ if e.startswith(f"{TEST_VAR}=".encode())), "?")
        found[int(p.name)] = (test, cmdline)
    return found


def leftovers(session: str, grace: float = LEFTOVER_GRACE_S) -> dict:
    """The marked processes still alive after ``grace`` seconds (see :func:`marked_processes`); SIGKILLed before returning."""
    end = time.monotonic() + grace
    while True:
        found = marked_processes(session)
        if not found or time.monotonic() > end:
            break
        time.sleep(0.1)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


# Linux's /proc, which some tests read for what no portable tool shows: another process's environment
# (the leftover check above), its caught signals, a library map.
# macOS has none: those tests skip there, with this one reason.
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux's /proc (process "
                                "environments, signal masks, library maps); macOS has none")


def processes(proc: Path = Path("/proc")) -> dict:
    """``{pid: (parent pid, command line)}`` of this machine's processes: from ``proc`` (Linux), else from
    ``ps`` (macOS, which has no /proc; a Linux without procps has no ``ps``). The command line is the arguments
    joined by spaces, as ``ps`` shows them (full width: ``-ww``)."""
    if not proc.is_dir():
        out = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,command="], capture_output=True, text=True,
                             check=True, env={**os.environ, "LC_ALL": "C"}).stdout
        rows = [line.split(None, 2) for line in out.splitlines()]
        return {int(r[0]): (int(r[1]), r[2] if len(r) > 2 else "") for r in rows if len(r) >= 2}
    found = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:  # stat's fourth field, after the command name in parentheses (which may hold spaces)
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                args = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            except (OSError, IndexError, ValueError):  # ended while being read
                continue
            found[int(entry.name)] = (parent, " ".join(a.decode(errors="replace") for a in args))
    return found