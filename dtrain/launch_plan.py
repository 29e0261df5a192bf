"""What ``./launch`` will run: the command, each rank's environment and shard.

A :class:`Plan` is built without starting anything, so ``--dry-run`` prints
exactly what a real launch executes. Ring, JACCL and NCCL ranks are started by
``mlx.launch`` (ssh for remote hosts); the per-rank variables shown for them
mirror what mlx.launch 0.32 sets (``mlx/_distributed_utils/launch.py``).
MPI runs ``mpirun`` directly: mlx.launch passes ``--output :raw``, which
OpenMPI 4.1 rejects.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

from .blas import CHILD_VARS, blas_env
from .launch_hosts import Hostfile, LaunchError, check_backend
from .sampler import rank_shard


@dataclass
class Plan:
    """A launch: ``command`` run in a new session with ``env`` (os.environ + ``explicit``).

    ``rank_env[r]``: the variables rank ``r`` receives beyond the inherited
    environment (what ``--dry-run`` prints). ``shards[r]``: pairs per step.
    ``files``: temporary files to write before starting (path -> content).
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
    """``python -m dtrain.launch_rank -- python -m dtrain train -c CONFIG ...`` (see launch_rank)."""
    args = [f"--{o}" for o in overrides]
    if backend:
        args.append(f"--distributed.backend={backend}")
    return [sys.executable, "-m", "dtrain.launch_rank", "--", sys.executable, "-m", "dtrain", "train", "-c", config, *args]


def mlx_launch_path() -> str:
    """The ``mlx.launch`` script next to this interpreter (or on PATH)."""
    local = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    found = local if os.path.exists(local) else shutil.which("mlx.launch")
    if found is None:
        raise LaunchError("mlx.launch not found next to this Python or on PATH; install mlx in this environment")
    return found


def _env_flags(flag: str, env: dict) -> list[str]:
    return [x for k, v in env.items() for x in (flag, f"{k}={v}")]


def ring_hostfile(ips_per_rank: list[list[str]], port: int) -> list[list[str]]:
    """The ring backend's ``MLX_HOSTFILE`` content: ``ip:port`` per rank, one port per IP, as mlx.launch numbers them."""
    out = []
    for ips in ips_per_rank:
        out.append([f"{ip}:{port + i}" for i, ip in enumerate(ips)])
        port += len(ips)
    return out


def build_plan(args, cfg, overrides: list[str], hostfile: Optional[Hostfile]) -> Plan:
    """Turn parsed launcher options into a :class:`Plan`.

    Args:
        args: ``ranks``, ``backend``, ``port``, ``config`` from the command line.
        cfg: the resolved :class:`dtrain.config.Config` (batch sizes, backend).
        overrides: ``section.key=value`` strings passed on to every rank.
        hostfile: a validated hostfile, or None for this machine only.
    Raises:
        LaunchError: a combination that cannot run (e.g. ``-n`` with a hostfile).
    """
    explicit, notes = base_env(hostfile.envs if hostfile else None)
    backend = args.backend or (hostfile.backend if hostfile else None)
    if backend is None and cfg.distributed.backend != "any":
        backend = cfg.distributed.backend
    if hostfile is not None:
        if args.ranks != 1:
            raise LaunchError("use either -n (ranks on this machine) or --hostfile (one rank per host), not both")
        hosts = [h.ssh for h in hostfile.hosts]
        backend = backend or "ring"
        check_backend(hostfile, backend, args.hostfile)
    elif args.ranks > 1:
        hosts = ["127.0.0.1"] * args.ranks
        backend = backend or "ring"
        if backend == "jaccl":
            raise LaunchError("the jaccl backend needs a hostfile with 'rdma' devices (--hostfile HOSTS.json)")
    else:
        hosts, backend = ["localhost"], None
    n = len(hosts)
    t = cfg.train
    common = dict(backend=backend or "none", world_size=n, hosts=hosts, explicit=explicit, notes=notes,
                  shards=shard_sizes(t.global_batch_pairs, n), global_batch_pairs=t.global_batch_pairs,
                  micro_batch_pairs=t.micro_batch_pairs)
    program = rank_program(args.config, overrides, backend)
    if backend is None:
        return Plan(command=program, rank_env=[dict(explicit)], **common)
    if backend == "mpi":
        return _mpi_plan(args, hostfile, program, common)
    return _mlx_launch_plan(args, hostfile, backend, program, common)


def _mlx_launch_plan(args, hostfile, backend, program, common) -> Plan:
    n, explicit = common["world_size"], dict(common["explicit"])
    if backend == "nccl":
        explicit["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: it hangs on some multi-GPU hosts
        common["explicit"] = explicit
    where = ["--hostfile", args.hostfile] if hostfile else ["-n", str(n)]
    port_flag = ["--nccl-port", str(args.port)] if backend == "nccl" else ["--starting-port", str(args.port)]
    hostfile_env = {k: v for k, v in (e.split("=", 1) for e in (hostfile.envs if hostfile else []))}
    passed = {k: v for k, v in explicit.items() if k not in hostfile_env}  # mlx.launch adds the hostfile's own
    command = [mlx_launch_path(), *where, "--backend", backend, *port_flag, *_env_flags("--env", passed), "--", *program]
    ips = [h.ips for h in hostfile.hosts] if hostfile else [["127.0.0.1"]] * n
    rank_env = []
    for r in range(n):
        env = dict(explicit)
        if backend == "ring":
            env["MLX_HOSTFILE"] = "<temp file> " + json.dumps(ring_hostfile(ips, args.port)) if n > 1 else ""
        elif backend == "jaccl":
            env["MLX_JACCL_COORDINATOR"] = f"{ips[0][0]}:{args.port}"
            env["MLX_IBV_DEVICES"] = "<temp file> " + json.dumps([h.rdma for h in hostfile.hosts])
        elif backend == "nccl":
            env.update(NCCL_HOST_IP=ips[0][0], NCCL_PORT=str(args.port), MLX_WORLD_SIZE=str(n),
                       CUDA_VISIBLE_DEVICES=str(r % n if hostfile is None else 0))
        env["MLX_RANK"] = str(r)
        rank_env.append(env)
    return Plan(command=command, rank_env=rank_env, **common)


def _mpi_plan(args, hostfile, program, common) -> Plan:
    n, explicit = common["world_size"], common["explicit"]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise LaunchError("--backend mpi needs mpirun on PATH (Debian: apt-get install openmpi-bin; macOS: brew install open-mpi)")
    flags = ["-np", str(n)]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")  # OpenMPI refuses root without it
    files = {}
    if hostfile is not None:
        path = os.path.join(args.tmpdir, "mpi_hosts")
        files[path] = "".join(f"{h} slots=1\n" for h in common["hosts"])
        flags += ["--hostfile", path]
    elif n > (os.cpu_count() or 1):
        flags.append("--oversubscribe")  # more ranks than cores on this machine
    command = [mpirun, *flags, *_env_flags("-x", explicit), "--", *program]
    rank_env = [{**explicit, "OMPI_COMM_WORLD_RANK": f"{r} (set by mpirun)"} for r in range(n)]
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
        lines += [f"  {k}={v}" for k, v in sorted(plan.rank_env[r].items())]
    split = " + ".join(map(str, plan.shards))
    lines.append(f"global batch: {plan.global_batch_pairs} pairs/step = {split} (micro batch {plan.micro_batch_pairs} pairs per rank)")
    return "\n".join(lines)
