"""Data parallelism for real: subprocess ranks of ``tests/dist_worker.py`` on loopback.

Ring ranks get the variables mlx.launch sets (``MLX_RANK``, ``MLX_HOSTFILE``);
one test goes through ``mlx.launch`` itself, others through OpenMPI's
``mpirun``. They check that N ranks train the same adapter as 1 rank with the
same global batch, that uneven shards use every pair the expected number of
times, that a dead or stalled rank cannot freeze the others, and that the
start-up handshake and the weight sync check stop every rank with a message.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dtrain import sampler
from dtrain.blas import blas_env
from fixtures_launch import free_port
from waiting import JOB_S, finish as finish_proc

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
MLX_LAUNCH = Path(sys.executable).parent / "mlx.launch"
MPIRUN = shutil.which("mpirun")


def rank_env(extra: dict | None = None) -> dict:
    env, _ = blas_env(dict(os.environ))
    for key in [k for k in env if k.startswith(("MLX_", "OMPI_", "PMI_"))]:
        del env[key]  # never inherit a launcher's variables from the test runner
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", **(extra or {}))
    return env


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now, outside the ephemeral range (``fixtures_launch.free_port``)."""
    base = free_port(n)
    return list(range(base, base + n))


def start_ring(n: int, out: Path, *args: str, disks: list[Path] | None = None) -> list[subprocess.Popen]:
    """``n`` worker ranks joined by the ring backend on 127.0.0.1, as mlx.launch would start them.

    ``disks``: one folder per rank, as separate machines would have: rank r
    runs in ``disks[r]`` (its working folder and its OUT_DIR); pass a relative
    ``train.output_dir`` so that every rank has the same config.
    """
    out.mkdir(parents=True, exist_ok=True)
    hostfile = out / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    for d in disks or []:
        d.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([sys.executable, str(WORKER), str(disks[r] if disks else out), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=disks[r] if disks else None,
                             env=rank_env({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}))
            for r in range(n)]


def finish(procs, timeout: float = JOB_S) -> list[tuple[int, str, float]]:
    """``(returncode, stderr, seconds)`` per rank, all ended within ``timeout`` s (else killed, and the test fails)."""
    start, results = time.monotonic(), []
    for p in procs:
        code, _, err = finish_proc(p, max(timeout - (time.monotonic() - start), 0.1))
        results.append((code, err, time.monotonic() - start))
    return results


def run_cmd(cmd: list[str], timeout: float = JOB_S, cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env(), cwd=cwd)
    code, out, err = finish_proc(proc, timeout)
    return subprocess.CompletedProcess(cmd, code, out, err)


def mpirun(n: int, *args: str) -> list[str]:
    return [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), "-x", "LD_PRELOAD", "-x", "PYTHONPATH",
            "-x", "OPENBLAS_NUM_THREADS", "-x", "PYTHONUNBUFFERED", sys.executable, str(WORKER), *args]


def reports(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def lora(out: Path, rank: int = 0) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(out / f"rank{rank}.safetensors")).items()}


def relative_l2(a: dict, b: dict) -> float:
    """``||a - b|| / ||a||`` over all LoRA weights together."""
    return float(np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a) / sum((a[k] ** 2).sum() for k in a)))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: the same job on one rank, no launcher (so no distributed setup at all)."""
    out = tmp_path_factory.mktemp("one_rank")
    done = run_cmd([sys.executable, str(WORKER), str(out)])
    assert done.returncode == 0, done.stderr
    return out


def assert_same_as_one_rank(out: Path, n: int, one: Path, backend: str) -> None:
    ref, got = reports(one, 1)[0], reports(out, n)
    assert [g["size"] for g in got] == [n] * n and {g["backend"] for g in got} == {backend}
    ref_loss = [h["loss"] for h in ref["history"]]
    for g in got:  # every rank logs the same reduced metrics, equal to one rank's
        np.testing.assert_allclose([h["loss"] for h in g["history"]], ref_loss, rtol=1e-6)
        np.testing.assert_allclose([h["grad_norm"] for h in g["history"]], [h["grad_norm"] for h in ref["history"]], rtol=1e-5)
        np.testing.assert_allclose(g["evals"]["5"]["eval/loss"], ref["evals"]["5"]["eval/loss"], rtol=1e-6)
    weights = [lora(out, r) for r in range(n)]
    for w in weights[1:]:  # every rank applied the same updates, bit for bit
        assert all(np.array_equal(w[k], weights[0][k]) for k in w)
    assert relative_l2(lora(one), weights[0]) <= 1e-5
    assert got[0]["adapter"] and all(g["adapter"] is None for g in got[1:])  # rank 0 alone writes it
    on_disk = mx.load(str(Path(got[0]["adapter"]) / "adapters.safetensors"))
    assert all(np.array_equal(np.array(on_disk[k]), weights[0][k]) for k in weights[0])


@pytest.mark.parametrize("n", [2, 3])
def test_ring_ranks_train_the_same_adapter_as_one_rank(tmp_path, one_rank, n):
    results = finish(start_ring(n, tmp_path, "train.micro_batch_pairs=2"))
    assert [rc for rc, _, _ in results] == [0] * n, [err[-2000:] for _, err, _ in results]
    assert all(err.strip() == "" for _, err, _ in results[1:])  # other ranks print nothing without errors
    assert_same_as_one_rank(tmp_path, n, one_rank, "ring")


def test_mlx_launch_two_ranks(tmp_path, one_rank):
    if not MLX_LAUNCH.exists():
        pytest.skip(f"mlx.launch not found next to {sys.executable}")
    # mlx.launch's own first port, 32323, is the launcher's default too: a job running beside the suite held it
    done = run_cmd([str(MLX_LAUNCH), "-n", "2", "--starting-port", str(free_port(2)), "--python", sys.executable,
                    "--", str(WORKER), str(tmp_path)])
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_as_one_rank(tmp_path, 2, one_rank, "ring")


@pytest.mark.parametrize("n", [2, 3])
def test_mpirun_ranks_train_the_same_adapter_as_one_rank(tmp_path, one_rank, n):
    if MPIRUN is None or not mx.distributed.is_available("mpi"):
        pytest.skip("mpirun (OpenMPI) or MLX's MPI backend not available")
    done = run_cmd(mpirun(n, str(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_as_one_rank(tmp_path, n, one_rank, "mpi")


@pytest.mark.parametrize("batch, uses", [(5, 5), (2, 2)])
def test_uneven_shards_use_every_pair_the_expected_number_of_times(tmp_path, batch, uses):
    """7 pairs on 3 ranks for 7 steps: batch 5 gives shards of 2, 2, 1; batch 2
    leaves rank 2 without pairs at every step. 7 * batch positions are exactly
    ``batch`` epochs, so each pair is trained on ``batch`` times in all."""
    args = ["--pairs", "7", "train.steps=7", f"train.global_batch_pairs={batch}", "train.micro_batch_pairs=1"]
    results = finish(start_ring(3, tmp_path, *args))
    assert [rc for rc, _, _ in results] == [0, 0, 0], [err[-2000:] for _, err, _ in results]
    got = reports(tmp_path, 3)
    total = collections.Counter()
    for step in range(1, 8):
        per_rank = [g["pairs"].get(str(step), []) for g in got]
        expected = [f"gen:{i}" for _, i in sampler.global_batch(step, 7, batch, 0)]
        assert [len(p) for p in per_rank] == [len(expected[r::3]) for r in range(3)]
        assert sorted(sum(per_rank, [])) == sorted(expected)  # disjoint shards covering the batch
        total.update(sum(per_rank, []))
    assert total == {f"gen:{i}": uses for i in range(7)}
    assert all(len(g["history"]) == 7 for g in got)
    assert len({json.dumps([h["loss"] for h in g["history"]]) for g in got}) == 1


def test_killed_rank_makes_every_other_rank_exit(tmp_path):
    timeout_s = 10
    procs = start_ring(3, tmp_path, "--kill-at", "3:1", "train.steps=20", f"distributed.collective_timeout_s={timeout_s}")
    results = finish(procs)  # no rank waits for ever: each ends by an error or its watchdog (timeout_s)
    assert results[1][0] == -signal.SIGKILL
    for rank in (0, 2):
        rc, err, seconds = results[rank]
        assert rc != 0, (rank, rc, seconds, err[-1000:])
        assert f"rank {rank}: " in err and "at step 3" in err, err[-1000:]


def test_stalled_rank_trips_the_watchdog_of_the_others(tmp_path):
    """A SIGSTOPped peer keeps its sockets open, so only a watchdog ends the wait.

    Ranks 0 and 1 start their watchdogs within milliseconds of each other; the
    first to fire exits (status 3), and the other may then see that rank's
    sockets close before its own watchdog fires (status 2, "connection to a peer
    was lost").  Either way every live rank stops, names step 3, and at least
    one of them says it was the watchdog."""
    timeout_s = 5
    procs = start_ring(3, tmp_path, "--stall-at", "3:2", "train.steps=20", f"distributed.collective_timeout_s={timeout_s}")
    try:
        results = finish(procs[:2])
    finally:
        procs[2].kill()
        procs[2].communicate()
    watchdog = "all_sum of LoRA gradients (1 bucket(s)) at step 3 did not complete within {} s".format(timeout_s)
    lost = "all_sum of LoRA gradients (1 bucket(s)) at step 3 failed: [ring] connection to a peer was lost"
    fired = []
    for rank, (rc, err, seconds) in enumerate(results):
        assert rc in (2, 3), (rank, rc, err[-1000:])
        message = watchdog if rc == 3 else lost
        assert f"dtrain: error: rank {rank}: {message}" in err, (rank, err[-1000:])
        fired.append(rc == 3)
    assert any(fired), [err[-500:] for _, err, _ in results]


@pytest.mark.parametrize("call, what", [("handshake", "start-up handshake at start-up"),
                                        ("sync", "LoRA weight sync check at step 7")])
def test_a_gather_after_a_peer_died_fails_as_a_lost_peer(tmp_path, call, what):
    """MLX 0.32's ring returns garbage, not an error, when an unevaluated all_gather is read with np.array:
    rank 1 read the dead rank 0's text as '' (a JSONDecodeError traceback in the handshake, 'the ranks
    drifted apart' with exit status 2 in the sync check, which --max-restarts does not retry)."""
    procs = start_ring(2, tmp_path, "--lost-peer", call)
    assert finish(procs[:1])[0][0] == 0
    (tmp_path / "go").touch()
    rc, err, _ = finish(procs[1:])[0]
    assert rc == 0, err[-1000:]
    assert json.loads((tmp_path / "lost1.json").read_text()) == {
        "error": "CollectiveError", "message": f"rank 1: {what} failed: [ring] connection to a peer was lost"}


def test_handshake_names_what_differs_and_where(tmp_path):
    """The config's keys that differ are named: "config differs" alone sent the user diffing config files
    that can be the same (an ``auto`` value resolved otherwise on another machine)."""
    procs = start_ring(3, tmp_path, "--data-seed", "1:7", "--rank-override", "2:lora.rank=4")
    results = finish(procs)
    for rc, err, _ in results:  # every rank stops, each with the same one-line message
        assert rc == 2, err[-1000:]
        line = [x for x in err.splitlines() if x.startswith("dtrain: error:")]
        assert line == ["dtrain: error: ranks disagree before training: config differs on rank(s) 2 from rank 0 (lora.rank); "
                        "data differs on rank(s) 1 from rank 0; lora shapes differs on rank(s) 2 from rank 0"]


def test_weight_drift_is_detected_on_every_rank(tmp_path):
    results = finish(start_ring(2, tmp_path, "--drift-at", "1:1"))
    for rc, err, _ in results:
        assert rc == 2 and "dtrain: error: step 2: LoRA weights on rank(s) 1 differ from rank 0" in err, err[-1000:]


def test_too_many_skipped_steps_stop_every_rank_after_rank_0_saved(tmp_path):
    """train.max_skipped_steps: every rank stops with "saved a checkpoint and stopped", but ranks 1+ raised
    at once while rank 0 was still writing it; under ./launch the first rank to exit (status 2) makes the
    launcher abort the others, and a rank 0 still saving after ABORT_GRACE_S (3 s) was killed: no checkpoint,
    though every rank had said it was saved."""
    procs = start_ring(2, tmp_path, "--slow-save", "3", "train.learning_rate=1e30", "train.warmup_steps=0",
                       "train.max_skipped_steps=2", "train.steps=8")
    rc, err, _ = finish(procs[1:])[0]  # rank 1 first: it must not end before rank 0's checkpoint is written
    assert rc == 2 and "saved a checkpoint and stopped" in err, err[-1000:]
    saved = sorted(p.name for p in tmp_path.glob("saved-*"))
    assert len(saved) == 1, saved
    rc, err, _ = finish(procs[:1])[0]
    assert rc == 2 and "saved a checkpoint and stopped" in err, err[-1000:]
    assert (tmp_path / "run" / "checkpoints" / f"step-{int(saved[0][6:]):07d}").is_dir()


def test_a_save_past_the_collective_timeout_names_its_step(tmp_path):
    """Rank 1's watchdog while rank 0 saves the skipped-steps checkpoint said "... at start-up did not complete"."""
    procs = start_ring(2, tmp_path, "--slow-save", "6", "train.learning_rate=1e30", "train.warmup_steps=0",
                       "train.max_skipped_steps=2", "train.steps=8", "distributed.collective_timeout_s=2")
    rc, err, _ = finish(procs[1:])[0]
    finish(procs[:1])
    saved = sorted(p.name for p in tmp_path.glob("saved-*"))
    assert rc == 3 and len(saved) == 1, (rc, saved, err[-1000:])
    assert (f"dtrain: error: rank 1: all_sum after rank 0's attempt to save its checkpoint at step {saved[0][6:]} "
            f"did not complete within 2 s") in err, err[-1000:]


@pytest.mark.parametrize("n", [2, 3])
def test_bucketed_all_sum_matches_mpi4py_allreduce(tmp_path, n):
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'dtrain[mpi]')")
    if MPIRUN is None or not mx.distributed.is_available("mpi"):
        pytest.skip("mpirun (OpenMPI) or MLX's MPI backend not available")
    done = run_cmd(mpirun(n, str(tmp_path), "--allreduce-check"))
    assert done.returncode == 0, done.stderr[-2000:]
    for r in range(n):
        cases = json.loads((tmp_path / f"allreduce{r}.json").read_text())["cases"]
        small, big = cases
        assert small["calls"] == [1024, small["elements"] - 1024]  # 4 KiB of float32, the 1000-leaf split
        assert big["calls"] == [8 * 1024 * 1024, big["elements"] - 8 * 1024 * 1024]  # 32 MiB; the 36 MiB leaf split
        for case in cases:
            assert len(case["calls"]) == case["expected_calls"]  # one all_sum per bucket
            assert case["shapes_kept"] and case["max_abs_diff"] <= 1e-6 * case["max_abs"], case


def test_broadcast_gives_every_rank_rank_0s_bits(tmp_path):
    """-0.0, NaN, inf, a subnormal, uint64 > 2**32, int32 and bfloat16 arrive bit for bit."""
    import struct

    results = finish(start_ring(3, tmp_path, "--broadcast-check"))
    assert [rc for rc, _, _ in results] == [0, 0, 0], [err[-1000:] for _, err, _ in results]
    got = [json.loads((tmp_path / f"broadcast{r}.json").read_text()) for r in range(3)]
    assert got[1] == got[0] and got[2] == got[0]
    f32 = bytes.fromhex(got[0]["hex"]["f32"])
    assert f32 == struct.pack("<6f", -0.0, 0.0, float("nan"), float("-inf"), 1e-45, 3.5)
    assert bytes.fromhex(got[0]["hex"]["step"]) == struct.pack("<Q", 2**40 + 7)
    assert bytes.fromhex(got[0]["hex"]["i32"]) == struct.pack("<4i", -5, 7, 0, 1)
    assert got[0]["shapes"] == {"bf16": [6], "f32": [6], "i32": [2, 2], "step": []}


def test_handshake_compares_the_initial_adapters_weights(tmp_path):
    """Two machines whose train.init_adapter (one path in one config) holds different weights: the
    ranks started from different LoRA weights (and DPO's reference of each rank's share was another
    model's), which only the weight sync check noticed, as a drift, distributed.check_sync_every steps
    later (default 50); the handshake compared the config's text, the base model and the LoRA shapes."""
    from test_lora_options import write_adapter

    disks = [tmp_path / "mac0", tmp_path / "mac1"]
    for seed, disk in zip((5, 6), disks):
        write_adapter(disk / "init", rank=2, scale=3.0, seed=seed)
    results = finish(start_ring(2, tmp_path, "train.output_dir=run", "train.init_adapter=init",
                                "distributed.check_sync_every=1", disks=disks))
    for rc, err, _ in results:  # every rank stops before step 1, each with the same one-line message
        assert rc == 2, err[-1000:]
        line = [x for x in err.splitlines() if x.startswith("dtrain: error:")]
        assert line == ["dtrain: error: ranks disagree before training: initial adapter differs on rank(s) 1 from "
                        "rank 0"], err[-1000:]


def test_handshake_compares_the_tokenized_pairs(tmp_path):
    """The same data file tokenized differently on two machines (a data.chat_template file, one path in
    one config, that differs between them; another tokenizer version): the handshake compared the raw
    data's fingerprint, so each rank trained its shards of other token ids, and the sync check never
    noticed (the summed gradients keep the weights equal): a run unlike any one-rank run."""
    procs = start_ring(2, tmp_path, "--data-seed", "1:7", "--raw-fingerprint", "same-data-file")
    for rc, err, _ in finish(procs):
        assert rc == 2, err[-1000:]
        line = [x for x in err.splitlines() if x.startswith("dtrain: error:")]
        assert line == ["dtrain: error: ranks disagree before training: data differs on rank(s) 1 from rank 0"]
