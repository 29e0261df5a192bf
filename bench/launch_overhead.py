"""What the launcher costs: wall time and CPU of a multi-rank run through ./launch vs the ranks started directly.

    python bench/launch_overhead.py                                 # this checkout: launch, then direct
    python bench/launch_overhead.py --before /work/wt-before --repeats 3   # before, launch, direct; 3 rounds
    python bench/launch_overhead.py --checkout /work/main --modes launch   # another checkout's ./launch
    python bench/launch_overhead.py --modes mlx-launch-idle            # mlx.launch alone, ranks that sleep

``launch`` runs ``CHECKOUT/launch -n N CONFIG --train.steps S`` with that
checkout's ``.venv`` python; ``--before CHECKOUT`` adds such a run of another
checkout (e.g. one of main at 8d14721, before issue 29, with its own ``.venv``)
ahead of each round. ``direct`` starts this checkout's N trainers itself, as
``./launch`` would start them but without the launcher and the rank wrappers
(:func:`run_direct`). Every 0.5 s the process tree is read from /proc (macOS: ps); the trainers
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
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from prelude import RESULTS, ROOT, add_flags, write_results

from dtrain.launch.rank import ps_seconds

TICK = os.sysconf("SC_CLK_TCK")


def proc_table(proc: Path = Path("/proc")) -> dict:
    """``{pid: (ppid, cpu_seconds, cmdline)}`` of every readable process: from ``proc`` (Linux), else from
    ``ps`` (macOS, which has no /proc; its CPU time in hundredths of a second, ``LC_ALL=C`` for the decimal point)."""
    if not proc.is_dir():
        rows = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,time=,command="], capture_output=True, text=True,
                              check=True, env={**os.environ, "LC_ALL": "C"}).stdout.splitlines()
        return {int(r[0]): (int(r[1]), ps_seconds(r[2]), r[3] if len(r) > 3 else "")
                for r in (line.split(None, 3) for line in rows) if len(r) >= 3}
    out = {}
    for p in proc.iterdir():
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
    """The trainers of ``./launch -n N`` started by this script: the plan's command after the rank wrapper
    (``--distributed.backend=ring`` included), each rank's variables, stdin from /dev/null and a session of
    its own, as ``dtrain.launch.supervise`` starts them. Without ``start_new_session`` both trainers
    would share this script's session, and with Linux's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``) one session's share of the CPU."""
    from dtrain.config import load_config
    from dtrain.contract import JOB_VAR
    from dtrain.launch.plan import build_plan, release

    overrides = [f"train.steps={args.steps}", f"train.output_dir={out}"]
    locks: list = []
    with tempfile.TemporaryDirectory(prefix="dtrain-direct-") as tmp:
        plan = build_plan(args.config, overrides, load_config(args.config, overrides), ranks=args.ranks,
                          tmpdir=tmp, port_locks=locks)
        for path, content in plan.files.items():
            Path(path).write_text(content)
        trainer = plan.command[plan.command.index("--") + 1:]  # python -m dtrain train ..., without the wrapper
        env = {**os.environ, **plan.explicit, JOB_VAR: uuid.uuid4().hex[:12]}
        start = time.monotonic()
        with open(out.with_suffix(".log"), "wb") as log:
            procs = [subprocess.Popen(trainer, cwd=ROOT, env={**env, **rank_env}, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
                     for rank_env in plan.direct]
        cpu = watch([p.pid for p in procs], procs)
    release(locks)
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
    p.add_argument("--before", default="", help="also run this checkout's ./launch first in each round, labelled before")
    p.add_argument("--modes", default="launch,direct", help="comma-separated: launch, direct (default both)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of --before and --modes, one after another (default 1)")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--ranks", type=int, default=2)
    add_flags(p, steps=4, out=str(RESULTS), help={"steps": "training steps per run"})
    p.add_argument("--idle-s", type=float, default=30.0, help="mlx-launch-idle: seconds the ranks sleep")
    p.add_argument("--label", default="", help="name for this checkout in the output (default with --before: after)")
    args = p.parse_args(argv)
    load = os.getloadavg()
    print(f"launch overhead: {args.ranks} ranks, {args.steps} steps of {args.config}; {os.cpu_count()} CPU(s); "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    unknown = set(args.modes.split(",")) - {"launch", "direct", "mlx-launch-idle"}
    if unknown:
        p.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from launch, direct, mlx-launch-idle")
    this = args.label or ("after" if args.before else "")
    plan = [(this, mode, args.checkout) for mode in args.modes.split(",")]
    if args.before:
        plan.insert(0, ("before", "launch", args.before))
    results = []
    base = Path(tempfile.mkdtemp(prefix="dtrain-overhead-"))
    for i, (label, mode, checkout) in enumerate(plan * args.repeats):
        out = base / f"{i}-{label or 'this'}-{mode}"
        if mode == "launch":
            wall, cpu, code = run_launch(Path(checkout), args, out)
        elif mode == "mlx-launch-idle":
            wall, cpu, code = run_mlx_launch_idle(args)
        else:
            wall, cpu, code = run_direct(args, out)
        row = {"mode": mode, "label": label, "checkout": checkout, "wall_s": wall, "exit": code,
               "launcher_cpu_s": cpu["launcher"], "trainers_cpu_s": cpu["trainers"],
               "launcher_core_share": cpu["launcher"] / wall, "adapter": adapter_digest(out),
               "load_at_end": os.getloadavg()[0], "launcher_processes": cpu["top"]}
        results.append(row)
        print(f"{label or mode:>8} {mode:>6}: {wall:6.1f} s wall, exit {code}; launcher side {cpu['launcher']:.1f} "
              f"CPU s ({100 * row['launcher_core_share']:.1f}% of a core), trainers {cpu['trainers']:.1f} CPU s; "
              f"adapter {row['adapter']}; load {row['load_at_end']:.2f}", flush=True)
        for cpu_s, cmd in cpu["top"][:3]:
            print(f"           launcher side: {cpu_s:5.1f} CPU s  {cmd}", flush=True)
    if args.repeats > 1:
        print("median of the rounds:")
        for label, mode, _ in plan:
            rows = [r for r in results if (r["label"], r["mode"]) == (label, mode)]
            print(f"{label or mode:>8} {mode:>6}: {statistics.median(r['wall_s'] for r in rows):6.1f} s wall, "
                  f"launcher side {statistics.median(r['launcher_cpu_s'] for r in rows):.1f} CPU s, "
                  f"trainers {statistics.median(r['trainers_cpu_s'] for r in rows):.1f} CPU s", flush=True)
    write_results("launch_overhead", {"rows": results}, args.out)
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
