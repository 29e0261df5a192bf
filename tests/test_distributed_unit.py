"""dtrain.distributed in one process: buckets, the launcher's environment,
world size 1 without setup, and the watchdog's exit and messages."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from dtrain.distributed import (BUCKET_BYTES, EXIT_TIMEOUT, Group, Watchdog, bucket_bounds, check_in_sync, handshake,
                                init_group, launcher_backend)
from dtrain.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_bucket_bounds_cover_every_element_once_within_the_limit():
    assert bucket_bounds(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]
    bounds = bucket_bounds(20_000_001)  # float32: 8 Mi elements per 32 MiB bucket
    assert bounds == [(0, 8388608), (8388608, 16777216), (16777216, 20000001)]
    assert max(b - a for a, b in bounds) * 4 == BUCKET_BYTES and bucket_bounds(0) == []
    with pytest.raises(ValueError, match="holds no element"):
        bucket_bounds(5, 4, 3)


def test_launcher_backend_reads_each_launchers_variables(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]))
    assert launcher_backend({}) == (None, 1)
    assert launcher_backend({"MLX_RANK": "1", "MLX_HOSTFILE": str(hosts)}) == ("ring", 3)
    assert launcher_backend({"MLX_RANK": "0", "MLX_HOSTFILE": ""}) == (None, 1)  # mlx.launch -n 1
    assert launcher_backend({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}) == ("mpi", 4)
    assert launcher_backend({"MLX_JACCL_COORDINATOR": "10.0.0.1:5000", "MLX_RANK": "0"}) == ("jaccl", 0)


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE"])
def test_a_world_size_that_is_not_a_number_is_one_line(var):
    """OMPI_COMM_WORLD_SIZE=x ended `dtrain train` in int()'s traceback."""
    with pytest.raises(UserError) as err:
        init_group("any", env={var: "x", "NCCL_HOST_IP": "127.0.0.1", "MLX_RANK": "0"})
    assert str(err.value) == (f"{var}='x' in the environment is not a whole number of ranks; start every rank "
                              f"with ./launch (or mpirun, mlx.launch), or unset {var} to train alone")


@pytest.mark.parametrize("var", ["MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])
@pytest.mark.parametrize("value", ["x", "\u00b2"])
def test_a_rank_that_is_not_a_number_is_one_line(var, value):
    """MLX_RANK=x trained alone as rank 0; MLX_RANK=\u00b2 ended in int()'s traceback."""
    with pytest.raises(UserError) as err:
        init_group("any", env={var: value})
    assert str(err.value) == (f"{var}={value!r} in the environment is not a whole-number rank; start every rank "
                              f"with ./launch (or mpirun, mlx.launch), or unset {var} to train alone")


@pytest.mark.parametrize("value", ["x", "\u00b2"])
def test_a_world_size_that_is_not_a_number_is_one_line_without_a_launcher(value):
    """MLX_WORLD_SIZE=x outside NCCL was ignored (a run of one); MLX_WORLD_SIZE=\u00b2 ended in a traceback."""
    with pytest.raises(UserError) as err:
        init_group("any", env={"MLX_WORLD_SIZE": value})
    assert str(err.value) == (f"MLX_WORLD_SIZE={value!r} in the environment is not a whole number of ranks; start "
                              f"every rank with ./launch (or mpirun, mlx.launch), or unset MLX_WORLD_SIZE to train alone")


def test_one_rank_needs_no_setup():
    for backend in ("any", "none"):
        g = init_group(backend, env={})
        assert (g.rank, g.size, g.mlx_group) == (0, 1, None) and g.is_main
    tree = {"a": mx.ones((2, 3))}
    assert Group().all_sum_tree(tree, 1) is tree
    assert Group().all_sum_scalars({"loss": 2.5, "pairs": 4}, 1) == {"loss": 2.5, "pairs": 4.0}
    assert Group().all_gather_text("héllo", 1) == ["héllo"]
    handshake(Group(), {"config": 1})
    check_in_sync(Group(), tree, 3)


def test_explicit_backend_that_cannot_start_is_one_line():
    with pytest.raises(UserError) as err:
        init_group("ring", env={})  # no MLX_HOSTFILE: the ring has no peers to join
    assert "ring" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("backend", ["ring", "nccl", "jaccl"])
def test_a_backend_without_its_launcher_points_to_launch(backend, monkeypatch):
    """`dtrain train --distributed.backend ring` alone failed as a lost peer (exit 4) with MLX's message."""
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": True)
    with pytest.raises(UserError) as err:
        init_group(backend, env={})
    assert err.value.__class__ is UserError  # exit status 2
    assert str(err.value) == (f"distributed.backend is {backend}, but no launcher started this process (its "
                              f"environment names no other ranks); start the ranks with ./launch -n N or ./launch "
                              f"--hostfile HOSTS.json, or set distributed.backend any to train alone")


def test_a_backend_this_mlx_lacks_is_a_user_error_naming_the_ones_it_has(monkeypatch):
    """nccl without CUDA failed as a lost peer (exit 4, which ./launch --max-restarts restarted)."""
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": backend in ("ring", "mpi"))
    with pytest.raises(UserError) as err:
        init_group("nccl", env={"MLX_RANK": "0", "NCCL_HOST_IP": "10.0.0.1", "MLX_WORLD_SIZE": "2"})
    assert err.value.__class__ is UserError  # exit status 2: a restart would repeat it
    assert str(err.value) == (f"distributed backend 'nccl' is not in this MLX {mx.__version__}; it has: ring, mpi "
                              f"(dtrain doctor lists them)")


def test_jaccl_missing_names_what_it_needs_and_the_ring(monkeypatch):
    """A JACCL rank on macOS before 26.2 (no librdma.dylib, or an MLX built without JACCL) read "backend 'jaccl'
    is not in this MLX", pointing at the MLX install; MLX builds JACCL for macOS 26.2+ only and loads macOS's
    librdma.dylib (mlx/distributed/jaccl: CMakeLists.txt, utils.cpp), which needs RDMA enabled to find devices."""
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": backend in ("ring", "mpi"))
    with pytest.raises(UserError) as err:
        init_group("any", env={"MLX_RANK": "0", "MLX_JACCL_COORDINATOR": "10.0.0.1:5000"})
    assert err.value.__class__ is UserError  # exit status 2: a restart would repeat it
    assert str(err.value) == (
        f"distributed backend 'jaccl' is not available to MLX {mx.__version__} here: MLX's JACCL (RDMA over "
        f"Thunderbolt 5) needs macOS 26.2 or later with RDMA enabled (once, in macOS Recovery: rdma_ctl enable) "
        f"and an MLX built for macOS 26.2 or later; this MLX has: ring, mpi (dtrain doctor lists them); the ring "
        f"backend runs over Thunderbolt too (--backend ring, with the Macs' Thunderbolt Bridge IPs)")


def test_watchdog_turns_an_mlx_error_into_a_user_error():
    with pytest.raises(UserError, match=r"^rank 2: all_sum of metrics at step 7 failed: \[ring\] connection to a peer was lost$"):
        with Watchdog(2, "all_sum of metrics", 7, 30):
            raise RuntimeError("[ring] connection to a peer was lost")
    with Watchdog(0, "x", None, 30) as w:  # a block that finishes in time leaves no timer behind
        pass
    assert not w._timer.is_alive()


def test_a_watchdog_longer_than_a_thread_can_wait_waits(monkeypatch):
    """distributed.collective_timeout_s 1e300 passed the config; each collective's timer thread then ended in
    OverflowError's traceback ('timestamp out of range for platform time_t'), and the watchdog was off."""
    failed = []
    monkeypatch.setattr(threading, "excepthook", failed.append)
    with Watchdog(0, "x", None, 1e300) as w:
        w._timer.join(1.0)  # the timer thread raised at once
        assert w._timer.is_alive()
    assert failed == []


def test_watchdog_ends_a_stuck_process_with_a_message():
    code = ("import time; from dtrain.distributed import Watchdog\n"
            "with Watchdog(1, 'all_sum of LoRA gradients (1 bucket(s))', 4, 0.5):\n    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == EXIT_TIMEOUT
    assert done.stderr.strip() == ("dtrain: error: rank 1: all_sum of LoRA gradients (1 bucket(s)) at step 4 did not "
                                   "complete within 0.5 s (distributed.collective_timeout_s); a peer rank died or stalled")


def test_a_rank_above_zero_without_a_group_stops():
    with pytest.raises(UserError) as err:
        init_group("any", env={"MLX_RANK": "1"})
    assert str(err.value) == ("MLX_RANK=1 says this process is rank 1, but it joined no group (no launcher variables "
                              "name the other ranks); start every rank with ./launch or mlx.launch, or unset MLX_RANK "
                              "to train alone")
    with pytest.raises(UserError, match=r"^OMPI_COMM_WORLD_RANK=2 says this process is rank 2, but it joined no group "
                                        r"\(distributed.backend is none\)"):
        init_group("none", env={"OMPI_COMM_WORLD_RANK": "2"})
    assert init_group("any", env={"MLX_RANK": "0"}).size == 1  # rank 0 alone is a run of one


def test_a_world_size_announced_without_a_group_stops():
    """Issue 22: MLX_RANK=0 MLX_WORLD_SIZE=2 and no hostfile trained alone as world size 1 and exited 0."""
    with pytest.raises(UserError) as err:
        init_group("any", env={"MLX_RANK": "0", "MLX_WORLD_SIZE": "2"})
    assert str(err.value) == ("MLX_WORLD_SIZE=2 says this job has 2 ranks, but this process joined no group (no "
                              "launcher variables name the other ranks); start every rank with ./launch or mlx.launch, "
                              "or unset MLX_WORLD_SIZE to train alone")


@pytest.mark.parametrize("size", [2, 3, 8, 64])
@pytest.mark.parametrize("rank", [None, "0"])
@pytest.mark.parametrize("backend", ["any", "none"])
def test_every_announced_world_size_above_one_needs_a_group(size, rank, backend):
    env = {"MLX_WORLD_SIZE": str(size), **({"MLX_RANK": rank} if rank is not None else {})}
    why = "no launcher variables name the other ranks" if backend == "any" else "distributed.backend is none"
    with pytest.raises(UserError) as err:
        init_group(backend, env=env)
    assert str(err.value).startswith(f"MLX_WORLD_SIZE={size} says this job has {size} ranks, but this process "
                                     f"joined no group ({why})")
    assert init_group(backend, env={**env, "MLX_WORLD_SIZE": "1"}).size == 1  # one announced rank: a run of one


def test_a_world_size_that_contradicts_the_ring_hostfile_stops(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:40001"], ["127.0.0.1:40002"]]))
    with pytest.raises(UserError) as err:
        init_group("any", env={"MLX_RANK": "0", "MLX_HOSTFILE": str(hosts), "MLX_WORLD_SIZE": "3"})
    assert str(err.value) == ("MLX_WORLD_SIZE=3, but the launcher's other variables name 2 ranks (e.g. the ring's "
                              "MLX_HOSTFILE); start every rank with ./launch or mlx.launch")


@pytest.mark.parametrize("announced,formed", [(2, 1), (2, 3), (4, 3), (3, 8)])
def test_a_group_whose_size_differs_from_the_announced_one_stops(monkeypatch, announced, formed):
    """MLX forms the group (faked here: its size is what matters); the NCCL launcher announced MLX_WORLD_SIZE."""
    class Formed:
        def size(self):
            return formed

        def rank(self):
            return 0

    monkeypatch.setattr(mx.distributed, "init", lambda strict, backend: Formed())
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend="any": True)  # NCCL on a CPU build too
    env = {"MLX_RANK": "0", "NCCL_HOST_IP": "127.0.0.1", "MLX_WORLD_SIZE": str(announced)}
    with pytest.raises(UserError) as err:
        init_group("any", env=env)
    assert str(err.value) == (f"distributed backend 'nccl' formed a group of {formed} rank(s); the launcher announced "
                              f"{announced} (MLX_WORLD_SIZE={announced})")
    assert init_group("any", env={**env, "MLX_WORLD_SIZE": str(formed)}).size == formed  # agreeing sizes are accepted


def test_ranks_of_another_job_are_named_before_any_other_difference():
    """The handshake compares DTRAIN_JOB first: two jobs that took the same ports stop with that cause."""
    from dtrain.distributed import ForeignRankError
    from dtrain.contract import EXIT_LOST_PEER

    class TwoRanks(Group):  # the gathered texts of a 2-rank group whose rank 1 is another job's
        def all_gather_text(self, text, step, what="all_gather of text"):
            other = json.loads(text)
            other["job"], other["facts"]["config"] = "bbbb", "different"
            return [text, json.dumps(other)]

    with pytest.raises(ForeignRankError) as err:
        handshake(TwoRanks(rank=0, size=2, job="aaaa"), {"config": {"lora": 8}, "data": "x"})
    # ./launch checks the ports of this machine only: a --hostfile job starts at the default port unless given --port
    assert str(err.value) == ("rank(s) 1 belong to another job (job bbbb; rank 0's is aaaa): two jobs were given the "
                              "same ports; give each its own --port (./launch -n N without --port takes free ones on "
                              "its machine, but cannot check the ports of other machines: every --hostfile job starts "
                              "at the same default port)")
    assert err.value.exit_status == EXIT_LOST_PEER  # transient: ./launch --max-restarts retries it


def test_broadcast_at_world_size_one_returns_the_input():
    arrays = {"a": mx.array([1.5, -0.0]), "step": mx.array(3, dtype=mx.uint64)}
    got = Group().broadcast_arrays(arrays, None)
    assert got.keys() == arrays.keys() and all(got[k] is arrays[k] for k in arrays)
    assert Group().broadcast_text("rank 0's", None) == "rank 0's"


def test_an_empty_tree_needs_no_collective_at_any_world_size():
    """DPO's reference pass all-sums the held-out log-probs; with no held-out pairs that is a (0, 2) array
    on every rank: nothing to sum, so no bucket and no collective (it raised IndexError on 2 ranks)."""
    got = Group(rank=0, size=2).all_sum_tree({"valid": mx.zeros((0, 2))}, None)
    assert got["valid"].shape == (0, 2) and got["valid"].dtype == mx.float32


def test_running_out_of_memory_in_a_collective_is_not_a_lost_peer(monkeypatch):
    """The all-reduce allocates the flat gradient vector and its sums (MLX evaluates them inside the
    watchdog): a rank that ran out of memory there said 'all_sum of LoRA gradients ... failed: ... out
    of memory' as a lost peer (exit status 4, which ./launch --max-restarts retries), without the
    trainer's out-of-memory advice; MLX's error now reaches the trainer, as it does outside collectives."""
    from dtrain.memory import is_out_of_memory

    oom = ("[metal::malloc] Attempting to allocate 3355443200 bytes which is greater than the maximum allowed "
           "buffer size")

    def all_sum(x, **kw):
        raise RuntimeError(oom)

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    with pytest.raises(RuntimeError) as err:
        Group(rank=1, size=2).all_sum({"w": mx.ones(3)}, {"pairs": 1.0}, 5)
    assert not isinstance(err.value, UserError) and is_out_of_memory(err.value) and str(err.value) == oom
