"""The contract between a launcher and its ranks: backends, environment variables, exit statuses.

A launcher tells each rank who it is through environment variables, and each
backend has its own set: mlx.launch 0.32 (``mlx/_distributed_utils/launch.py``)
for ring, JACCL and NCCL, OpenMPI's ``mpirun`` for MPI (MPICH/Hydra: ``PMI_*``).
This module is their one owner, below both sides: ``dtrain.launch.plan`` writes
them (and prints them for ``--dry-run``), ``dtrain.distributed`` reads them
through :func:`launcher_backend` and :func:`rank_from_env`, ``dtrain.config``
takes the backend names. In the other direction a
rank tells the launcher why it ended through its exit status (``EXIT_*``),
which decides whether ``--max-restarts`` may start the job again.

Pure Python (no MLX): the launcher and the rank wrapper import it cheaply.
"""

from __future__ import annotations

import json
import signal
from typing import Mapping, Optional

from .errors import UserError

BACKENDS = ("ring", "jaccl", "mpi", "nccl")  # mx.distributed backends a launcher can start

# After an abort (SIGUSR1) a rank's wrapper kills its trainer this many seconds later; the
# launcher kills the whole group ABORT_GRACE_S + GROUP_KILL_MARGIN_S after it sent the abort.
ABORT_GRACE_S = 3.0
GROUP_KILL_MARGIN_S = 7.0

# Exit statuses of `dtrain train`. A user error repeats on a restart; the other two are
# transient (a peer died or stalled) and a restart from the newest checkpoint can succeed.
# A run stopped by SIGINT/SIGTERM/SIGHUP that saved its checkpoint exits 0: the launcher
# reads rank 0's 0 as "saved" (supervise, main._say_what_was_lost) and restarts nothing;
# a second signal kills it (killed by SIGINT/SIGTERM, no save). A rank whose trainer got the signal
# itself says so in a "signal" report line (cli._train), so the launcher tells it from a finished run.
EXIT_USER_ERROR = 2  # bad config, data, model, output folder (dtrain.errors.UserError)
EXIT_TIMEOUT = 3  # the collective watchdog fired: a peer stalled (distributed.Watchdog)
EXIT_LOST_PEER = 4  # a collective failed: MLX reported a lost peer (distributed.CollectiveError)
# a user error rank 0 met and showed; the other ranks end with this, pointing to its message
# (distributed.AfterRank0Error): the launcher blames rank 0 and, like a user error, restarts nothing
EXIT_AFTER_RANK0 = 5
ERROR_PREFIX = "dtrain: error: "  # a rank's user error line; the launcher shows a line every rank printed once

# a rank's stop request (dtrain.run.stop); a rank wrapper starts its trainer with them blocked, and dtrain's
# main() unblocks them where a KeyboardInterrupt is one line: a stop during the trainer's start-up is no traceback
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # first one set wins
# mlx.launch writes these variables' values to temporary files and passes the file's path
FILE_VARS = ("MLX_HOSTFILE", "MLX_IBV_DEVICES")
STOP_TIMEOUT_VAR = "DTRAIN_STOP_TIMEOUT"  # launcher -> rank wrapper: --stop-timeout in seconds
LAUNCHER_VAR = "DTRAIN_LAUNCHER"  # launcher -> rank wrapper: "HOST:PID" of ./launch; gone there: stop
LAUNCH_TMP_VAR = "DTRAIN_LAUNCH_TMP"  # launcher -> its local rank wrappers: its temporary folder (hostfiles)
# launcher -> the rank wrappers mlx.launch starts on this machine: the TMPDIR to give their trainers ("": none);
# mlx.launch runs with TMPDIR in the launcher's temporary folder, where its start scripts' mktemp files go
RANK_TMPDIR_VAR = "DTRAIN_RANK_TMPDIR"
JOB_VAR = "DTRAIN_JOB"  # launcher -> ranks: the attempt's identity, compared in the start-up handshake
SIZE_VARS = ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # a world size a launcher announced
# launcher -> rank 0 of a restart from step 0 (no checkpoint yet): the TensorBoard run the failed attempt began,
# relative to the output folder, which the new attempt continues (its START at step 0 drops the earlier steps)
TB_RUN_VAR = "DTRAIN_TB_RUN"
LOCAL_RANKS_VAR = "DTRAIN_LOCAL_RANKS"  # launcher -> its ranks on this machine (-n N): how many share its memory
LOCAL_SIZE_VARS = (LOCAL_RANKS_VAR, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")  # first one set wins


def rank_from_env(env: Mapping[str, str]) -> int:
    """This process's rank as its launcher set it (mlx.launch, OpenMPI, MPICH), 0 if none.

    Raises:
        UserError: the first rank variable set is not a whole number.
    """
    for key in RANK_VARS:
        rank = _whole_number(env, key, "a whole-number rank")
        if rank is not None:
            return rank
    return 0


def launcher_backend(env: Mapping[str, str]) -> tuple[Optional[str], int]:
    """The backend and world size a launcher announced in ``env``, or ``(None, 1)``.

    mlx.launch's ring sets ``MLX_RANK`` and ``MLX_HOSTFILE`` (a JSON list of one
    address list per rank; empty for one rank); its JACCL sets
    ``MLX_JACCL_COORDINATOR`` or ``MLX_IBV_DEVICES``; its NCCL sets
    ``NCCL_HOST_IP`` and ``MLX_WORLD_SIZE``; OpenMPI's ``mpirun`` sets
    ``OMPI_COMM_WORLD_SIZE`` (MPICH/Hydra: ``PMI_SIZE``). A size of 0 means
    "set by a launcher, size not known here".

    Raises:
        UserError: a size variable that is not a whole number.
    """
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi", size_from_env(env, "OMPI_COMM_WORLD_SIZE") or size_from_env(env, "PMI_SIZE")
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return "jaccl", 0
    if "NCCL_HOST_IP" in env and "MLX_RANK" in env:
        return "nccl", size_from_env(env, "MLX_WORLD_SIZE")
    if "MLX_RANK" in env and env.get("MLX_HOSTFILE"):
        try:
            with open(env["MLX_HOSTFILE"], encoding="utf-8") as f:
                return "ring", len(json.loads(f.read() or "[]")) or 1
        except (OSError, ValueError):
            return "ring", 0
    return None, 1


def size_from_env(env: Mapping[str, str], var: str) -> int:
    """The world size in ``env[var]``; 0 when unset or empty.

    Raises:
        UserError: the value is not a whole number.
    """
    return _whole_number(env, var, "a whole number of ranks") or 0


def local_ranks_from_env(env: Mapping[str, str]) -> int:
    """How many ranks of this job run on this machine, sharing its memory, as the launcher set it (``./launch
    -n N``, OpenMPI, MPICH); 1 if none.

    Raises:
        UserError: the first variable set is not a whole number.
    """
    for key in LOCAL_SIZE_VARS:
        count = _whole_number(env, key, "a whole number of ranks")
        if count is not None:
            return max(1, count)
    return 1


def _whole_number(env: Mapping[str, str], var: str, what: str) -> Optional[int]:
    """``env[var]`` as a whole number, None when unset or empty; a UserError naming ``var`` and ``what`` else."""
    text = env.get(var, "")
    if text and not text.isdecimal():  # isdecimal, not isdigit: int() refuses '²'
        raise UserError(f"{var}={text!r} in the environment is not {what}; start every rank with ./launch (or "
                        f"mpirun, mlx.launch), or unset {var} to train alone")
    return int(text) if text else None


def ring_hostfile(ips_per_rank: list[list[str]], port: int) -> list[list[str]]:
    """The ring backend's ``MLX_HOSTFILE`` content: ``ip:port`` per rank, one port per IP, as mlx.launch numbers them."""
    out = []
    for ips in ips_per_rank:
        out.append([f"{ip}:{port + i}" for i, ip in enumerate(ips)])
        port += len(ips)
    return out


def rank_variables(backend: str, rank: int, ips: list[list[str]], port: int, rdma: Optional[list] = None,
                   one_gpu_per_host: bool = False) -> dict:
    """The variables ``backend``'s launcher gives rank ``rank`` (values of :data:`FILE_VARS` are file contents).

    Args:
        backend: ``ring | jaccl | nccl | mpi``.
        ips: per rank, the IP addresses it talks over (one list per rank).
        port: the first ring/JACCL port, or the NCCL port.
        rdma: JACCL only: per host, one RDMA device per peer (null for itself).
        one_gpu_per_host: NCCL: every rank sees GPU 0 of its own host (hostfile
            runs) instead of GPU ``rank`` of this machine.
    Raises:
        ValueError: an unknown backend.
    """
    n = len(ips)
    if backend == "ring":
        return {"MLX_RANK": str(rank), "MLX_HOSTFILE": json.dumps(ring_hostfile(ips, port)) if n > 1 else ""}
    if backend == "jaccl":
        return {"MLX_RANK": str(rank), "MLX_JACCL_COORDINATOR": f"{ips[0][0]}:{port}", "MLX_IBV_DEVICES": json.dumps(rdma)}
    if backend == "nccl":
        return {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(n), "NCCL_HOST_IP": ips[0][0], "NCCL_PORT": str(port),
                "CUDA_VISIBLE_DEVICES": "0" if one_gpu_per_host else str(rank)}
    if backend == "mpi":  # mpirun sets them itself; shown for --dry-run
        return {"OMPI_COMM_WORLD_RANK": f"{rank} (set by mpirun)", "OMPI_COMM_WORLD_SIZE": f"{n} (set by mpirun)"}
    raise ValueError(f"unknown backend {backend!r}")
