"""``./launch --max-restarts``, the stop rule and the data preflight, run as users run them
(a subprocess) on the tiny job of fixtures_launch: a rank killed once and the job restarted
equals an uninterrupted run bitwise; restarts are counted; a user error is not restarted;
Ctrl-C during the restart delay stops for good; a stuck rank is killed on Ctrl-C with a
plain account of what was lost; missing data is one line before any rank starts."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dtrain.run.tracking import read_events, read_scalars
from dtrain.launch.supervise import find_trainers
from fixtures_launch import LAUNCH, ROOT, free_port, launch, make_job
from test_launch import rank_processes
from test_trainer import tensorboard_scalars
from waiting import STOP_S, Child, kill_tree, needs_proc, spawn, wait_exit, wait_for_line, wait_until

ADAPTER = "adapters/adapters.safetensors"
STEPS = 8
# a watchdog that fires while joining the group: exit status 3 on every attempt, in a second or two
ALWAYS_HANGS = ("--distributed.collective_timeout_s", "0.000001")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    return make_job(tmp, steps=STEPS)


def start(*args, folder: Path) -> Child:
    """``./launch ARGS`` in the background, its output in ``folder/launch.out`` and ``.err``."""
    return spawn([sys.executable, LAUNCH, *args], folder, "launch", cwd=ROOT)


def newest_step(out: Path) -> int:
    """The newest checkpoint's step under ``out`` (0 when none). Checkpoints are pruned
    (``keep_last``), but once step N was saved this stays >= N: a wait that cannot miss."""
    steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def trainer_after_checkpoint(out: Path, rank: int, step: int):
    """A probe: rank ``rank``'s trainer pid once a checkpoint of step >= ``step`` exists, else None."""
    return lambda: find_trainers(str(out)).get(rank) if newest_step(out) >= step else None


def weights(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def text_events(run_dir: Path, tag: str) -> list[tuple[int, str]]:
    """``(step, text)`` of every TensorBoard text entry ``tag`` in ``run_dir``."""
    # tensorboardX's add_text(tag, ...) writes the tag as TAG/text_summary
    return [(event.step, v.tensor.string_val[0].decode()) for event in read_events(run_dir)
            for v in event.summary.value if v.tag == f"{tag}/text_summary"]


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_rank_killed_once_restarts_and_equals_the_uninterrupted_run(job, tmp_path, backend):
    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    common = ("-n", 2, "--backend", backend, job, "--train.save_every", 1)
    plain = launch("--port", free_port(), *common, "--train.output_dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "restarted"
    proc = start("--port", free_port(), "--max-restarts", 1, "--restart-delay", 0.5, *common,
                 "--train.output_dir", out, folder=tmp_path)
    try:
        victim = wait_until(trainer_after_checkpoint(out, 1, 2), "rank 1's trainer after checkpoint 2", proc)
        os.kill(victim, signal.SIGKILL)
        assert wait_exit(proc) == 0, proc.err()
    finally:
        kill_tree(proc)
    log = proc.err()
    assert log.count("launch: restart ") == 1, log
    line = next(x for x in log.splitlines() if x.startswith("launch: restart 1 of at most 1: "))
    assert line.startswith("launch: restart 1 of at most 1: rank 1 failed (killed by SIGKILL); resuming from step "), line
    resumed = int(line.split("resuming from step ")[1].split()[0])
    assert 2 <= resumed < STEPS and f"resumed from {out / 'checkpoints' / f'step-{resumed:07d}'} at step {resumed + 1}" in log
    a, b = weights(tmp_path / "plain" / ADAPTER), weights(out / ADAPTER)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bitwise
    (run_dir,) = (out / "tb").iterdir()  # the restart continued the same TensorBoard run
    assert [s for s, _ in read_scalars(run_dir)["loss"]] == list(range(1, STEPS + 1))  # every step once
    assert text_events(run_dir, "launch/restarts") == [(resumed, line.split("launch: ", 1)[1].split("; starting again")[0])]
    assert not find_trainers(str(out))


def test_restarts_are_counted_then_the_failure_is_final(job, tmp_path):
    r = launch("-n", 2, "--port", free_port(), "--max-restarts", 2, "--restart-delay", 0, job,
               "--train.output_dir", tmp_path, *ALWAYS_HANGS)
    assert r.returncode == 3, r.stderr
    restarts = [x for x in r.stderr.splitlines() if x.startswith("launch: restart ")]
    assert [x.split(":")[1] for x in restarts] == [" restart 1 of at most 2", " restart 2 of at most 2"]
    assert all("failed (exit status 3 (collective watchdog: a peer stalled)); starting from step 0 (no checkpoint yet)"
               in x for x in restarts), restarts
    assert r.stderr.count("did not complete within 1e-06 s") >= 3  # one per attempt at least
    assert r.stderr.strip().splitlines()[-1] == "launch: not restarting: all 2 restart(s) used"


def test_a_user_error_is_not_restarted(job, tmp_path):
    r = launch("-n", 2, "--port", free_port(), "--max-restarts", 3, job, "--model.path", tmp_path / "missing")
    assert r.returncode == 2, r.stderr
    assert "launch: restart" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "launch: not restarting: a rank reported a user error, which a restart would repeat"


def test_ctrl_c_during_the_restart_delay_stops_for_good(job, tmp_path):
    proc = start("-n", 2, "--port", free_port(), "--max-restarts", 5, "--restart-delay", 600, job,
                 "--train.output_dir", tmp_path / "run", *ALWAYS_HANGS, folder=tmp_path)
    try:
        wait_for_line(proc, "starting again in 600 s")
        proc.send_signal(signal.SIGINT)
        assert wait_exit(proc, STOP_S) == 130
    finally:
        kill_tree(proc)
    text = proc.err()
    assert text.strip().splitlines()[-1] == "launch: SIGINT during the restart delay: not restarting"
    assert text.count("launch: restart ") == 1 and not rank_processes(str(tmp_path / "run"))


def test_ctrl_c_kills_a_stuck_rank_and_says_what_was_lost(job, tmp_path):
    """Rank 1 stopped by SIGSTOP uses no CPU: after --stop-timeout it is killed; rank 0 could not save."""
    out = tmp_path / "run"
    proc = start("-n", 2, "--port", free_port(), "--stop-timeout", 2, job, "--train.output_dir", out,
                 "--train.save_every", 1, "--train.steps", 5000, folder=tmp_path)
    try:
        victim = wait_until(trainer_after_checkpoint(out, 1, 2), "rank 1's trainer after checkpoint 2", proc)
        os.kill(victim, signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        assert wait_exit(proc, STOP_S) == 130
    finally:
        kill_tree(proc)
    text = proc.err()
    newest = newest_step(out)  # rank 0 may have saved the step rank 1 had finished; nothing after it
    assert newest >= 2
    assert "launch: rank 1 was killed before it saved: no CPU use for 2 s after SIGUSR2" in text, text
    assert (f"launch: rank 0 did not save: the work after step {newest} ({out / 'checkpoints' / f'step-{newest:07d}'}) "
            "is lost; continue from there with --train.resume auto") in text
    assert not find_trainers(str(out))


@pytest.mark.parametrize("key,content", [("train", None), ("train", ""), ("train", "\n  \n"), ("valid", None)],
                         ids=["missing", "empty", "blank", "missing-valid"])
def test_data_files_are_checked_once_before_ranks_start(job, tmp_path, key, content):
    good, data = tmp_path / "good.jsonl", tmp_path / f"{key}.jsonl"
    good.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    if content is not None:
        data.write_text(content)
    files = {"train": good, "valid": good, key: data}
    r = launch("-n", 2, job, "--data.demo_pairs", 0, "--data.train", files["train"], "--data.valid", files["valid"])
    problem = f"data file not found (data.{key})" if content is None else "file is empty"
    assert r.returncode == 2
    assert [x for x in r.stderr.splitlines() if not x.startswith("launch: using")] == [f"launch: error: {data}: {problem}"]


# holds a lock on argv[1] and 1 GB of touched memory; "dtrain train" in its command line makes it a trainer
LEFTOVER = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "ballast = b'x' * (1 << 30)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")


def lock_after_the_launcher_met_a_leftover(tmp_path: Path, first=lambda pid: None) -> None:
    """Start a leftover trainer (``LEFTOVER``: its wrapper never reported) holding ``tmp_path``'s lock,
    run ``first(pid)``, let the launcher deal with it (``Attempt._kill_leftovers``), then take the lock
    at once: BlockingIOError if the trainer still holds it."""
    import fcntl
    import socket
    import subprocess

    from dtrain.launch.rank import Report
    from dtrain.launch.supervise import Attempt

    lock = tmp_path / ".dtrain.lock"
    child = subprocess.Popen([sys.executable, "-c", LEFTOVER, str(lock), "dtrain", "train"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        first(child.pid)
        attempt = Attempt(plan=None, stop_timeout=5.0)
        attempt.started = {0: Report("start", 0, pid=child.pid, host=socket.gethostname())}
        attempt._kill_leftovers()
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_a_killed_leftover_trainer_has_closed_its_files_when_the_launcher_goes_on(tmp_path):
    """A trainer whose wrapper died without a report is killed, and the launcher waits until it is
    gone: a restart or the next run must not meet the output folder's lock still held. A killed
    process lets go of its memory (1 GB here, which takes a while) before it closes its files."""
    lock_after_the_launcher_met_a_leftover(tmp_path)


@needs_proc  # an exiting process's empty command line is what /proc shows (_is_trainer reads it there)
def test_a_leftover_trainer_already_exiting_is_waited_for_too(tmp_path):
    """The trainer was already exiting when the launcher looked (killed by someone else: its command line
    reads empty while it frees its memory, before it closes its files): the launcher did not count it as a
    trainer, so it neither killed it nor waited, and a restart met the output folder's lock still held."""
    import time

    def killed_and_freeing(pid):
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + STOP_S
        while Path(f"/proc/{pid}/cmdline").read_bytes() and time.monotonic() < end:
            pass  # no sleep: the moment it reads empty, it is still freeing its 1 GB

    lock_after_the_launcher_met_a_leftover(tmp_path, killed_and_freeing)


# on PYTHONPATH: rank 1's trainer exits 1 as it starts, once (the marker file says it did)
DIES_ONCE = ("import os, sys\n"
             "marker = os.path.join(os.path.dirname(__file__), 'died')\n"
             "if sys.orig_argv[1:4] == ['-m', 'dtrain', 'train'] and os.environ.get('MLX_RANK') == '1' "
             "and not os.path.exists(marker):\n"
             "    open(marker, 'w').close()\n"
             "    os._exit(1)\n")


def test_a_restart_before_the_first_save_resumes_the_checkpoint_named(job, tmp_path):
    """--train.resume names step 3 of a run saved up to step 8; a rank dies before the resumed run's first
    save. The restart resumed step 8 (the newest, of the steps the user left: resume auto) instead of step 3."""
    common = ("-n", 2, "--backend", "ring", job, "--train.save_every", 1, "--train.keep_last", STEPS)
    out, plain = tmp_path / "run", tmp_path / "plain"
    assert launch("--port", free_port(), *common, "--train.output_dir", out).returncode == 0
    shutil.copytree(out, plain)
    named = out / "checkpoints" / "step-0000003"
    r = launch("--port", free_port(), *common, "--train.output_dir", plain,
               "--train.resume", plain / "checkpoints" / "step-0000003")
    assert r.returncode == 0, r.stderr
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DIES_ONCE)
    path = os.pathsep.join(x for x in (str(hook), os.environ.get("PYTHONPATH")) if x)
    r = launch("--port", free_port(), "--max-restarts", 1, "--restart-delay", 0, *common, "--train.output_dir", out,
               "--train.resume", named, env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    assert (hook / "died").exists()
    assert (f"launch: restart 1 of at most 1: rank 1 failed (exit status 1); resuming from step 3 ({named}); "
            "starting again in 0 s") in r.stderr.splitlines(), r.stderr
    assert f"resumed from {named} at step 4" in r.stderr
    a, b = weights(plain / ADAPTER), weights(out / ADAPTER)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # bitwise
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{s:07d}" for s in range(1, STEPS + 1)]


def test_what_a_job_without_a_checkpoint_lost_claims_no_steps(tmp_path):
    """A stop during start-up ends a job before its first step: the launcher said 'all of this run's steps are
    lost' of a job that trained none. Without a checkpoint it says what it knows: no save, and where to start."""
    from dtrain.launch.restart import describe_loss

    (tmp_path / "checkpoints").mkdir()
    assert describe_loss(tmp_path) == (f"no checkpoint was saved in {tmp_path / 'checkpoints'}: the steps it "
                                       "trained, if any, are lost; run it again to start from step 0")


def test_a_restart_before_the_first_save_continues_the_tensorboard_run_from_step_0(job, tmp_path):
    """A rank killed before any checkpoint: the restart starts from step 0, and its trainer began a second
    TensorBoard run beside the failed attempt's, whose steps (1..k, trained again) stayed as an orphan run.
    Now the restarted attempt continues the failed attempt's run from step 0 (its START purges the earlier
    steps), so TensorBoard shows one run with every step once."""
    out = tmp_path / "run"

    def logged(steps: int, since: float = 0.0) -> bool:  # `steps` losses written after `since` (time.time())
        # the events as written, not the run's scalars (read_scalars): until the restart's START is on disk
        # those are the failed attempt's, and a Ctrl-C sent on them came in the restart's start-up
        found = list((out / "tb").rglob("events.out.tfevents.*"))
        return bool(found) and sum(event.wall_time > since and any(v.tag == "loss" for v in event.summary.value)
                                   for event in read_events(found[0].parent)) >= steps

    proc = start("-n", 1, "--max-restarts", 1, "--restart-delay", 0, job, "--train.steps", 5000,
                 "--train.save_every", 0, "--train.eval_every", 0, "--train.output_dir", out, folder=tmp_path)
    try:
        wait_until(lambda: logged(2), "two steps' loss", proc)
        os.kill(find_trainers(str(out))[0], signal.SIGKILL)
        wait_for_line(proc, "starting from step 0 (no checkpoint yet)")
        restarted = time.time()  # the killed trainer is gone: a loss written since is the restarted attempt's
        wait_until(lambda: logged(1, restarted), "the restarted attempt's first step", proc)
        proc.send_signal(signal.SIGINT)  # it saves after its step and stops
        assert wait_exit(proc, STOP_S) == 130, proc.err()
    finally:
        kill_tree(proc)
    (run_dir,) = (out / "tb").iterdir()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # the failed attempt's file and the restart's
    saved = newest_step(out)
    assert [s for s, _ in read_scalars(run_dir)["loss"]] == list(range(1, saved + 1))  # every step once
    assert [s for s, _ in tensorboard_scalars(run_dir)["loss"]] == list(range(1, saved + 1))  # TensorBoard's loader
