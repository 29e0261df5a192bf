"""The test suite's own machinery (tests/waiting.py, conftest's leftover-process check):
a wait ends within a second of its process's early exit, with that process's last
output; a process a test leaves behind fails that test and is killed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import waiting
from waiting import SESSION_VAR, leftovers, marked_processes, spawn, wait_exit, wait_for_line, wait_until

PLANT = "DTRAIN_TEST_PLANT_ORPHAN"  # set only by test_leftover_check_fails_the_test_that_planted_an_orphan


def test_a_wait_fails_at_the_first_poll_that_sees_its_process_exited(tmp_path, monkeypatch):
    """The process prints and exits 3 without the awaited event: the poll that sees the exit takes one last
    look at the event and fails, with no sleep after it, so the wait ends within one POLL_S of the exit.
    Counted, not timed: "noticed within 1 s of the exit" by the wall clock measured the machine's load."""
    code = "import sys, time; time.sleep(0.5); print('last words', file=sys.stderr, flush=True); sys.exit(3)"
    proc = spawn([sys.executable, "-c", code], tmp_path)
    exited, looks, sleeps_after_exit = [], [], []
    real_poll = proc.poll

    def poll():
        if real_poll() is not None:
            exited.append(proc.returncode)
        return proc.returncode

    def sleep(seconds):
        if exited:
            sleeps_after_exit.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(proc, "poll", poll)
    monkeypatch.setattr(waiting, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_until(lambda: looks.append(bool(exited)), "an event that never comes", proc, limit=600)
    assert exited == [3] and looks[-1] and looks.count(True) == 1 and sleeps_after_exit == []
    assert waiting.POLL_S <= 0.1  # the sleep between the polls that came before
    message = str(failed.value)
    assert message.startswith(f"process {proc.pid} exited with status 3 before an event that never comes; its last output:")
    assert message.splitlines()[-1] == "last words"


def test_a_wait_on_an_ended_process_fails_at_once_and_an_event_just_before_the_exit_counts(tmp_path):
    proc = spawn([sys.executable, "-c", "print('ready', flush=True)"], tmp_path)
    assert wait_exit(proc) == 0
    assert wait_for_line(proc, "ready", stream="out") == "ready"  # written before the exit: found
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"exited with status 0 before a line with 'never'"):
        wait_for_line(proc, "never", limit=600)
    assert time.monotonic() - start < 60  # not the 600 s limit: the ended process was noticed (any machine's load)


def test_a_wait_past_its_limit_fails_naming_the_event(tmp_path):
    proc = spawn([sys.executable, "-c", "import time; print('working', flush=True); time.sleep(600)"], tmp_path)
    try:
        wait_for_line(proc, "working", stream="out")
        with pytest.raises(pytest.fail.Exception, match=r"gave up waiting for the end of the world after 0.2 s; its last output:\nworking"):
            wait_until(lambda: False, "the end of the world", proc, limit=0.2)
    finally:
        proc.kill()
        proc.wait()


@waiting.needs_proc  # the leftover check reads environments from /proc; macOS has none (it finds nothing there)
def test_marked_processes_finds_children_in_their_own_session(tmp_path):
    """The leftover check finds processes by the variable they inherit, whatever their session or parent."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        found = wait_until(lambda: marked_processes(os.environ[SESSION_VAR]).get(proc.pid), "the child in /proc")
        assert found[0] == os.environ["DTRAIN_TEST_NODE"] and "time.sleep(600)" in found[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in marked_processes(os.environ[SESSION_VAR])


def test_the_leftover_check_finds_nothing_where_there_is_no_proc(tmp_path, monkeypatch):
    """macOS has no /proc: the autouse leftover check (conftest) must not error every test there."""
    real = waiting.Path
    monkeypatch.setattr(waiting, "Path", lambda p: real(tmp_path / "no-proc" if str(p) == "/proc" else p))
    assert marked_processes(os.environ[SESSION_VAR]) == {}
    assert leftovers(os.environ[SESSION_VAR], grace=0) == {}


@pytest.mark.skipif(PLANT not in os.environ, reason="run only by the test below, in a pytest of its own")
def test_plant_an_orphan():
    """Leaves a ``sleep`` whose parent shell has exited (an orphan), and writes its pid."""
    out = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    Path(os.environ[PLANT]).write_text(out.stdout.strip())


@waiting.needs_proc  # see test_marked_processes_finds_children_in_their_own_session
def test_leftover_check_fails_the_test_that_planted_an_orphan(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    nodeid = "tests/test_waiting.py::test_plant_an_orphan"
    # PYTEST_ADDOPTS (bench/soak.py passes test paths in it) would make that pytest run this test again
    clean = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = spawn([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid], tmp_path, "pytest",
                 cwd=Path(__file__).resolve().parents[1], env={**clean, PLANT: str(pid_file)})
    assert wait_exit(proc) == 1, proc.out()
    pid = int(pid_file.read_text())
    report = proc.out()
    assert "1 passed, 1 error" in report, report
    assert (f"left 1 process(es) running (now killed): pid {pid} (started in {nodeid}): sleep 600") in report, report
    wait_until(lambda: not Path(f"/proc/{pid}/environ").exists() or not Path(f"/proc/{pid}/environ").read_bytes(),
               "the orphan to be gone")


@pytest.mark.parametrize("proc", [Path("/proc"), Path("/no-proc-here")], ids=["proc", "ps"])
def test_processes_gives_each_process_its_parent_and_command_line(proc):
    """From /proc, or from ``ps`` where there is none (macOS): tests find a rank's processes and a trainer's
    wrapper with it."""
    if not proc.is_dir() and shutil.which("ps") is None:
        pytest.skip("no ps here (procps)")
    proc_ = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "marker-of-this-test"])

    def row():
        found = waiting.processes(proc).get(proc_.pid)
        return found if found and "marker-of-this-test" in found[1] else None  # before its exec: pytest's command

    try:
        parent, command = wait_until(row, "the child listed")
        assert parent == os.getpid() and command.endswith(" -c import time; time.sleep(600) marker-of-this-test")
    finally:
        proc_.kill()
        proc_.wait()
    assert proc_.pid not in waiting.processes(proc)
