"""Ranks live and die with their job (issue 22, section 4), run as users run ``./launch``:
whatever ends the launcher (SIGKILL, SIGTERM, SIGINT, its terminal's SIGHUP), its ranks
save and stop; jobs started together take different ports, and a port in use is one line."""

from __future__ import annotations

import fcntl
import resource
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest

from dtrain.files import OutputDir
from dtrain.run.checkpoint import find_latest
from dtrain.launch.hosts import LaunchError
from dtrain.launch.main import release
from dtrain.launch.plan import DEFAULT_PORT, PORT_FLOOR, _port_lock, ephemeral_ports, free_ports, spare_base
from dtrain.launch import supervise
from dtrain.launch.supervise import find_trainers
from fixtures_launch import LAUNCH, ROOT, free_port, launch, make_job
from waiting import STOP_S, kill_tree, needs_proc, processes, spawn, wait_exit, wait_for_path, wait_until
from test_launch import http_get, rank_processes, read_scalars_of

ADAPTER = "adapters/adapters.safetensors"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("lifetime"))


def lock_is_free(out: Path) -> bool:
    """No run holds ``out``'s lock (dtrain.run.output.OutputLock)."""
    fd = os.open(OutputDir(out).lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=lambda s: signal.Signals(s).name)
def test_ranks_save_and_stop_when_their_launcher_is_ended(job, tmp_path, sig):
    """The signal goes to the launcher's process group, as a terminal (SIGINT, SIGHUP when
    it closes) or ``kill -9 -PGID`` sends it; the ranks, in sessions of their own, are not in it."""
    out, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    proc = spawn([sys.executable, LAUNCH, "-n", 2, "--port", free_port(), job, "--train.steps", 5000,
                  "--train.save_every", 0, "--train.output_dir", out], tmp_path, "launch", cwd=ROOT,
                 start_new_session=True, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        wait_until(lambda: "loss" in read_scalars_of(out / "tb"), "the first step's loss", proc)
        trainers = find_trainers(str(out))
        assert sorted(trainers) == [0, 1]
        os.killpg(proc.pid, sig)
        code = wait_exit(proc, STOP_S)
        wait_until(lambda: not find_trainers(str(out)), "every rank to end", limit=STOP_S)
    finally:
        kill_tree(proc)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), proc.err()
    saved = find_latest(out / "checkpoints")  # save_every 0: only the stop saved one
    assert saved is not None and int(saved.name.split("-")[1]) >= 1, proc.err()
    # a killed trainer leaves /proc's command lines (find_trainers) before it closes its files
    wait_until(lambda: lock_is_free(out), "the output folder's lock to be released", limit=10)
    # the launcher's temporary folder (the ring's MLX_HOSTFILE) goes too, also when the launcher was killed
    wait_until(lambda: not list(tmp.glob("dtrain-launch-*")), "the launcher's temporary folder to go", limit=STOP_S)
    # a killed launcher's port lock files stay until the next launcher that takes ports sweeps them
    assert bool(list(tmp.glob("dtrain-port-*.lock"))) == (sig == signal.SIGKILL)
    r = launch("-n", 2, "--dry-run", job, env={"TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    assert list(tmp.glob("dtrain-port-*.lock")) == []


def signal_last_rank(job, tmp_path, ranks, sig, wrapper, *options):
    """``./launch -n ranks [options] job`` into ``tmp_path/run``; after the first step's loss, ``sig`` to the last
    rank's trainer (or its wrapper, the trainer's parent). Returns the launcher's exit status, its process,
    the output folder and the trainer's pid, once every rank has ended."""
    out = tmp_path / "run"
    proc = spawn([sys.executable, LAUNCH, "-n", ranks, "--port", free_port(), *options, job, "--train.steps", 5000,
                  "--train.save_every", 0, "--train.output_dir", out], tmp_path, "launch", cwd=ROOT)
    try:
        wait_until(lambda: "loss" in read_scalars_of(out / "tb"), "the first step's loss", proc)
        trainer = find_trainers(str(out))[ranks - 1]
        os.kill(processes()[trainer][0] if wrapper else trainer, sig)
        code = wait_exit(proc, STOP_S)
        wait_until(lambda: not find_trainers(str(out)), "every rank to end", limit=STOP_S)
    finally:
        kill_tree(proc)
    return code, proc, out, trainer


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_rank_whose_wrapper_is_killed_stops_the_job_and_rank_0_saves(job, tmp_path, ranks):
    """SIGKILL of the last rank's wrapper (python -m dtrain.launch.rank): its trainer, in a session of its own,
    trained on with rank 0 to train.steps (no report came, so no abort), and was killed only once rank 0 had ended;
    with -n 1 the launcher then killed the one trainer at once, and nothing was saved."""
    code, proc, out, trainer = signal_last_rank(job, tmp_path, ranks, signal.SIGKILL, wrapper=True)
    assert code == 128 + signal.SIGKILL, proc.err()
    others = "; stopping the other rank(s)" if ranks > 1 else ""
    assert f"launch: rank {ranks - 1}'s wrapper ended without reporting{others}" in proc.err()
    assert f"launch: rank(s) {ranks - 1} did not report an exit status (killed by SIGKILL)" in proc.err()
    assert f"launch: asked rank {ranks - 1}'s trainer (pid {trainer}) to save after its step and stop" in proc.err()
    assert "killed rank" not in proc.err()  # its trainer stopped after its step, within the abort's grace
    assert not (out / ADAPTER).exists()  # stopped, not trained to step 5000
    saved = find_latest(out / "checkpoints")  # rank 0 stopped after its step and saved
    assert saved is not None and int(saved.name.split("-")[1]) >= 1, proc.err()


@pytest.mark.parametrize("target", ["trainer", "wrapper"])
@pytest.mark.parametrize("ranks", [2, 1])
def test_a_stop_signal_sent_to_one_rank_stops_the_job_and_the_launcher_says_so(job, tmp_path, ranks, target):
    """``kill PID`` of the last rank's trainer (or of its wrapper), not of the launcher: every rank saved after
    its step and exited 0, and so did the launcher, without a word, as if the run had trained to its end; as
    torchrun reports a worker's SIGTERM as that rank's failure, the launcher names the rank and the signal and
    exits 128 + the signal, as when the signal reaches it, and restarts nothing (the ranks saved)."""
    code, proc, out, _ = signal_last_rank(job, tmp_path, ranks, signal.SIGTERM, target == "wrapper",
                                          "--max-restarts", 2, "--restart-delay", 0)
    log = proc.err()
    assert code == 128 + signal.SIGTERM, log
    assert (f"launch: rank {ranks - 1} got SIGTERM from outside the launcher: every rank stopped after its step, "
            f"as on the launcher's own SIGTERM (no restart)") in log
    assert "launch: restart" not in log and "did not save" not in log
    assert not (out / ADAPTER).exists()  # stopped, not trained to step 5000
    saved = find_latest(out / "checkpoints")  # save_every 0: only the stop saved one
    assert saved is not None and int(saved.name.split("-")[1]) >= 1, log


def test_tensorboard_ends_with_its_launcher_killed(job, tmp_path):
    """kill -9 of the launcher: its TensorBoard ends too (it was left serving, holding the port), as the ranks do,
    and as at a normal end it removes its ``$TMPDIR/.tensorboard-info/pid-N.info`` (killed with SIGKILL, it left it)."""
    out, port, tmp = tmp_path / "run", free_port(1), tmp_path / "tmp"
    tmp.mkdir()
    proc = spawn([sys.executable, LAUNCH, "--tensorboard", port, job, "--train.steps", 5000, "--train.save_every", 0,
                  "--train.output_dir", out], tmp_path, "launch", cwd=ROOT, start_new_session=True,
                 env={**os.environ, "TMPDIR": str(tmp)})
    try:
        wait_until(lambda: "loss" in read_scalars_of(out / "tb") and http_get(f"http://127.0.0.1:{port}/"),
                   "the first step's loss and TensorBoard serving", proc)
        assert rank_processes(str(out / "tb"))  # the TensorBoard process
        proc.kill()  # the launcher alone: its ranks and TensorBoard run in sessions of their own
        wait_exit(proc, STOP_S)
        wait_until(lambda: not rank_processes(str(out / "tb")), "TensorBoard to end", limit=10)
        with pytest.raises(OSError):
            http_get(f"http://127.0.0.1:{port}/")
        assert list((tmp / ".tensorboard-info").iterdir()) == []
        wait_until(lambda: not rank_processes(str(out)), "the rank to end", limit=STOP_S)
    finally:
        kill_tree(proc)
        for pid in rank_processes(str(out)):  # what the test started, left by a failure
            os.kill(pid, signal.SIGKILL)


def test_two_jobs_started_together_take_different_ports_and_both_finish(job, tmp_path):
    """Issue 22: two `./launch -n 2` at once both listened on 32323 and paired across jobs."""
    procs = [spawn([sys.executable, LAUNCH, "-n", 2, job, "--train.output_dir", tmp_path / f"run{i}"], tmp_path,
                   f"launch{i}", cwd=ROOT) for i in range(2)]
    try:
        codes = [wait_exit(p) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    assert codes == [0, 0], [p.err()[-3000:] for p in procs]
    assert all((tmp_path / f"run{i}" / ADAPTER).is_file() for i in range(2))


@pytest.mark.parametrize("busy_offset", [0, 1])
def test_a_port_in_use_is_one_line(job, busy_offset):
    """-n 2 --port P needs P and P+1; a listener on either is named."""
    base = free_port(2)
    busy = base + busy_offset
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        r = launch("-n", 2, "--port", base, "--dry-run", job)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: port {busy} is in use (a process on 127.0.0.1 listens on it); pass another --port, "
        "or leave --port out to take free ones")


def test_a_port_another_launcher_holds_is_one_line(job):
    port = free_port()
    held = [(port, _port_lock(port))]
    try:
        r = launch("-n", 2, "--port", port, "--dry-run", job)
    finally:
        release(held)  # its lock file too: closing the descriptor alone left it in the temp folder
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: port {port} is in use (another ./launch job on this machine holds it); pass another --port, "
        "or leave --port out to take free ones")


def test_free_ports_skip_ports_another_launcher_holds():
    first, second = [], []
    try:
        a = free_ports(3, None, first)
        b = free_ports(3, None, second)
        assert len(first) == len(second) == 3
        assert not set(range(a, a + 3)) & set(range(b, b + 3))
        assert not any(_port_free(p) for p in [*range(a, a + 3), *range(b, b + 3)])  # held while the job runs
    finally:
        release(first + second)
    again = []
    try:
        assert free_ports(3, a, again) == a  # released: the same ports can be taken again
    finally:
        release(again)


def test_a_port_lock_file_of_another_user_is_locked_read_only(tmp_path, monkeypatch):
    """The lock file was opened for writing, which another user's file (mode 0644) refuses: a traceback.
    Here os.open refuses write access to it as the kernel would (the tests run as root, whom it never refuses)."""
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    lock = tmp_path / f"dtrain-port-{PORT_FLOOR}.lock"
    lock.touch(mode=0o644)
    real_open = os.open

    def open_as_another_user(path, flags, *args):
        if str(path) == str(lock) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_as_another_user)
    fd = _port_lock(PORT_FLOOR)
    try:
        assert fd is not None and _port_lock(PORT_FLOOR) is None  # held: a second launcher is refused
    finally:
        os.close(fd)
    fd = _port_lock(PORT_FLOOR)  # released: taken again
    assert fd is not None
    os.close(fd)


def test_a_port_lock_file_no_one_else_can_open_is_a_port_held(tmp_path, monkeypatch):
    """Another user's lock file of mode 0600 (made under umask 077) refused even read access: a traceback from
    every ./launch on the machine. Its port counts as held (another is taken), and a lock file this launcher
    creates can be opened by every user whatever the umask."""
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    lock = tmp_path / f"dtrain-port-{DEFAULT_PORT}.lock"
    lock.touch(mode=0o600)
    real_open = os.open

    def open_as_another_user(path, flags, *args):
        if str(path) == str(lock):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_as_another_user)
    locks, old = [], os.umask(0o077)
    try:
        port = free_ports(1, None, locks)
        created = tmp_path / f"dtrain-port-{port}.lock"
        assert port != DEFAULT_PORT and len(locks) == 1 and oct(created.stat().st_mode & 0o777) == oct(0o644)
    finally:
        os.umask(old)
        release(locks)
    # --port names it: no ./launch job may hold it, so the message says what is known, the file
    with pytest.raises(LaunchError) as err:
        free_ports(1, DEFAULT_PORT, locks)
    assert str(err.value) == (f"port {DEFAULT_PORT} is in use (its lock file {lock} cannot be opened or locked: "
                              f"Permission denied); pass another --port, or leave --port out to take free ones")
    assert locks == []


def _port_free(port: int) -> bool:
    held = _port_lock(port)
    if held is None:
        return False
    os.close(held)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_more_ports_than_open_files_is_one_error():
    """A ring past the launcher's open-file limit (`./launch -n 300` under macOS's default `ulimit -n` 256) ended in
    OSError's traceback (Too many open files) from the socket that checks a port, after a lock file per port."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/dev/fd")) + 20
    locks = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(LaunchError) as err:
            free_ports(100, None, locks)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert str(err.value) == (f"100 ranks' ports: the launcher holds a lock file for each while the job runs, past "
                              f"its limit of {limit} open files; raise it (ulimit -n) or start fewer ranks")
    assert locks == []
    held = []
    try:
        assert free_ports(100, None, held) > 0  # within the limit the same ports are taken: none were left locked
    finally:
        release(held)


def test_spare_ports_lie_outside_the_ephemeral_range():
    """Ports the system hands to outgoing connections are never drawn: one could be given to a
    connection between the launcher's check and the ranks' listen (a CI run failed that way)."""
    import random

    first, last = ephemeral_ports()
    assert PORT_FLOOR <= first <= last <= 65535
    if Path("/proc/sys/net/ipv4/ip_local_port_range").exists():
        assert (first, last) == tuple(map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()))
    rng = random.Random(0)
    for count in (1, 2, 8):
        for _ in range(2000):
            base = spare_base(count, rng, (first, last))
            assert base >= PORT_FLOOR and base + count - 1 <= 65535
            assert base + count - 1 < first or base > last, (base, count, first, last)
    held = [(p, fd) for p in range(DEFAULT_PORT, DEFAULT_PORT + 3) if (fd := _port_lock(p)) is not None]
    locks = []
    try:
        base = free_ports(3, None, locks)  # the default port is held: a spare one instead
        assert base != DEFAULT_PORT and (base + 2 < first or base > last)
    finally:
        release(locks + held)


@pytest.mark.parametrize("proc", [Path("/proc"), Path("/no-proc-here")], ids=["proc", "ps"])
def test_find_trainers_skips_a_process_whose_rank_is_not_a_number(tmp_path, monkeypatch, proc):
    """rank_from_env refuses a non-number MLX_RANK (a UserError): reading another process's environment, that
    ended the search in its traceback. Where there is no /proc (macOS) the environments come from ``ps -E``;
    here procps' ``e`` (the same output: the command line, then the environment) stands in for it."""
    import subprocess

    if not proc.is_dir():
        if shutil.which("ps") is None:
            pytest.skip("no ps here (procps)")
        run = subprocess.run
        monkeypatch.setattr(supervise.subprocess, "run",
                            lambda cmd, **kw: run(["e" if c == "-E" else c for c in cmd], **kw))
    (tmp_path / "dtrain").mkdir()  # a stand-in `python -m dtrain train` that waits
    (tmp_path / "dtrain" / "__init__.py").write_text("")  # a regular package: a namespace one would lose to dtrain
    (tmp_path / "dtrain" / "__main__.py").write_text("import time\ntime.sleep(60)\n")
    marker = str(tmp_path / "out")
    procs = [subprocess.Popen([sys.executable, "-m", "dtrain", "train", marker], cwd=tmp_path,
                              env={**os.environ, "MLX_RANK": rank}) for rank in ("x", "1")]
    try:
        def started():  # under load the new command lines show a moment late
            table = processes(proc)
            return all(" -m dtrain train " in table.get(p.pid, (0, ""))[1] for p in procs)

        wait_until(started, "the stand-in trainers' command lines", limit=STOP_S)
        assert find_trainers(marker, proc) == {1: procs[1].pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert find_trainers(marker, proc) == {}


def test_a_port_lock_file_that_cannot_be_locked_is_named_and_closed(tmp_path, monkeypatch):
    """flock failing otherwise than 'held' (ENOLCK: a file system without locks) leaked the opened fd, and the
    message said 'its lock file None cannot be opened'. Now the fd is closed and the message names the file."""
    import errno
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    before = set(os.listdir("/dev/fd"))  # this process's open fds (Linux: a link to /proc/self/fd; macOS too)
    locks = []
    with pytest.raises(LaunchError) as err:
        free_ports(1, DEFAULT_PORT, locks)
    lock = tmp_path / f"dtrain-port-{DEFAULT_PORT}.lock"
    assert str(err.value) == (f"port {DEFAULT_PORT} is in use (its lock file {lock} cannot be opened or locked: "
                              f"No locks available); pass another --port, or leave --port out to take free ones")
    assert locks == [] and set(os.listdir("/dev/fd")) == before  # no fd left open


def test_a_process_group_left_with_zombies_only_is_no_error(tmp_path, monkeypatch):
    """macOS's killpg fails with EPERM (PermissionError) on a group whose processes all ended but are not
    yet reaped (XNU's killpg1 skips zombies; Linux signals them): TensorBoard ending just before the launcher
    stopped it, or mlx.launch ending as the launcher signalled its group, raised out of the launcher there."""
    import subprocess

    from dtrain.launch.main import stop_tensorboard

    real = os.killpg

    def darwin_killpg(pgid, sig):  # the group's processes end, then the call fails as XNU's does
        real(pgid, signal.SIGKILL)
        wait_until(lambda: processes().get(pgid) is None or not processes()[pgid][1], "the group to be zombies",
                   limit=STOP_S)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "killpg", darwin_killpg)
    tb = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE,
                          start_new_session=True)
    stop_tensorboard(tb, tmp_path / "tb.log")
    assert tb.returncode == -signal.SIGKILL
    group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    supervise.signal_group(group.pid, signal.SIGUSR1)
    assert group.wait(STOP_S) == -signal.SIGKILL


@pytest.mark.parametrize("proc", [Path("/proc"), Path("/no-proc-here")], ids=["proc", "ps"])
def test_a_leftover_pid_is_killed_only_while_it_runs_dtrain(tmp_path, proc):
    """A rank's trainer pid, once it ended, may be another program's: the launcher kills a leftover only while
    its command line runs dtrain train. Without /proc (macOS) that took every live pid for a trainer; with it,
    any command line holding "dtrain" (a CI checkout in a folder named dtrain: every program's python path)."""
    import subprocess

    if not proc.is_dir() and shutil.which("ps") is None:
        pytest.skip("no ps here (procps)")
    (tmp_path / "dtrain").mkdir()  # a stand-in `python -m dtrain train` that waits
    (tmp_path / "dtrain" / "__init__.py").write_text("")  # a regular package: a namespace one would lose to dtrain
    (tmp_path / "dtrain" / "__main__.py").write_text("import time\ntime.sleep(60)\n")
    trainer = subprocess.Popen([sys.executable, "-m", "dtrain", "train"], cwd=tmp_path)
    # another program run from a checkout named dtrain: "dtrain" in its command line does not make it a trainer
    (tmp_path / "dtrain" / "python").symlink_to(sys.executable)
    other = subprocess.Popen([tmp_path / "dtrain" / "python", "-c", "import time; time.sleep(60)", "dtrain"])
    try:
        wait_until(lambda: " -m dtrain train" in processes(proc).get(trainer.pid, (0, ""))[1], "the stand-in trainer")
        wait_until(lambda: "time.sleep" in processes(proc).get(other.pid, (0, ""))[1], "the other program")
        assert supervise._is_trainer(trainer.pid, proc) and not supervise._is_trainer(other.pid, proc)
    finally:
        for p in (trainer, other):
            p.kill()
            p.wait()
    assert not supervise._is_trainer(trainer.pid, proc)


def test_released_ports_leave_no_lock_files(tmp_path, monkeypatch):
    """Each ./launch job left its ports' lock files in the temp folder for good (``dtrain-port-32323.lock``,
    and one pair per spare port ever drawn). Released ports now remove them, a lock file of a port still
    held stays, and a launcher that opened a lock file just before its holder removed it locks the new one."""
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    first, second = [], []
    a = free_ports(2, None, first)
    b = free_ports(2, None, second)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"dtrain-port-{p}.lock" for p in [a, a + 1, b, b + 1])
    release(first)
    assert first == [] and sorted(p.name for p in tmp_path.iterdir()) == [f"dtrain-port-{b}.lock", f"dtrain-port-{b + 1}.lock"]
    release(second)
    assert list(tmp_path.iterdir()) == []

    held, real_flock = [], fcntl.flock
    port = free_ports(1, None, held)

    def holder_releases_first(fd, op):  # between this launcher's open and its flock
        release(held)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_releases_first)
    fd = _port_lock(port)  # locked the removed file: a second launcher would lock the path's new one too
    monkeypatch.setattr(fcntl, "flock", real_flock)
    try:
        assert fd is not None and _port_lock(port) is None
        assert os.fstat(fd).st_ino == os.stat(tmp_path / f"dtrain-port-{port}.lock").st_ino
    finally:
        os.close(fd)


def test_a_killed_launcher_s_port_lock_files_are_swept_by_the_next_one(tmp_path, monkeypatch):
    """A launcher killed with SIGKILL never released its ports: their lock files stayed in the temp folder for
    good (~7,900 in /tmp here). The next launcher that takes ports removes every lock file no process holds;
    one a running launcher (here another process) holds stays."""
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    stale = [tmp_path / f"dtrain-port-{p}.lock" for p in (PORT_FLOOR, PORT_FLOOR + 1)]
    for path in stale:
        path.touch(mode=0o644)
    held = tmp_path / f"dtrain-port-{PORT_FLOOR + 2}.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(held)!r}, os.O_RDONLY | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('ready', flush=True)\ntime.sleep(60)\n"],
                              stdout=subprocess.PIPE)
    locks = []
    try:
        assert holder.stdout.readline() == b"ready\n"
        port = free_ports(1, None, locks)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([held.name, f"dtrain-port-{port}.lock"])
    finally:
        release(locks)
        holder.kill()
        holder.wait()
    assert [p.name for p in tmp_path.iterdir()] == [held.name]  # its holder ended: the next launcher sweeps it


def test_a_plan_that_holds_no_port_locks_leaves_no_lock_file(tmp_path, monkeypatch):
    """build_plan without port_locks (a plan only built, not run) dropped the locks it took: their files stayed
    in the temp folder and their descriptors open."""
    import tempfile

    from dtrain.config import load_config
    from dtrain.launch.plan import build_plan

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    before = set(os.listdir("/dev/fd"))
    plan = build_plan("job.yaml", [], load_config(overrides=["data.demo_pairs=8"]), ranks=2, tmpdir=str(tmp_path))
    assert len(plan.ports) == 2 and list(tmp_path.iterdir()) == [] and set(os.listdir("/dev/fd")) == before


def test_port_locks_taken_before_a_failure_are_released(tmp_path, monkeypatch):
    """An error after a port's lock was taken (no socket left to check it with: EMFILE) left its lock file and
    descriptor behind."""
    import errno
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))

    def no_sockets(*args, **kwargs):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(socket, "socket", no_sockets)
    before, locks = set(os.listdir("/dev/fd")), []
    with pytest.raises(LaunchError, match="past its limit of .* open files"):
        free_ports(2, PORT_FLOOR, locks)
    assert locks == [] and list(tmp_path.iterdir()) == [] and set(os.listdir("/dev/fd")) == before


# sitecustomize for a rank wrapper (python -m dtrain.launch.rank) that says it started, then waits, before its
# handlers exist, until the launcher's stop is pending (the launcher started it blocked) or the limit passes
WRAPPER_HELD = """import os, signal, time
if b"dtrain.launch.rank" in open("/proc/self/cmdline", "rb").read():
    open(os.environ["DTRAIN_TEST_HELD"], "w").close()
    end = time.monotonic() + 120
    while signal.SIGUSR2 not in signal.sigpending() and time.monotonic() < end:
        time.sleep(0.05)
"""


@needs_proc
def test_a_stop_as_the_one_rank_s_wrapper_starts_reaches_its_trainer(job, tmp_path):
    """The launcher starts the wrappers of ./launch -n N (N >= 2) with its stop signals blocked until their
    handlers are in place, not the one rank's wrapper: a Ctrl-C in its first tenth of a second killed it by the
    launcher's SIGUSR2 ('rank(s) 0 did not report an exit status (killed by SIGUSR2)'). It is blocked too now:
    the wrapper takes the stop once it can, and its trainer stops (exit status 130, 'dtrain: interrupted')."""
    hook, held = tmp_path / "hook", tmp_path / "held"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(WRAPPER_HELD)
    path = os.pathsep.join(x for x in (str(hook), os.environ.get("PYTHONPATH")) if x)
    proc = spawn([sys.executable, LAUNCH, "-n", 1, job, "--train.output_dir", tmp_path / "run"], tmp_path, "launch",
                 cwd=ROOT, env={**os.environ, "PYTHONPATH": path, "DTRAIN_TEST_HELD": str(held)})
    try:
        wait_for_path(held, proc)
        proc.send_signal(signal.SIGINT)
        assert wait_exit(proc, STOP_S) == 130, proc.err()
    finally:
        kill_tree(proc)
    assert "launch: rank(s) 0 stopped by a signal (exit status 130)" in proc.err().splitlines(), proc.err()
