"""``./launch``: run a training job on one rank, N local ranks, several hosts or MPI.

    ./launch CONFIG [--section.key VALUE ...]          one rank, no distributed setup
    ./launch -n N CONFIG                                N ranks on loopback (mlx.launch, ring)
    ./launch --dry-run CONFIG                           print the plan, start nothing

Every rank gets its environment explicitly: OpenBLAS preloaded on Linux
(``dtrain.blas``), unbuffered output, and the backend's own variables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

from .blas import blas_env


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="launch", description="Run a dtrain job on one or more ranks.")
    p.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("-n", "--ranks", type=int, default=1, help="ranks on this machine (ring backend on loopback)")
    p.add_argument("--backend", default=None, help="ring | jaccl | mpi | nccl (default ring when -n > 1)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return p.parse_known_args(argv)


def rank_env() -> tuple[dict, list[str]]:
    """The environment every rank runs with, and the log lines about it."""
    env, message = blas_env()
    env["PYTHONUNBUFFERED"] = "1"
    return env, [message] if message else []


def train_command(config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "dtrain", "train", "-c", config, *overrides]


def plan(args, overrides) -> tuple[list[str], dict, list[str]]:
    """``(command, environment, log lines)`` for the requested run."""
    env, notes = rank_env()
    cmd = train_command(args.config, overrides)
    if args.ranks > 1:
        backend = args.backend or "ring"
        launcher = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
        rank_cmd = train_command(args.config, [*overrides, "--distributed.backend", backend])
        cmd = [launcher, "-n", str(args.ranks), "--backend", backend, "--", *rank_cmd]
    return cmd, env, notes


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cmd, env, notes = plan(args, overrides)
    for line in notes:
        print(f"launch: {line}", file=sys.stderr, flush=True)
    if args.dry_run:
        print("command: " + " ".join(cmd))
        print(f"ranks: {args.ranks}")
        return 0
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return proc.wait()
