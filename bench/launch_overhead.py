"""What the launcher costs: wall time and CPU of a multi-rank run through ./launch vs the ranks started directly.

    python bench/launch_overhead.py                                    # this checkout: launch, then direct
    python bench/launch_overhead.py --checkout /work/main --modes launch   # another checkout's ./launch (before)
    python bench/launch_overhead.py --modes mlx-launch-idle               # mlx.launch alone, ranks that sleep

``launch`` runs ``CHECKOUT/launch -n N CONFIG --train.steps S`` with that
checkout's ``.venv`` python. ``direct`` starts N ``dtrain train`` processes
itself with the variables mlx.launch would give them (``MLX_RANK``,
``MLX_HOSTFILE``) and this machine's BLAS choice (``LD_PRELOAD``, as ./launch
passes it). Every 0.5 s the process tree is read from /proc; the trainers
(``-m dtrain train``) and everything else (``./launch``, ``mlx.launch``, the
rank wrappers, shells) are summed apart: their CPU seconds over the run's wall
time is the share of a core each side used. Prints a line per run and whether
the adapters are bitwise equal; writes JSON to bench/results/. ``mlx-launch-idle``
runs ``mlx.launch -n N`` over ranks that only sleep ``--idle-s`` seconds: what
mlx.launch itself costs the machine it runs on (for hostfile runs, the head).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prelude import RESULTS, ROOT, add_flags, write_results

TICK = os.sysconf("SC_CLK_TCK")


def proc_table() -> dict:
    """``{pid: (ppid, cpu_seconds, cmdline)}`` of every readable process."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_bytes().rsplit(b")", 1)[1].split()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        out[int(p.name)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / TICK, cmd)
    return out


def watch(roots: list[int], procs: list[subprocess.Popen]) -> dict:
    """Sample the trees under ``roots`` until every process in ``procs`` ended; CPU seconds per side,
    and ``top``: the launcher side's processes, most CPU first."""
    seen: dict = {}  # pid -> (last cpu seconds, command line)
    while any(p.poll() is None for p in procs):
        table = proc_table()
        tree, frontier = set(), list(roots)
        while frontier:
            pid = frontier.pop()
            if pid in tree:
                continue
            tree.add(pid)
            frontier += [c for c, (ppid, _, _) in table.items() if ppid == pid]
        for pid in tree & set(table):
            if table[pid][2].strip():  # a process not yet exec'd or already ended reads empty
                seen[pid] = (table[pid][1], table[pid][2])
        time.sleep(0.5)
    sums, top = {"trainers": 0.0, "launcher": 0.0}, []
    for cpu, cmd in seen.values():
        trainer = " -m dtrain train " in cmd and "dtrain.launch.rank" not in cmd
        sums["trainers" if trainer else "launcher"] += cpu
        if not trainer:
            top.append((round(cpu, 1), cmd[:100]))
    return {**sums, "top": sorted(top, reverse=True)[:5]}


def adapter_digest(out: Path) -> str:
    path = out / "adapters" / "adapters.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "missing"


def run_launch(checkout: Path, args, out: Path) -> tuple[float, dict, int]:
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), str(checkout / "launch"), "-n", str(args.ranks), args.config, "--train.steps", str(args.steps),
           "--train.output_dir", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "wb"))
    cpu = watch([proc.pid], [proc])
    return time.monotonic() - start, cpu, proc.returncode


def run_direct(args, out: Path) -> tuple[float, dict, int]:
    from dtrain.blas import blas_env

    env, _ = blas_env()
    ports = []
    for _ in range(args.ranks):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    hostfile = Path(tempfile.mkdtemp()) / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    cmd = [sys.executable, "-m", "dtrain", "train", "-c", args.config, "--train.steps", str(args.steps),
           "--train.output_dir", str(out)]
    start = time.monotonic()
    log = open(out.with_suffix(".log"), "wb")
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                              env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), "PYTHONUNBUFFERED": "1"})
             for r in range(args.ranks)]
    cpu = watch([p.pid for p in procs], procs)
    return time.monotonic() - start, cpu, max(p.returncode for p in procs)


def run_mlx_launch_idle(args) -> tuple[float, dict, int]:
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "-n", str(args.ranks), "--", sys.executable, "-c",
           f"import time; time.sleep({args.idle_s})"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    cpu = watch([proc.pid], [proc])
    return time.monotonic() - start, cpu, proc.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", default=str(ROOT), help="the checkout whose ./launch runs (default: this one)")
    p.add_argument("--modes", default="launch,direct", help="comma-separated: launch, direct (default both)")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--ranks", type=int, default=2)
    add_flags(p, steps=4, out=str(RESULTS), help={"steps": "training steps per run"})
    p.add_argument("--idle-s", type=float, default=30.0, help="mlx-launch-idle: seconds the ranks sleep")
    p.add_argument("--label", default="", help="name for this checkout in the output (e.g. before, after)")
    args = p.parse_args(argv)
    load = os.getloadavg()
    print(f"launch overhead: {args.ranks} ranks, {args.steps} steps of {args.config}; {os.cpu_count()} CPU(s); "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    results = []
    base = Path(tempfile.mkdtemp(prefix="dtrain-overhead-"))
    for mode in args.modes.split(","):
        out = base / mode
        if mode == "launch":
            wall, cpu, code = run_launch(Path(args.checkout), args, out)
        elif mode == "mlx-launch-idle":
            wall, cpu, code = run_mlx_launch_idle(args)
        else:
            wall, cpu, code = run_direct(args, out)
        row = {"mode": mode, "label": args.label, "checkout": args.checkout, "wall_s": wall, "exit": code,
               "launcher_cpu_s": cpu["launcher"], "trainers_cpu_s": cpu["trainers"],
               "launcher_core_share": cpu["launcher"] / wall, "adapter": adapter_digest(out),
               "load_at_end": os.getloadavg()[0], "launcher_processes": cpu["top"]}
        results.append(row)
        print(f"{args.label or mode:>8} {mode:>6}: {wall:6.1f} s wall, exit {code}; launcher side {cpu['launcher']:.1f} "
              f"CPU s ({100 * row['launcher_core_share']:.1f}% of a core), trainers {cpu['trainers']:.1f} CPU s; "
              f"adapter {row['adapter']}; load {row['load_at_end']:.2f}", flush=True)
        for cpu_s, cmd in cpu["top"][:3]:
            print(f"           launcher side: {cpu_s:5.1f} CPU s  {cmd}", flush=True)
    write_results("launch_overhead", {"rows": results}, args.out)
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
