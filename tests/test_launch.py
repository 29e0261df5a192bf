"""``./launch`` run as users run it (a subprocess) on a tiny real job: one rank,
two ranks over the ring on loopback, two ranks under OpenMPI, a failing job,
Ctrl-C, TensorBoard, and the --dry-run plan."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures_launch import LAUNCH, ROOT, TRAINER_STAND_IN, free_port, launch, make_job
from waiting import STOP_S, kill_tree, processes, spawn, wait_exit, wait_until

ADAPTER = "adapters/adapters.safetensors"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The tiny job's config and its one-rank run (the reference for the others)."""
    tmp = tmp_path_factory.mktemp("launch")
    config = make_job(tmp)
    r = launch(config)
    assert r.returncode == 0, r.stderr
    return dict(config=config, tmp=tmp, one_rank=r)


def adapter(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def assert_same_adapter(a: Path, b: Path) -> None:
    wa, wb = adapter(a), adapter(b)
    assert sorted(wa) == sorted(wb) and len(wa) == 2 * 7 * 2  # layers x linear layers x (lora_a, lora_b)
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_one_rank_trains_without_distributed_setup(job):
    r = job["one_rank"]
    assert "world size 1" in r.stderr and "eval reward accuracy (chosen preferred over rejected): step 0" in r.stdout
    assert (job["tmp"] / "run" / ADAPTER).is_file()
    assert "MLX_HOSTFILE" not in r.stderr


def test_two_ranks_on_loopback_equal_one_rank(job, tmp_path):
    r = launch("-n", 2, "--port", free_port(), job["config"], "--train.output_dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "world size 2" in r.stderr
    assert_same_adapter(job["tmp"] / "run" / ADAPTER, tmp_path / ADAPTER)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_two_ranks_under_mpirun_equal_one_rank(job, tmp_path):
    r = launch("-n", 2, "--backend", "mpi", job["config"], "--train.output_dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "world size 2" in r.stderr and "--output" not in r.stderr
    assert_same_adapter(job["tmp"] / "run" / ADAPTER, tmp_path / ADAPTER)


def summary_lines(stderr: str) -> list[str]:
    """The launcher's summary of how its ranks ended (not its "rank N failed (...)[; stopping the other
    rank(s)]" line when the first failure came)."""
    return [x for x in stderr.splitlines() if x.startswith(("launch: rank ", "launch: rank(s) "))
            and not x.endswith("stopping the other rank(s)") and not re.match(r"launch: rank \d+ failed \(", x)]


def test_failing_ranks_give_their_status_and_point_to_the_message(job, tmp_path):
    """Both ranks fail; the launcher may stop the second one before it reports its own error."""
    r = launch("-n", 2, "--port", free_port(), job["config"], "--model.path", tmp_path / "missing")
    assert r.returncode == 2
    assert f"dtrain: error: {tmp_path / 'missing'}: no such file" in r.stderr
    first = summary_lines(r.stderr)[0]
    assert first in [f"launch: rank {rank} failed with exit status 2 (user error); its message is above" for rank in (0, 1)]
    assert "Traceback" not in r.stderr


def test_an_output_folder_in_use_blames_no_rank_the_launcher_stopped(job, tmp_path):
    """Two jobs into one folder: the second stops with 2; the rank the launcher stopped after the first
    failure (SIGINT, possibly while it exited with its own error) is not reported as killed by SIGINT."""
    from dtrain.run.output import OutputLock

    held = OutputLock(tmp_path)  # the first job
    try:
        r = launch("-n", 2, "--port", free_port(), job["config"], "--train.output_dir", tmp_path)
    finally:
        held.release()
    assert r.returncode == 2, r.stderr
    assert f"dtrain: error: output folder {tmp_path} is in use by another dtrain run (pid {os.getpid()} on" in r.stderr
    # rank 0 met the error; rank 1 points to it (and was stopped by the launcher when rank 0's report came first)
    assert summary_lines(r.stderr) in (
        ["launch: rank 0 failed with exit status 2 (user error); its message is above",
         "launch: rank 1 failed with exit status 5 (after rank 0's error); its message is above"],
        ["launch: rank 0 failed with exit status 2 (user error); its message is above",
         "launch: rank(s) 1 stopped by the launcher"]), r.stderr


def test_a_refused_resume_on_two_ranks_shows_rank_0s_reason_once(job, tmp_path):
    """Rank 1 repeated rank 0's whole refusal ("rank 0: resume: ... different settings ...")."""
    shutil.copytree(job["tmp"] / "run", tmp_path / "run")
    r = launch("-n", 2, "--port", free_port(), job["config"], "--train.output_dir", tmp_path / "run",
               "--train.resume", "auto", "--train.steps", 4, "--train.learning_rate", 0.02)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dtrain: error:")]
    reason = (f"dtrain: error: resume: {tmp_path / 'run' / 'checkpoints' / 'step-0000002'} was made with different "
              "settings: train.learning_rate: 0.01 in the checkpoint, 0.02 now. These decide what is trained or what "
              "its eval/ metrics measure; set them back, or train into a new train.output_dir (README: Checkpoints and "
              "resume)")
    assert errors.count(reason) == 1, r.stderr
    # rank 1's line, unless the launcher stopped it first (after rank 0's exit)
    assert set(errors) - {reason} <= {"dtrain: error: rank 0 could not resume the run; see its message"}, r.stderr


def test_an_error_every_rank_meets_is_shown_once(job, tmp_path):
    """train.max_skipped_steps stops every rank with the same message (the same global batch, the same streak):
    ./launch showed it once per rank."""
    r = launch("-n", 2, "--port", free_port(), job["config"], "--train.output_dir", tmp_path / "run",
               "--train.steps", 6, "--train.learning_rate", "1e37", "--train.grad_clip", 0, "--train.warmup_steps", 0,
               "--train.max_skipped_steps", 2)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert len(errors) == 1 and "2 steps in a row had a non-finite loss or gradient" in errors[0], r.stderr


def test_one_rank_failure_points_to_its_message(job, tmp_path):
    r = launch(job["config"], "--model.path", tmp_path / "missing")
    assert r.returncode == 2
    assert summary_lines(r.stderr) == ["launch: rank 0 failed with exit status 2 (user error); its message is above"]
    assert "launch: rank 0 failed (" not in r.stderr  # said once: one rank has no other ranks to stop


def exit_with_closed_output(cmd: list) -> int:
    """Run ``cmd`` (in the repository) with stdout and stderr a pipe whose reader is gone before its
    first line, as under ``| head`` once head has ended; its exit status."""
    import subprocess

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.Popen(cmd, stdout=write, stderr=write, stdin=subprocess.DEVNULL, cwd=ROOT)
    finally:
        os.close(write)
    try:
        return wait_exit(proc)
    finally:
        kill_tree(proc)


@pytest.mark.parametrize("ranks,backend", [(1, None), (2, "ring"), (2, "mpi")])
def test_a_closed_output_changes_nothing(job, tmp_path, ranks, backend):
    """``./launch ... 2>&1 | head -4``: with its reader gone the launcher's writes fail (EPIPE), yet the job
    trains and saves to its end and exits 0; what the launcher and its ranks print is dropped."""
    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    group = ["--backend", backend, "--port", str(free_port())] if backend else []  # one rank takes no backend
    assert exit_with_closed_output([sys.executable, str(LAUNCH), "-n", str(ranks), *group, str(job["config"]),
                                    "--train.output_dir", str(tmp_path)]) == 0
    assert_same_adapter(job["tmp"] / "run" / ADAPTER, tmp_path / ADAPTER)


@pytest.mark.parametrize("backend", ["mpi", "ring"])
def test_a_closed_output_never_reaches_the_started_command(tmp_path, backend):
    """What mpirun (or mlx.launch) prints goes through the launcher: handed the launcher's closed stdout
    itself, mpirun died of SIGPIPE at its shutdown now and then, after every rank had saved (exit 243)."""
    script = ("import sys\n"
              "from dtrain.launch.plan import Plan\n"
              "from dtrain.launch.supervise import Attempt\n"
              f"plan = Plan({backend!r}, 0, [], ['sh', '-c', 'echo one; sleep 0.2; echo two; echo err >&2'], {{}}, [], [], 0, 0)\n"
              "attempt = Attempt(plan, 5.0)\n"
              "attempt.run()\n"
              "open(sys.argv[1], 'w').write(str([p.returncode for p in attempt.procs]))\n")
    assert exit_with_closed_output([sys.executable, "-c", script, str(tmp_path / "codes")]) == 0
    assert (tmp_path / "codes").read_text() == "[0]"  # not [-13]: the command's writes all went through


def test_dry_run_prints_ranks_env_and_shards(job):
    port = free_port()
    r = launch("-n", 3, "--port", port, "--dry-run", job["config"], "--train.global_batch_pairs", 5)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ranks: 3\nbackend: ring\nhosts: 127.0.0.1\n" in out
    # started by the launcher itself, not mlx.launch (which spins a core for the whole run)
    assert "\ncommand (each rank): " in out and "dtrain.launch.rank" in out and "mlx.launch" not in out
    ring = json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"], [f"127.0.0.1:{port + 2}"]])
    for rank, shard in enumerate((2, 2, 1)):
        assert f"rank {rank} on 127.0.0.1: shard {shard} pairs/step" in out
        assert f"  MLX_RANK={rank}\n" in out
    assert out.count(f"  MLX_HOSTFILE=<temp file> {ring}\n") == 3
    assert out.count("  PYTHONUNBUFFERED=1\n") == 3
    assert out.count("  DTRAIN_LOCAL_RANKS=3\n") == 3  # they share this machine's memory (dtrain.memory)
    assert "global batch: 5 pairs/step = 2 + 2 + 1 (micro-batches of 2)" in out  # train.micro_batch_pairs 4: at most 2 run


@pytest.mark.parametrize("ranks, overrides, line", [
    (2, [], "global batch: 8 pairs/step = 4 + 4 (micro-batches of 4)"),  # ./launch -n 2 --dry-run configs/demo.yaml
    (2, ["train.micro_batch_pairs=3"], "global batch: 8 pairs/step = 4 + 4 (micro-batches of 3)"),
    (1, [], "global batch: 8 pairs/step = 8 (micro-batches of 8)"),
    (2, ["objective.kind=sft"], "global batch: 8 rows/step = 4 + 4 (micro-batches of 4)"),  # as the trainer says
])
def test_the_dry_run_names_the_micro_batch_a_rank_runs(ranks, overrides, line):
    """--dry-run's batch line said "(micro batch 8 pairs per rank)" for 8 pairs on 2 ranks, where each
    rank runs one micro-batch of 4 (the key, not what runs; the first step's line names 4)."""
    from dtrain.config import load_config
    from dtrain.launch.plan import build_plan, describe

    cfg = load_config(overrides=["data.demo_pairs=16", "train.global_batch_pairs=8", "train.micro_batch_pairs=8",
                                 *overrides])
    assert line in describe(build_plan("job.yaml", [], cfg, ranks=ranks)).splitlines()


def test_dry_run_mpi_and_nccl_environment(job):
    r = launch("-n", 3, "--backend", "mpi", "--dry-run", job["config"])
    assert r.returncode == 0, r.stderr
    assert "backend: mpi" in r.stdout and " -np 3 " in r.stdout and "-x PYTHONUNBUFFERED=1" in r.stdout
    assert ("--oversubscribe" in r.stdout) == (3 > (os.cpu_count() or 1))
    assert ("--allow-run-as-root" in r.stdout) == (os.geteuid() == 0)
    # what each attempt passes to ranks mpirun may start on other hosts, as a real launch does (supervise.Attempt)
    assert "-x DTRAIN_STOP_TIMEOUT=60.0 -x DTRAIN_LAUNCHER=" in r.stdout and ":<launcher-pid> -x DTRAIN_JOB=<job-id> " in r.stdout
    port = free_port(1)
    r = launch("-n", 2, "--backend", "nccl", "--port", port, "--dry-run", job["config"])
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        block = r.stdout.split(f"rank {rank} on 127.0.0.1: shard 2 pairs/step\n")[1].split("\nrank ")[0]
        for line in (f"CUDA_VISIBLE_DEVICES={rank}", f"MLX_RANK={rank}", "MLX_WORLD_SIZE=2", "NCCL_HOST_IP=127.0.0.1",
                     f"NCCL_PORT={port}", "NCCL_NVLS_ENABLE=0", "PYTHONUNBUFFERED=1"):
            assert f"  {line}\n" in block + "\n", (rank, line)


@pytest.mark.parametrize("ranks, backend", [(2, "ring"), (2, "mpi"), (1, None)])
def test_sigint_stops_every_rank(job, tmp_path, ranks, backend):
    """Ctrl-C reaches every rank, which save a checkpoint and exit; no process is left. One rank (``./launch
    CONFIG``, the plainest run) ended the launcher in AttributeError's traceback: the stop wrote mlx.launch's
    Ctrl-C byte to the one rank's stdin, which the launcher does not hold."""
    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    out = tmp_path / "run"
    several = ["-n", ranks, "--backend", backend, "--port", free_port()] if ranks > 1 else []
    proc = spawn([sys.executable, LAUNCH, *several, job["config"], "--train.steps", 5000, "--train.output_dir", out],
                 tmp_path, "launch", cwd=ROOT)
    try:
        # a loss logged: every rank is past its first step (a stop before it would be a different test)
        wait_until(lambda: "loss" in read_scalars_of(out / "tb"), "the first step's loss in TensorBoard", proc)
        proc.send_signal(signal.SIGINT)
        code = wait_exit(proc, STOP_S)
    finally:
        kill_tree(proc)
    err = proc.err()
    assert code == 130 and "Traceback" not in err, err
    assert f"launch: SIGINT: stopping {ranks} rank(s)" in err
    assert "checkpoint saved" in err and (out / "checkpoints").is_dir()
    # every rank saved and exited 0 (dtrain.contract): none is reported as stopped by a signal or unsaved
    assert "stopped by a signal" not in err and "did not save" not in err, err
    if backend == "mpi":  # mpirun exits before its ranks finish saving (see the launcher's docstring)
        wait_until(lambda: not rank_processes(str(out)), "the MPI ranks to end", limit=STOP_S)
    assert not rank_processes(str(out))


def read_scalars_of(tb: Path) -> dict:
    """The scalars of the one TensorBoard run under ``tb`` ({} before it exists)."""
    from dtrain.run.tracking import read_scalars

    runs = list(tb.iterdir()) if tb.is_dir() else []
    return read_scalars(runs[0]) if runs else {}


def test_tensorboard_serves_the_runs_scalars(job, tmp_path):
    """--tensorboard serves <output_dir>/tb on loopback while the run lasts, then stops."""
    port = free_port()
    proc = spawn([sys.executable, LAUNCH, "--tensorboard", port, job["config"], "--train.steps", 5000,
                  "--train.output_dir", tmp_path / "run"], tmp_path, "launch", cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
        wanted = {"loss", "nll_loss", "log_odds_ratio", "rewards/accuracies", "grad_norm", "eval/loss"}
        # {run: {tag: ...}}: the run's tags grow as it logs (step 0's eval, then each step)
        served = wait_until(lambda: [run for run, tags in json.loads(http_get(url)).items() if wanted <= set(tags)],
                            "TensorBoard serving the run's scalars", proc)
        assert served == [p.name for p in (tmp_path / "run" / "tb").iterdir()]
    finally:
        proc.send_signal(signal.SIGINT)
        wait_exit(proc, STOP_S)
    assert f"launch: TensorBoard at http://127.0.0.1:{port}/" in proc.out()
    with pytest.raises(OSError):
        http_get(url)


def test_tensorboard_port_in_use_is_one_line(job):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = launch("--tensorboard", port, job["config"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: --tensorboard: port {port} on 127.0.0.1 is in use; pass another, e.g. --tensorboard {port + 1}")


@pytest.mark.parametrize("option, port", [("--port", 99999), ("--port", 0), ("--port", -1),
                                          ("--tensorboard", 70000), ("--tensorboard", 0), ("--tensorboard", -1)])
def test_a_port_outside_tcps_range_is_one_line(option, port, job):
    """`--tensorboard -1 CONFIG` took the default port and -1 as the config: "unrecognized arguments: CONFIG"."""
    r = launch(option, port, job["config"], "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"launch: error: {option} must be a TCP port, 1-65535; got {port}"


@pytest.mark.parametrize("option, value", [("--restart-delay", "inf"), ("--restart-delay", "nan"),
                                           ("--stop-timeout", "inf"), ("--stop-timeout", "nan")])
def test_seconds_that_are_not_finite_are_one_line(option, value, tmp_path):
    """--restart-delay inf ended in a traceback after the first failure, nan meant no delay at all."""
    r = launch(option, value, tmp_path / "job.yaml", "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: {option} must be a finite number of seconds; got {value}")


def test_a_restart_delay_longer_than_a_thread_can_wait_is_one_line(tmp_path):
    """--restart-delay 1e300 passed the finite check, and after the first failure the wait for the restart
    ended the launcher in OverflowError's traceback ('timestamp out of range for platform time_t')."""
    r = launch("--restart-delay", "1e300", tmp_path / "job.yaml", "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: --restart-delay must be at most {threading.TIMEOUT_MAX:.0f} seconds (the longest wait "
        f"Python's threads take); got 1e+300")


@pytest.mark.parametrize("args, named", [(["--backend", "ring"], "--backend ring"),
                                         (["--distributed.backend", "mpi"], "distributed.backend mpi")])
def test_one_rank_with_a_backend_is_refused_before_it_starts(args, named, tmp_path):
    """The rank failed joining its group (exit 4, which --max-restarts restarted); --backend was dropped silently."""
    config = tmp_path / "job.yaml"
    config.write_text("data: {demo_pairs: 4}\n")
    r = launch(*args, config, "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: {named} needs 2 or more ranks, and this launch starts one (MLX forms no group of one "
        f"process); pass -n N or --hostfile HOSTS.json, or leave the backend out to train on one rank")


def test_tensorboard_on_a_ranks_port_is_refused_before_they_start(tmp_path):
    """--tensorboard on a port of the ring (here --port P, 2 ranks: P and P+1) took it first, and rank 0 failed
    joining its group with "[ring] Couldn't bind socket (error: 98)"."""
    config = tmp_path / "job.yaml"
    config.write_text(f"data: {{demo_pairs: 4}}\ntrain: {{output_dir: {tmp_path / 'out'}}}\n")
    port = free_port(2)
    r = launch("-n", 2, "--backend", "ring", "--port", port, "--tensorboard", port + 1, config)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: --tensorboard {port + 1} is one of the ranks' ports ({port}-{port + 1}); pass another "
        f"--tensorboard, or another --port")
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.parametrize("args, named", [(["--train.output_dir", "--dry-run"], "--train.output_dir"),
                                         (["--train.steps", "-n", "2", "--dry-run"], "--train.steps"),
                                         (["--train.steps", "--port=32323", "--dry-run"], "--train.steps"),
                                         (["--dry-run", "--train.seed", "-h"], "--train.seed"),
                                         (["--train.output_dir", "--dry"], "--train.output_dir"),
                                         (["--train.output_dir", "-n2", "--dry-run"], "--train.output_dir")])
def test_an_override_without_its_value_before_a_launcher_option_is_named(args, named, tmp_path):
    """`./launch --train.output_dir --dry-run job.yaml` gave train.output_dir the value '--dry-run' and started
    the job, to train into a folder named --dry-run; `--train.steps -n 2` said "unrecognized arguments: job.yaml".
    argparse reads --dry as --dry-run and -n2 as -n 2, which took the value as well: a job started, into ./--dry
    or ./-n2."""
    config = tmp_path / "job.yaml"
    config.write_text(f"model: {{path: {tmp_path / 'no-model'}}}\ndata: {{demo_pairs: 4}}\n")
    r = launch(*args, config)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"launch: error: override {named} needs a value"]
    assert not any((ROOT / name).exists() for name in ("--dry-run", "--dry", "-n2"))
    from dtrain.launch.main import OPTIONS, _parser

    assert set(OPTIONS) == {s for a in _parser()._actions for s in a.option_strings} | {"-c", "--config"}


@pytest.mark.parametrize("args", [["-c"], ["-c", "job.yaml"], ["--config=job.yaml"], ["-n", "2", "-c", "job.yaml"]])
def test_a_config_given_with_dash_c_points_to_the_bare_form(args):
    """`./launch -c job.yaml` (dtrain's form) said "unrecognized arguments: -c", `./launch -c` that a config
    is required."""
    r = launch(*args)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.strip().splitlines() == [
        "launch: error: ./launch takes the config file bare, without -c/--config: ./launch [options] CONFIG"]


def test_a_path_of_non_utf8_bytes_is_shown_not_a_traceback(job, tmp_path):
    """A config file named with a byte that is not UTF-8 (\\xff) ended the launcher in UnicodeEncodeError's traceback
    as it wrote the error naming it, and so did --dry-run's plan with such a train.output_dir: the launcher's lines
    show it escaped, as Python's stderr does (dtrain's own errors)."""
    config = Path(os.fsdecode(os.fsencode(tmp_path) + b"/job\xff.yaml"))
    config.write_text("train:\n  steps: 3\n")
    shown = str(config).encode("utf-8", "backslashreplace").decode()
    r = launch(config, "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"launch: error: {shown}: set 'data.train' to a data file, folder or hub dataset id, or 'data.demo_pairs' > 0 "
        f"for generated pairs"]
    r = launch(job["config"], "--dry-run", "--train.output_dir", config.parent / "out\udcff")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "--train.output_dir=" + str(config.parent / "out\\udcff") in r.stdout


@pytest.mark.parametrize("extra", [[], ["--tensorboard", "0"]])
def test_an_output_dir_name_too_long_for_the_file_system_is_one_line(job, tmp_path, extra):
    """`./launch job.yaml --train.output_dir <a 300-character name>` ended the launcher in OSError's traceback ('File
    name too long') as it listed the folder's TensorBoard runs, or made tb/ for --tensorboard, before any rank
    started; `dtrain train` says it in one line."""
    out = tmp_path / ("x" * 300)
    extra = ["--tensorboard", str(free_port(1))] if extra else []
    r = launch(job["config"], *extra, "--train.output_dir", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"launch: error: {str(out)[:80]}...: not a usable path: File name too long"


@pytest.mark.parametrize("ranks", [65536, 100_000_000_000, 10**30])
def test_more_ranks_than_tcp_ports_is_one_line(ranks, job):
    """`-n 100000000000` ended the launcher in MemoryError's traceback (a host per rank), `-n 10**30` in
    OverflowError's, `-n 70000` in OSError's (a socket per ring port: too many open files)."""
    r = launch("-n", ranks, job["config"], "--dry-run")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"launch: error: -n must be at most 65535 (each rank on this machine listens on TCP ports of its own); "
        f"got {ranks}"]


def test_ring_ports_past_65535_are_one_line(job):
    r = launch("-n", 2, "--port", 65535, job["config"], "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "launch: error: --port 65535: the job needs 2 consecutive ports from it, past the last TCP port 65535; "
        "pass --port 65534 or lower")


def test_tensorboard_on_an_output_dir_that_is_a_file_is_one_line(job, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    r = launch("--tensorboard", free_port(1), job["config"], "--train.output_dir", blocker)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"launch: error: train.output_dir {blocker} is a file, not a folder; choose another train.output_dir")


def test_tensorboard_for_a_start_the_rank_refuses_leaves_no_new_folder(job, tmp_path):
    """--tensorboard made OUTPUT_DIR/tb before the ranks started: a start they refused (a model path that does not
    exist) left new/deep/tb/ behind. The launcher checks that it can be made; the run makes it."""
    r = launch("--tensorboard", free_port(1), job["config"], "--model.path", tmp_path / "missing",
               "--train.output_dir", tmp_path / "new" / "deep")
    assert r.returncode == 2, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], r.stderr


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.read().decode()


def rank_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (from ``ps``: Linux and macOS)."""
    return [pid for pid, (_, command) in processes().items() if marker in command]


def run_stopped_as_it_starts(plan, monkeypatch):
    """Run ``plan``'s :class:`Attempt` with a Ctrl-C (its stop) just before it starts the ranks; return it."""
    import subprocess

    from dtrain.launch import supervise

    attempt = supervise.Attempt(plan, 5.0)
    real_popen = subprocess.Popen

    def popen_after_a_stop(*args, **kwargs):
        if attempt.stopped_by is None:
            attempt.stop(signal.SIGINT)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(supervise.subprocess, "Popen", popen_after_a_stop)
    attempt.run()
    return attempt


def test_a_stop_while_the_ranks_start_reaches_them(monkeypatch):
    """Ctrl-C while the launcher was starting its ranks (before it held their processes) set the stop
    but told no rank: the job ran on to its end. Here the stop comes just before the one rank starts;
    the launcher passes it on at once, while the wrapper's Python is still starting: it waits (blocked)
    until the wrapper's handlers are in place, where it killed the wrapper before."""
    from dtrain.launch.plan import Plan

    wrapper = [sys.executable, "-m", "dtrain.launch.rank", "--", *TRAINER_STAND_IN]
    attempt = run_stopped_as_it_starts(Plan("ring", 1, [], wrapper, {}, [], [], 0, 0, direct=[{}]), monkeypatch)
    # the wrapper asked its child to stop (SIGINT), rather than sleeping out 20 s or dying of SIGUSR2
    assert [p.returncode for p in attempt.procs] == [128 + signal.SIGINT]
    assert [(r.code, r.stop) for r in attempt.reports.values()] == [(-signal.SIGINT, "SIGUSR2")]


def test_a_stop_before_mlx_launchs_ranks_have_their_handlers_reaches_them(monkeypatch):
    """A hostfile job stopped while mlx.launch started its ranks trained on to its end (then exit 130): the
    stop reached a rank on 127.0.0.1 while its bash or Python still ignored SIGUSR2 (mlx.launch's shield), and
    the Ctrl-C byte reached ssh before the rank's terminal was its own. Here a stand-in for mlx.launch starts
    the one rank's wrapper a second after the stop; the stop is sent again when its start report comes."""
    from dtrain.launch.plan import Plan

    import shlex

    rank = shlex.join([sys.executable, "-m", "dtrain.launch.rank", "--", *TRAINER_STAND_IN])
    mlx_launch = ["bash", "-c", f"sleep 1; exec {rank}", "--"]
    attempt = run_stopped_as_it_starts(Plan("ring", 1, ["127.0.0.1"], mlx_launch, {}, [], [], 0, 0, local=False),
                                       monkeypatch)
    assert [(r.code, r.stop) for r in attempt.reports.values()] == [(-signal.SIGINT, "SIGUSR2")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_stop_before_the_ranks_start_says_so(tmp_path, monkeypatch, capsys, sig):
    """Ctrl-C while the launcher read the config (before it started any rank) ended it with 130 and not a
    word: no line said the job was stopped, nor that nothing had started."""
    from dtrain.launch import main as launcher

    config = tmp_path / "job.yaml"
    config.write_text(f"data: {{demo_pairs: 4}}\ntrain: {{output_dir: {tmp_path / 'out'}}}\n")
    real_load = launcher.load_config

    def load_then_stop(*args, **kwargs):
        os.kill(os.getpid(), sig)  # the launcher's own handler takes it: no rank holds the stop yet
        return real_load(*args, **kwargs)

    monkeypatch.setattr(launcher, "load_config", load_then_stop)
    assert launcher.main([str(config)]) == 128 + sig
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"launch: {signal.Signals(sig).name}: stopped before any rank started", err
    assert not (tmp_path / "out").exists()


def test_a_stop_during_a_dry_run_says_so(tmp_path, monkeypatch, capsys):
    """Ctrl-C while ./launch --dry-run read the config was taken by the launcher's handler and forgotten: the
    plan was printed and the launcher exited 0, as if nothing had stopped it."""
    from dtrain.launch import main as launcher

    config = tmp_path / "job.yaml"
    config.write_text(f"data: {{demo_pairs: 4}}\ntrain: {{output_dir: {tmp_path / 'out'}}}\n")
    real_load = launcher.load_config

    def load_then_stop(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(launcher, "load_config", load_then_stop)
    assert launcher.main([str(config), "--dry-run"]) == 128 + signal.SIGINT
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "launch: SIGINT: stopped before any rank started", err


STOP_AT_IMPORT = """import os, runpy, signal, sys
sig = int(sys.argv[1])
class StopAt:  # the stop signal comes as the launcher imports yaml (its config reader), before main() runs
    def find_spec(self, name, path=None, target=None):
        if name == "yaml":
            os.kill(os.getpid(), sig)
sys.meta_path.insert(0, StopAt())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_a_stop_while_the_launcher_loads_is_one_line(tmp_path, sig):
    """Ctrl-C while ./launch imported its modules (yaml, numpy: a second on a busy machine) ended it in a
    KeyboardInterrupt traceback; SIGTERM and SIGHUP killed it without a word."""
    import subprocess

    config = tmp_path / "job.yaml"
    config.write_text(f"data: {{demo_pairs: 4}}\ntrain: {{output_dir: {tmp_path / 'out'}}}\n")
    r = subprocess.run([sys.executable, "-c", STOP_AT_IMPORT, str(int(sig)), str(LAUNCH), str(config)],
                       capture_output=True, text=True, cwd=ROOT, timeout=STOP_S)
    assert r.returncode == 128 + sig and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == f"launch: {signal.Signals(sig).name}: stopped before any rank started"
    assert not (tmp_path / "out").exists()


def test_a_stop_while_the_trainer_starts_ends_it_in_one_line(monkeypatch, tmp_path):
    """A stop that reached a rank's trainer while its Python started or imported dtrain (a second or more under
    load) ended it in a KeyboardInterrupt traceback, or 'Fatal Python error: init_import_site'. Here the stop
    comes before the wrapper starts, so its SIGINT reaches the trainer at once: it waits for dtrain's handling."""
    from dtrain.launch.plan import Plan

    wrapper = [sys.executable, "-m", "dtrain.launch.rank", "--", sys.executable, "-m", "dtrain", "train",
               "-c", str(tmp_path / "job.yaml")]
    attempt = run_stopped_as_it_starts(Plan("ring", 1, [], wrapper, {}, [], [], 0, 0, direct=[{}]), monkeypatch)
    assert [(r.code, r.stop, r.tail) for r in attempt.reports.values()] == [(130, "SIGUSR2", ["dtrain: interrupted"])]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_a_stop_while_mpirun_starts_the_ranks_stops_each_wrapper(monkeypatch):
    """Under MPI the stop goes to mpirun, which forwards it (SIGUSR2) to every rank's wrapper: sent as mpirun
    started them, it killed a wrapper whose Python had no handler yet ('mpirun noticed that process rank 0 ...
    exited on signal 12'), its rank reported nothing. It waits now until every rank reported its start."""
    from dtrain.launch.plan import Plan

    flags = ["-np", "2", "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    mpirun = [shutil.which("mpirun"), *flags, "--", sys.executable, "-m", "dtrain.launch.rank", "--", *TRAINER_STAND_IN]
    attempt = run_stopped_as_it_starts(Plan("mpi", 2, ["127.0.0.1"] * 2, mpirun, {}, [], [], 0, 0), monkeypatch)
    assert sorted((rank, r.code, r.stop) for rank, r in attempt.reports.items()) == [
        (0, -signal.SIGINT, "SIGUSR2"), (1, -signal.SIGINT, "SIGUSR2")]


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_stop_at_any_moment_of_start_up_ends_cleanly(job, tmp_path, backend):
    """Ctrl-C swept over a 2-rank job's start-up (the launcher's imports, its plan, the ranks' Python, their
    imports and model load, the first step): whatever it meets, the launcher exits 130 with no traceback
    (KeyboardInterrupt's, from the launcher, a wrapper or a trainer), no wrapper killed by mpirun's forward, and
    no process left. The launcher starts with the stop signals blocked, as ./launch's first lines block them: a
    signal before those lines run meets the interpreter's own start-up, which no script can handle (killed by
    SIGINT, or 'Fatal Python error: init_import_site'); under load the 0.2 s stop fell there now and then."""
    if backend == "mpi" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    import time

    from dtrain.contract import STOP_SIGNALS

    for i, delay in enumerate((0.0, 0.2, 0.6, 1.0, 1.5, 2.2)):
        out = tmp_path / f"run{i}"
        proc = spawn([sys.executable, LAUNCH, "-n", 2, "--backend", backend, "--port", free_port(), job["config"],
                      "--train.steps", 5000, "--train.output_dir", out], tmp_path, f"launch{i}", cwd=ROOT,
                     preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS))
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            code = wait_exit(proc, STOP_S)
            wait_until(lambda: not rank_processes(str(out)), "every rank to end", limit=STOP_S)
        finally:
            kill_tree(proc)
        err = proc.err()
        assert code == 130, (delay, err)
        for sign in ("Traceback", "KeyboardInterrupt", "Fatal Python error", "exited on signal"):
            assert sign not in err, (delay, err)
        # the launcher said what it did; its line may come before a rank's last one (relayed later)
        assert any(line.startswith("launch: ") for line in err.splitlines()), (delay, err)


def test_a_stop_signal_sent_to_one_rank_in_its_start_up_stops_the_job_without_a_restart(capsys):
    """``kill PID`` of rank 1's trainer while it starts (before its stop handlers: ``dtrain: interrupted``, exit
    status 143) read as rank 1's failure: the launcher aborted rank 0, said 'rank 1 failed with exit status 143'
    and --max-restarts started the job again, where the same signal after the first step stops it for good.
    Here rank 1's stand-in ends as such a trainer does; rank 0's is asked to stop, not aborted."""
    from dtrain.launch import supervise
    from dtrain.launch.plan import Plan

    trainer = [sys.executable, "-c", "import os, sys\n"
               "if os.environ['MLX_RANK'] == '1':\n"
               "    print('dtrain: interrupted', file=sys.stderr); sys.exit(143)\n"
               + TRAINER_STAND_IN[2]]
    wrapper = [sys.executable, "-m", "dtrain.launch.rank", "--", *trainer]
    plan = Plan("ring", 2, [], wrapper, {}, [], [], 0, 0, direct=[{"MLX_RANK": "0"}, {"MLX_RANK": "1"}])
    outcome = supervise.Attempt(plan, 5.0).run()
    err = capsys.readouterr().err
    assert outcome.stopped_by == signal.SIGTERM and outcome.code == 143 and not outcome.restartable, err
    assert ("launch: rank 1 got SIGTERM from outside the launcher and ended (exit status 143): stopping every rank, "
            "as on the launcher's own SIGTERM (no restart)") in err
    assert "failed" not in err
    assert [(r, outcome.reports[r].code, outcome.reports[r].stop) for r in (0, 1)] == [
        (0, -signal.SIGINT, "SIGUSR2"), (1, 143, "SIGTERM")]
