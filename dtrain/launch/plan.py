"""What ``./launch`` will run: the command, each rank's environment and shard.

A :class:`Plan` is built without starting anything, from explicit arguments,
so ``--dry-run`` prints exactly what a real launch executes. Ring, JACCL and
NCCL ranks are started by ``mlx.launch`` (ssh for remote hosts); the per-rank
variables shown for them come from :mod:`dtrain.contract`. MPI runs
``mpirun`` directly: mlx.launch passes ``--output :raw``, which OpenMPI 4.1 rejects.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

from ..blas import CHILD_VARS, blas_env
from ..sampler import rank_shard
from ..contract import FILE_VARS, rank_variables
from .hosts import Hostfile, LaunchError, check_backend


@dataclass
class Plan:
    """A launch: ``command`` run in a new session with ``env`` (os.environ + ``explicit``).

    ``rank_env[r]``: the variables rank ``r`` receives beyond the inherited
    environment (what ``--dry-run`` prints). ``shards[r]``: pairs per step.
    ``files``: temporary files to write before starting (path -> content).
    ``local``: every rank runs on this machine (its files are the launcher's files).
    """

    backend: str
    world_size: int
    hosts: list
    command: list
    explicit: dict
    rank_env: list
    shards: list
    global_batch_pairs: int
    micro_batch_pairs: int
    local: bool = True
    files: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def shard_sizes(global_batch_pairs: int, world_size: int) -> list[int]:
    """Pairs per step on each rank: ``global_batch_pairs`` dealt round-robin (sampler.rank_shard)."""
    batch = list(range(global_batch_pairs))
    return [len(rank_shard(batch, r, world_size)) for r in range(world_size)]


def base_env(extra: Optional[list] = None) -> tuple[dict, list[str]]:
    """Variables every rank gets explicitly, and log lines: the chosen BLAS
    (Linux, ``dtrain.blas.blas_env``), unbuffered output, hostfile ``envs``."""
    env, message = blas_env()
    explicit = {k: env[k] for k in CHILD_VARS if k in env}
    explicit["PYTHONUNBUFFERED"] = "1"
    for item in extra or []:
        key, value = item.split("=", 1)
        explicit[key] = value
    return explicit, [message] if message else []


def rank_program(config: str, overrides: list[str], backend: Optional[str]) -> list[str]:
    """``python -m dtrain.launch.rank -- python -m dtrain train -c CONFIG ...`` (see dtrain.launch.rank)."""
    args = [f"--{o}" for o in overrides]
    if backend:
        args.append(f"--distributed.backend={backend}")
    return [sys.executable, "-m", "dtrain.launch.rank", "--", sys.executable, "-m", "dtrain", "train", "-c", config, *args]


def mlx_launch_path() -> str:
    """The ``mlx.launch`` script next to this interpreter (or on PATH)."""
    local = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    found = local if os.path.exists(local) else shutil.which("mlx.launch")
    if found is None:
        raise LaunchError("mlx.launch not found next to this Python or on PATH; install mlx in this environment")
    return found


def _env_flags(flag: str, env: dict) -> list[str]:
    return [x for k, v in env.items() for x in (flag, f"{k}={v}")]


def build_plan(config: str, overrides: list[str], cfg, *, ranks: int = 1, backend: Optional[str] = None,
               port: int = 32323, hostfile: Optional[Hostfile] = None, hostfile_path: Optional[str] = None,
               tmpdir: Optional[str] = None) -> Plan:
    """The plan for ``config`` + ``overrides`` on ``ranks`` local ranks or one rank per ``hostfile`` host.

    Args:
        config: the YAML path every rank reads.
        overrides: ``section.key=value`` strings passed on to every rank.
        cfg: the resolved :class:`dtrain.config.Config` (batch sizes, backend).
        ranks: ranks on this machine (1 without a hostfile: no distributed setup).
        backend: ``--backend``; None takes the hostfile's, then the config's, then ring.
        port: the first ring/JACCL port, or the NCCL port.
        hostfile: a validated hostfile (``hostfile_path`` names it), or None.
        tmpdir: where MPI's host list is written (hostfile runs under MPI).
    Raises:
        LaunchError: a combination that cannot run (e.g. ``-n`` with a hostfile).
    """
    explicit, notes = base_env(hostfile.envs if hostfile else None)
    backend = backend or (hostfile.backend if hostfile else None)
    if backend is None and cfg.distributed.backend != "any":
        backend = cfg.distributed.backend
    if hostfile is not None:
        if ranks != 1:
            raise LaunchError("use either -n (ranks on this machine) or --hostfile (one rank per host), not both")
        hosts = [h.ssh for h in hostfile.hosts]
        backend = backend or "ring"
        check_backend(hostfile, backend, hostfile_path or "hostfile")
    elif ranks > 1:
        hosts = ["127.0.0.1"] * ranks
        backend = backend or "ring"
        if backend == "jaccl":
            raise LaunchError("the jaccl backend needs a hostfile with 'rdma' devices (--hostfile HOSTS.json)")
    else:
        hosts, backend = ["localhost"], None
    n = len(hosts)
    t = cfg.train
    common = dict(backend=backend or "none", world_size=n, hosts=hosts, explicit=explicit, notes=notes,
                  shards=shard_sizes(t.global_batch_pairs, n), global_batch_pairs=t.global_batch_pairs,
                  micro_batch_pairs=t.micro_batch_pairs, local=hostfile is None)
    program = rank_program(config, overrides, backend)
    if backend is None:
        return Plan(command=program, rank_env=[dict(explicit)], **common)
    if backend == "mpi":
        return _mpi_plan(hostfile, program, tmpdir, common)
    return _mlx_launch_plan(hostfile, hostfile_path, backend, port, program, common)


def _mlx_launch_plan(hostfile, hostfile_path, backend, port, program, common) -> Plan:
    n, explicit = common["world_size"], dict(common["explicit"])
    if backend == "nccl":
        explicit["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: it hangs on some multi-GPU hosts
        common["explicit"] = explicit
    where = ["--hostfile", hostfile_path] if hostfile else ["-n", str(n)]
    port_flag = ["--nccl-port", str(port)] if backend == "nccl" else ["--starting-port", str(port)]
    hostfile_env = {k: v for k, v in (e.split("=", 1) for e in (hostfile.envs if hostfile else []))}
    passed = {k: v for k, v in explicit.items() if k not in hostfile_env}  # mlx.launch adds the hostfile's own
    command = [mlx_launch_path(), *where, "--backend", backend, *port_flag, *_env_flags("--env", passed), "--", *program]
    ips = [h.ips for h in hostfile.hosts] if hostfile else [["127.0.0.1"]] * n
    rdma = [h.rdma for h in hostfile.hosts] if hostfile else None
    rank_env = [{**explicit, **rank_variables(backend, r, ips, port, rdma, one_gpu_per_host=hostfile is not None)}
                for r in range(n)]
    return Plan(command=command, rank_env=rank_env, **common)


def _mpi_plan(hostfile, program, tmpdir, common) -> Plan:
    n, explicit = common["world_size"], common["explicit"]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise LaunchError("--backend mpi needs mpirun on PATH (Debian: apt-get install openmpi-bin; macOS: brew install open-mpi)")
    flags = ["-np", str(n)]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")  # OpenMPI refuses root without it
    files = {}
    if hostfile is not None:
        path = os.path.join(tmpdir or ".", "mpi_hosts")
        files[path] = "".join(f"{h} slots=1\n" for h in common["hosts"])
        flags += ["--hostfile", path]
    elif n > (os.cpu_count() or 1):
        flags.append("--oversubscribe")  # more ranks than cores on this machine
    command = [mpirun, *flags, *_env_flags("-x", explicit), "--", *program]
    ips = [[h] for h in common["hosts"]]
    rank_env = [{**explicit, **rank_variables("mpi", r, ips, 0)} for r in range(n)]
    return Plan(command=command, rank_env=rank_env, files=files, **common)


def describe(plan: Plan) -> str:
    """The human-readable plan printed by ``--dry-run``."""
    hosts = sorted(set(plan.hosts))
    lines = [
        f"ranks: {plan.world_size}",
        f"backend: {plan.backend}",
        f"hosts: {', '.join(hosts)}",
        f"command: {' '.join(plan.command)}",
    ]
    for path, content in plan.files.items():
        lines.append(f"file {path}: {content.strip()!r}")
    for r in range(plan.world_size):
        lines.append(f"rank {r} on {plan.hosts[r]}: shard {plan.shards[r]} pairs/step")
        for k, v in sorted(plan.rank_env[r].items()):
            shown = f"<temp file> {v}" if k in FILE_VARS and v else v
            lines.append(f"  {k}={shown}")
    split = " + ".join(map(str, plan.shards))
    lines.append(f"global batch: {plan.global_batch_pairs} pairs/step = {split} (micro batch {plan.micro_batch_pairs} pairs per rank)")
    return "\n".join(lines)
