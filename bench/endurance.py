"""Endurance: a training job under ``./launch --max-restarts`` while ranks are killed, or a link goes down.

    python bench/endurance.py --minutes 30                      # 3 ranks, ring, SIGKILL a rank every 1-4 min
    python bench/endurance.py --fault link --minutes 10         # ranks in network namespaces, a link down 20 s

A tiny random llama (2 layers, hidden 32, the demo model's tokenizer, float32)
trains on generated pairs with a checkpoint after every step, for enough steps
to last ``--minutes`` (timed on a short run first). While it runs, every
``--every`` seconds (uniform in the range, seeded) one random rank is hurt:

- ``kill``: its ``dtrain train`` process gets SIGKILL (3 ranks on loopback);
- ``link``: its network namespace's link goes down for ``--link-down`` seconds
  (``ip link set eth0 down/up``); ranks run one per namespace (bench/netns.py)
  through ``./launch --hostfile`` with an ``ssh`` shim that enters the namespace.

The same config also runs uninterrupted (``--reference after``, the default, or
``alongside``: at the same time, so a time-boxed session surely gets it), and
the script checks: the adapters are equal bitwise; TensorBoard holds every step
exactly once (one run folder) and one ``launch/restarts`` entry per restart
(``-n`` runs only); every folder under ``checkpoints/`` is a complete, valid
checkpoint (nothing partial or temporary). Results go to
``bench/results/endurance-<fault>.json`` and the launcher's log (timestamped)
next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from common import write_results  # sets up BLAS before MLX
from prelude import RESULTS, ROOT, add_flags

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from dtrain.run.checkpoint import validate  # noqa: E402
from dtrain.launch.supervise import find_trainers  # noqa: E402
from dtrain.launch.restart import TAG as RESTART_TAG  # noqa: E402
from dtrain.run.tracking import read_events, read_scalars  # noqa: E402

LAUNCH = ROOT / "launch"
TINY = dict(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
SSH_SHIM = """#!/bin/sh
# ssh for bench/endurance.py: 'ssh [-tt] [-o X] HOST CMD' runs CMD in network namespace HOST.
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done
host="$1"; shift
exec ip netns exec "$host" /bin/bash -c "stty() { :; }; $*"  # no terminal here: mlx.launch's 'stty -echo' is a no-op
"""


def make_job(work: Path, steps: int, ranks: int) -> Path:
    """The tiny model folder and its config; returns the config path."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    from dtrain.models import load_model

    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        tokenizer = load_model("demo", "float32").tokenizer
        args = {**TINY, "vocab_size": len(tokenizer._tokenizer)}
        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs(**args))
        model.set_dtype(mx.float32)
        model_dir.mkdir(parents=True, exist_ok=True)
        save_model(model_dir, model)
        save_config(dict(args), config_path=model_dir / "config.json")
        tokenizer._tokenizer.save_pretrained(str(model_dir))
    config = work / "job.yaml"
    config.write_text(
        f"model: {{path: {model_dir}, dtype: float32}}\n"
        "lora: {rank: 4}\n"
        "data: {demo_pairs: 64, max_length: 64, max_prompt_length: 32}\n"
        f"train: {{steps: {steps}, global_batch_pairs: {2 * ranks}, micro_batch_pairs: 2, learning_rate: 1.0e-3,"
        " save_every: 1, keep_last: 2, progress: false}\n"
        "distributed: {collective_timeout_s: 10, check_sync_every: 100}\n"
    )
    return config


def run_launch(args: list, log: Path, env: dict | None = None) -> subprocess.Popen:
    """``./launch ARGS`` in the background; its output goes to ``log`` with a timestamp per line."""
    proc = subprocess.Popen([sys.executable, str(LAUNCH), *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def copy():
        with open(log, "a") as f:
            for raw in iter(proc.stdout.readline, b""):
                f.write(f"{time.time():.3f} {raw.decode(errors='replace').rstrip()}\n")
                f.flush()

    threading.Thread(target=copy, daemon=True).start()
    return proc


def time_steps(config: Path, work: Path, ranks: int, port: int, steps: int = 30) -> float:
    """Seconds per step (checkpoint included) of an uninterrupted run of ``steps`` steps."""
    out = work / "timing"
    subprocess.run(["rm", "-rf", str(out)])
    r = subprocess.run([sys.executable, str(LAUNCH), "-n", str(ranks), "--port", str(port), str(config),
                        "--train.steps", str(steps), "--train.output_dir", str(out)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"timing run failed: {r.stderr[-2000:]}")
    loss = read_scalars(next((out / "tb").iterdir()))["perf/step_seconds"]
    files = sorted((out / "checkpoints").iterdir())
    save = (files[-1].stat().st_mtime - files[0].stat().st_mtime) / max(len(files) - 1, 1) if len(files) > 1 else 0
    return max(float(np.median([v for _, v in loss])), save)


def hurt_loop(proc, fault: str, out: Path, ranks: int, every: tuple, link_down: float, rng: random.Random,
              names: list, events: list) -> None:
    """Until ``proc`` ends: wait a random time, then kill a random rank (or take its link down)."""
    while proc.poll() is None:
        deadline = time.time() + rng.uniform(*every)
        while proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        if proc.poll() is not None:
            return
        rank = rng.randrange(ranks)
        if fault == "kill":
            pid = find_trainers(str(out)).get(rank)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            events.append({"t": time.time(), "rank": rank, "pid": pid, "hit": pid is not None})
        else:
            subprocess.run(["ip", "-n", names[rank], "link", "set", "eth0", "down"], check=True)
            events.append({"t": time.time(), "rank": rank, "hit": True, "down_s": link_down})
            time.sleep(link_down)
            subprocess.run(["ip", "-n", names[rank], "link", "set", "eth0", "up"], check=True)


def check_run(out: Path, steps: int) -> dict:
    """TensorBoard steps and restart entries (``launch/restarts`` text) and the checkpoint folders of a finished run."""
    runs = sorted(p for p in (out / "tb").iterdir() if p.is_dir())
    logged = [s for s, _ in read_scalars(runs[-1])["loss"]] if runs else []
    folders = sorted((out / "checkpoints").iterdir())
    bad = [f"{p.name}: {validate(p) or 'ok'}" for p in folders if not p.name.startswith("step-") or validate(p)]
    events = read_events(runs[-1]) if runs else []
    restarts = [e.step for e in events for v in e.summary.value if v.tag.startswith(RESTART_TAG)]
    return {"tensorboard_runs": len(runs), "steps_logged": len(logged), "distinct_steps": len(set(logged)),
            "restart_entries_at_steps": restarts,
            "every_step_once": logged == list(range(1, steps + 1)), "checkpoint_folders": [p.name for p in folders],
            "partial_or_invalid": bad}


def resumes(lines: list) -> list:
    """``(time, step)`` of each "resumed from ... at step N" line a rank printed (not the launcher's copies
    of a failed rank's last lines, which start with ``[rank R]``)."""
    out = []
    for line in lines:
        stamp, _, text = line.partition(" ")
        m = re.search(r"resumed from \S+ at step (\d+)", text)
        if m and not text.lstrip().startswith("[rank"):
            out.append((float(stamp), int(m.group(1))))
    return out


def downtimes(faults: list, resumed: list) -> list:
    """Seconds from each fault to the next resumed start (training again), None when none followed."""
    return [next((round(t - f["t"], 1) for t, _ in resumed if t > f["t"]), None) for f in faults]


def run_reference(args: list, log: Path, box: dict) -> None:
    """The uninterrupted run: ``./launch ARGS``; puts its exit status and minutes in ``box``."""
    t0 = time.time()
    box["code"] = run_launch(args, log).wait()
    box["minutes"] = (time.time() - t0) / 60


def adapter_diff(a: Path, b: Path) -> dict:
    wa = {k: np.array(v) for k, v in mx.load(str(a)).items()}
    wb = {k: np.array(v) for k, v in mx.load(str(b)).items()}
    diff = max(float(np.abs(wa[k] - wb[k]).max()) for k in wa)
    return {"tensors": len(wa), "bitwise_equal": sorted(wa) == sorted(wb) and all(np.array_equal(wa[k], wb[k]) for k in wa),
            "max_abs_diff": diff}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=("kill", "link"), default="kill")
    p.add_argument("--minutes", type=float, default=30.0, help="target length of the hurt run")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--every", default="60,240", help="seconds between faults: uniform in MIN,MAX")
    p.add_argument("--link-down", type=float, default=20.0)
    p.add_argument("--max-restarts", type=int, default=1000)
    p.add_argument("--restart-delay", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=38100)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dtrain-endurance"))
    add_flags(p, steps=0, out=str(RESULTS), help={"steps": "steps (0: enough for --minutes, timed first)"})
    p.add_argument("--reference", choices=("after", "alongside"), default="after",
                   help="run the uninterrupted reference after the hurt run or at the same time")
    args = p.parse_args()
    work = Path(args.work) / args.fault
    work.mkdir(parents=True, exist_ok=True)
    every = tuple(float(x) for x in args.every.split(","))
    config = make_job(work, 1, args.ranks)
    step_s = time_steps(config, work, args.ranks, args.port) if not args.steps else float("nan")
    steps = args.steps or int(args.minutes * 60 / step_s) + 1
    config = make_job(work, steps, args.ranks)
    print(f"{step_s:.3f} s per step (checkpoint included): {steps} steps for {args.minutes:g} minutes", flush=True)
    log, out, ref, ref_log = work / "launch.log", work / "hurt", work / "reference", work / "reference.log"
    for path in (log, out, ref, ref_log):
        subprocess.run(["rm", "-rf", str(path)])
    rng, events = random.Random(args.seed), []
    ref_box = {}
    reference = threading.Thread(target=run_reference, args=(["-n", args.ranks, "--port", args.port + 50, config,
                                                              "--train.output_dir", ref], ref_log, ref_box))
    if args.reference == "alongside":
        reference.start()
    with ExitStack() as stack:
        common = ["--max-restarts", args.max_restarts, "--restart-delay", args.restart_delay]
        names, env = [], None
        if args.fault == "link":
            import netns  # bench/netns.py

            names, ips = stack.enter_context(netns.namespaces(args.ranks))
            shim = work / "shim"
            shim.mkdir(exist_ok=True)
            (shim / "ssh").write_text(SSH_SHIM)
            (shim / "ssh").chmod(0o755)
            hostfile = work / "hosts.json"
            hostfile.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": n, "ips": [ip]} for n, ip in zip(names, ips)]}))
            common += ["--hostfile", hostfile]
            env = {"PATH": f"{shim}:{os.environ['PATH']}"}
        else:
            common += ["-n", args.ranks]
        start = time.time()
        proc = run_launch([*common, "--port", args.port, config, "--train.output_dir", out], log, env)
        hurt = threading.Thread(target=hurt_loop, args=(proc, args.fault, out, args.ranks, every, args.link_down, rng,
                                                        names, events), daemon=True)
        hurt.start()
        code = proc.wait()
        hurt.join(timeout=args.link_down + 5)
        hurt_seconds = time.time() - start
    print(f"hurt run: exit {code}, {hurt_seconds / 60:.1f} min, {sum(e['hit'] for e in events)} faults", flush=True)
    if args.reference == "after":
        reference.start()
    reference.join()
    ref_code = ref_box.get("code")
    print(f"reference run: exit {ref_code}, {ref_box.get('minutes', 0):.1f} min", flush=True)
    lines = log.read_text().splitlines()
    restarts = [x.split(" ", 1)[1] for x in lines if " launch: restart " in x]
    resumed = resumes(lines)
    result = {
        "fault": args.fault, "ranks": args.ranks, "backend": "ring", "steps": steps,
        "seconds_per_step": step_s, "seed": args.seed, "every_s": every, "restart_delay_s": args.restart_delay,
        "hurt_exit_code": code, "hurt_minutes": hurt_seconds / 60, "reference": args.reference,
        "reference_exit_code": ref_code, "reference_minutes": ref_box.get("minutes"), "faults": events,
        "faults_that_hit": sum(e["hit"] for e in events),
        "restarts": len(restarts), "restart_lines": restarts, "resumed_at_steps": [step for _, step in resumed],
        "fault_to_resume_s": downtimes(events, resumed),
        "hurt": check_run(out, steps),
        "reference_run": check_run(ref, steps) if ref_code == 0 else ref_log.read_text()[-2000:],
        "adapter": adapter_diff(out / "adapters" / "adapters.safetensors", ref / "adapters" / "adapters.safetensors")
        if code == 0 and ref_code == 0 else None,
    }
    path = write_results(f"endurance-{args.fault}", result, args.out)
    path.with_suffix(".log").write_text(log.read_text())
    print(json.dumps({k: result[k] for k in ("faults_that_hit", "restarts", "hurt", "adapter")}, indent=1))
    return 0 if code == 0 and result["adapter"] and result["adapter"]["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
