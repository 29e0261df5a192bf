"""``./launch --max-restarts``, the stop rule and the data preflight, run as users run them
(a subprocess) on the tiny job of fixtures_launch: a rank killed once and the job restarted
equals an uninterrupted run bitwise; restarts are counted; a user error is not restarted;
Ctrl-C during the restart delay stops for good; a stuck rank is killed on Ctrl-C with a
plain account of what was lost; missing data is one line before any rank starts."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dtrain.run.tracking import read_scalars
from dtrain.launch.supervise import find_trainers
from fixtures_launch import LAUNCH, ROOT, free_port, launch, make_job

ADAPTER = "adapters/adapters.safetensors"
STEPS = 8
# a watchdog that fires while joining the group: exit status 3 on every attempt, in a second or two
ALWAYS_HANGS = ("--distributed.collective_timeout_s", "0.000001")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    return make_job(tmp, steps=STEPS)


def start(*args, log: Path) -> subprocess.Popen:
    """``./launch ARGS`` in the background, stdout and stderr into ``log``."""
    out = open(log, "w")
    return subprocess.Popen([sys.executable, str(LAUNCH), *map(str, args)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def wait_for(probe, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"gave up after {timeout} s waiting for {what}")


def weights(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def text_events(run_dir: Path, tag: str) -> list[tuple[int, str]]:
    """``(step, text)`` of every TensorBoard text entry ``tag`` in ``run_dir`` (TFRecord framing as tracking.read_scalars)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            # tensorboardX's add_text(tag, ...) writes the tag as TAG/text_summary
            out += [(event.step, v.tensor.string_val[0].decode()) for v in event.summary.value
                    if v.tag == f"{tag}/text_summary"]
    return out


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_rank_killed_once_restarts_and_equals_the_uninterrupted_run(job, tmp_path, backend):
    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    common = ("-n", 2, "--backend", backend, job, "--train.save_every", 1)
    plain = launch("--port", free_port(), *common, "--train.output_dir", tmp_path / "plain", timeout=120)
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "restarted"
    proc = start("--port", free_port(), "--max-restarts", 1, "--restart-delay", 0.5, *common,
                 "--train.output_dir", out, log=tmp_path / "log")
    try:
        wait_for(lambda: (out / "checkpoints" / "step-0000002").is_dir(), 60, "checkpoint 2")
        victim = wait_for(lambda: find_trainers(str(out)).get(1), 5, "rank 1's trainer")
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(120) == 0, (tmp_path / "log").read_text()
    finally:
        proc.kill()
    log = (tmp_path / "log").read_text()
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
               "--train.output_dir", tmp_path, *ALWAYS_HANGS, timeout=120)
    assert r.returncode == 3, r.stderr
    restarts = [x for x in r.stderr.splitlines() if x.startswith("launch: restart ")]
    assert [x.split(":")[1] for x in restarts] == [" restart 1 of at most 2", " restart 2 of at most 2"]
    assert all("failed (exit status 3 (collective watchdog: a peer stalled)); starting from step 0 (no checkpoint yet)"
               in x for x in restarts), restarts
    assert r.stderr.count("did not complete within 1e-06 s") >= 3  # one per attempt at least
    assert r.stderr.strip().splitlines()[-1] == "launch: not restarting: all 2 restart(s) used"


def test_a_user_error_is_not_restarted(job, tmp_path):
    r = launch("-n", 2, "--port", free_port(), "--max-restarts", 3, job, "--model.path", tmp_path / "missing", timeout=60)
    assert r.returncode == 2, r.stderr
    assert "launch: restart" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "launch: not restarting: a rank reported a user error, which a restart would repeat"


def test_ctrl_c_during_the_restart_delay_stops_for_good(job, tmp_path):
    log = tmp_path / "log"
    proc = start("-n", 2, "--port", free_port(), "--max-restarts", 5, "--restart-delay", 60, job,
                 "--train.output_dir", tmp_path / "run", *ALWAYS_HANGS, log=log)
    try:
        wait_for(lambda: "starting again in 60 s" in log.read_text(), 60, "the first restart's delay")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
    finally:
        proc.kill()
    text = log.read_text()
    assert text.strip().splitlines()[-1] == "launch: SIGINT during the restart delay: not restarting"
    assert text.count("launch: restart ") == 1 and not find_trainers(str(tmp_path / "run"))


def test_ctrl_c_kills_a_stuck_rank_and_says_what_was_lost(job, tmp_path):
    """Rank 1 stopped by SIGSTOP uses no CPU: after --stop-timeout it is killed; rank 0 could not save."""
    out, log = tmp_path / "run", tmp_path / "log"
    proc = start("-n", 2, "--port", free_port(), "--stop-timeout", 2, job, "--train.output_dir", out,
                 "--train.save_every", 1, "--train.steps", 5000, log=log)
    try:
        wait_for(lambda: (out / "checkpoints" / "step-0000002").is_dir(), 60, "checkpoint 2")
        pids = wait_for(lambda: find_trainers(str(out)), 5, "the trainers")
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.5)
        newest = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))[-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        proc.kill()
    text = log.read_text()
    assert "launch: rank 1 was killed before it saved: no CPU use for 2 s after SIGUSR2" in text, text
    assert (f"launch: rank 0 did not save: the work after step {int(newest[5:])} ({out / 'checkpoints' / newest}) "
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
