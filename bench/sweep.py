"""Hyper-parameter sweep for dtrain's defaults on real preference pairs (issue 19).

Every setting in the grid is trained on every dataset by the real trainer (one
``python -m dtrain train -c CONFIG`` process per run, several at once), then the
held-out ``eval/`` scalars are read back from the run's TensorBoard files.

    python bench/sweep.py run OUT [--workers 8] [--budget-s 270] [--steps 24] [--grid full]
    python bench/sweep.py report OUT [--png docs/defaults_sweep.png]

``run`` writes ``OUT/results.json`` (updated after every run, so a cut-short
sweep keeps what finished; a re-run continues) and ``OUT/runs/<dataset>/<setting>/`` (config,
log, TensorBoard). ``report`` prints the markdown table, writes
``OUT/results.csv`` and the plot. Datasets, each with its own held-out split:

- ``orca``: ``$DTRAIN_DATA_DIR/orca_dpo_pairs_validation.jsonl`` (284 pairs, OpenAI
  preference format), 15% held out at random (43 pairs).
- ``stack``: ``$DTRAIN_DATA_DIR/stack_exchange_paired_tiny.json`` (25 pairs, 8
  questions, mapped with ``data.fields``); whole questions are held out (5
  pairs), so no held-out question was seen in training. Tiny: one held-out pair
  moves the accuracy by 0.2.
- ``demo``: 400 generated arithmetic pairs (``data.demo_pairs``), 10% held out.

Runs that cannot finish inside ``--budget-s`` are not started (the grid is
ordered by priority); a run still going at the budget is stopped and listed
as such. Matplotlib is needed for ``report --png`` only (not a dtrain dependency).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from prelude import DATA_DIR, ROOT, add_flags, need_file, runs_of, write_results

from dtrain.run.tracking import read_scalars  # noqa: E402  (no MLX import)
EVAL_KEYS = ("eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen", "eval/logps/rejected",
             "eval/nll_loss", "eval/log_odds_ratio")

# The centre of the grid; each setting below changes one or two keys of it.
CENTRE = {"learning_rate": 5e-4, "schedule": "cosine", "warmup_frac": 0.1, "rank": 8, "scale": 20.0, "lam": 0.1}
VARIATIONS = [  # in priority order: what runs first when the budget is short
    ("centre", {}),
    ("old-defaults", {"learning_rate": 1e-4, "warmup_frac": 0.0}),  # dtrain/config.py before this sweep
    ("lr1e-3", {"learning_rate": 1e-3}),
    ("lr2e-4", {"learning_rate": 2e-4}),
    ("lr2e-3", {"learning_rate": 2e-3}),
    ("lam0.2", {"lam": 0.2}),
    ("lam0.05", {"lam": 0.05}),
    ("constant", {"schedule": "constant", "warmup_frac": 0.0}),
    ("scale10", {"scale": 10.0}),
    ("rank16", {"rank": 16}),
    ("lam0.5", {"lam": 0.5}),
    ("linear", {"schedule": "linear"}),
    ("no-warmup", {"warmup_frac": 0.0}),
    ("lr1e-3-lam0.2", {"learning_rate": 1e-3, "lam": 0.2}),
    ("rank4", {"rank": 4}),
    ("lr1e-4", {"learning_rate": 1e-4}),
]
GRIDS = {"full": [n for n, _ in VARIATIONS], "cpu": ["centre", "old-defaults"],
         "quick": ["old-defaults", "lr2e-4", "centre", "lr1e-3"], "smoke": ["centre", "lr2e-3"],
         # what "quick" (learning rate only) left out: the other axes around the centre
         "rest": ["centre", "lam0.2", "constant", "scale10", "rank16", "lam0.05", "lam0.5", "linear",
                  "no-warmup", "rank4", "lr2e-3"]}


def as_read(path: str) -> str:
    """``path`` made absolute where it names a file or folder here: each run starts in its own folder.
    Anything else (``demo``, a hub id) as given."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def setting(name: str) -> dict:
    return {**CENTRE, **dict(VARIATIONS)[name]}


def stack_split(out: Path, data_dir: Path, target: int = 5, seed: int = 0) -> tuple:
    """Write the stack-exchange rows as train/valid JSON files, holding out whole questions.

    Questions are visited in ``random.Random(seed)`` order and held out while
    the held-out rows stay <= ``target``. Returns ``(train_path, valid_path, held_out_questions)``.
    """
    rows = json.loads((data_dir / FILES["stack"]).read_text(encoding="utf-8"))
    questions = list(dict.fromkeys(r["question"] for r in rows))
    random.Random(seed).shuffle(questions)
    held, n = set(), 0
    for q in questions:
        k = sum(r["question"] == q for r in rows)
        if n + k <= target:
            held.add(q)
            n += k
    out.mkdir(parents=True, exist_ok=True)
    train, valid = out / "stack_train.json", out / "stack_valid.json"
    train.write_text(json.dumps([r for r in rows if r["question"] not in held]), encoding="utf-8")
    valid.write_text(json.dumps([r for r in rows if r["question"] in held]), encoding="utf-8")
    return train, valid, sorted(q[:50] for q in held)


FILES = {"orca": "orca_dpo_pairs_validation.jsonl", "stack": "stack_exchange_paired_tiny.json"}  # in --data-dir


def need_data(parser, data_dir: Path, names) -> None:
    """Stop with ``parser``'s one-line error when a dataset of ``names`` has no file in ``data_dir``."""
    for name in names:
        if name in FILES:
            need_file(parser, data_dir / FILES[name], "--data-dir")


def datasets(out: Path, data_dir: Path, max_length: int, names=tuple(FILES)) -> dict:
    """dataset name -> its ``data:`` section (each with its own held-out split); ``names`` read files."""
    long = {"max_length": max_length, "max_prompt_length": max_length // 2}
    data = {"demo": {"demo_pairs": 400, "valid_fraction": 0.1, "max_length": 128, "max_prompt_length": 96}}
    if "orca" in names:
        data["orca"] = {"train": str(data_dir / FILES["orca"]), "valid_fraction": 0.15, **long}
    if "stack" in names:
        train, valid, _ = stack_split(out / "data", data_dir)
        data["stack"] = {"train": str(train), "valid": str(valid), **long,
                         "fields": {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}}
    return data


def run_config(s: dict, data: dict, args, out_dir: Path) -> dict:
    """The full YAML config of one run (every key the sweep relies on is explicit)."""
    return {
        "model": {"path": args.model, "dtype": args.dtype},
        "lora": {"rank": s["rank"], "scale": s["scale"], "dropout": 0.0, "num_layers": -1},
        "data": data,
        "orpo": {"lambda": s["lam"]},
        "engine": {"kind": args.engine, "segment_layers": args.segment_layers, "prefix_sharing": args.engine == "segmented",
                   "head_chunk_tokens": args.head_chunk},
        "train": {"steps": args.steps, "global_batch_pairs": args.batch, "micro_batch_pairs": args.micro,
                  "learning_rate": s["learning_rate"], "schedule": s["schedule"],
                  "warmup_steps": round(s["warmup_frac"] * args.steps), "grad_clip": 1.0, "seed": 0,
                  "eval_every": args.steps // 2, "eval_pairs": args.eval_pairs, "output_dir": str(out_dir),
                  "progress": False},
    }


def collect(run_dir: Path, cfg: dict, seconds: float, rc: int) -> dict:
    """One run's record: its config, held-out scalars per evaluated step, timing, warnings."""
    rec = {"config": cfg, "seconds": round(seconds, 1), "returncode": rc}
    tb = sorted((run_dir / "train" / "tb").glob("*"))
    if tb:
        scalars = read_scalars(tb[-1])
        rec["eval"] = {k: {str(s): v for s, v in scalars.get(k, [])} for k in EVAL_KEYS}
        steps = [v for _, v in scalars.get("perf/step_seconds", [])]
        rec["median_step_seconds"] = statistics.median(steps) if steps else None
        rec["final_train_loss"] = scalars["loss"][-1][1] if scalars.get("loss") else None
        rec["peak_memory_gb"] = max((v for _, v in scalars.get("peak_memory_gb", [])), default=None)
    log = (run_dir / "log.txt").read_text(errors="replace") if (run_dir / "log.txt").is_file() else ""
    rec["guard_warnings"] = [line for line in log.splitlines() if line.startswith("warning: step")]
    rec["log_tail"] = log.strip().splitlines()[-3:]
    return rec


def start(name: str, ds: str, data: dict, args, out: Path, env: dict) -> tuple:
    """Write the run's config and start ``bench/sweep.py train`` on it; returns what ``finish`` needs."""
    run_dir = out / "runs" / ds / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_config(setting(name), data[ds], args, run_dir / "train")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = open(run_dir / "log.txt", "w")
    cmd = [sys.executable, __file__, "train", str(run_dir / "config.yaml"), "--cache-limit-gb", str(args.cache_limit_gb)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir)
    return proc, (name, ds, run_dir, cfg, time.monotonic(), log)


def run(args) -> None:
    """Run the grid, ``args.workers`` runs at once, starting none that would end after the budget."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = datasets(out, Path(args.data_dir).resolve(), args.max_length, args.datasets)
    args.model = as_read(args.model)
    results_path = out / "results.json"
    results = runs_of(json.loads(results_path.read_text())) if results_path.is_file() else {}
    jobs = [(s, d) for s in GRIDS[args.grid] for d in args.datasets if f"{d}/{s}" not in results]  # a re-run continues
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    t0, running, durations = time.monotonic(), {}, {d: [] for d in args.datasets}
    print(f"sweep: {len(jobs)} runs, {args.workers} at once, budget {args.budget_s} s", flush=True)

    def guess(ds: str) -> float:  # a run's length on this dataset, from those that finished
        return statistics.median(durations[ds]) if durations[ds] else args.first_guess_s

    while jobs or running:
        while jobs and len(running) < args.workers and time.monotonic() - t0 + guess(jobs[0][1]) <= args.budget_s:
            proc, info = start(*jobs.pop(0), data, args, out, env)
            running[proc] = info
        if not running:
            break  # what is left cannot finish inside the budget
        time.sleep(1.0)
        over = time.monotonic() - t0 > args.budget_s + args.grace_s
        for proc in [p for p in running if p.poll() is not None or over]:
            name, ds, run_dir, cfg, began, log = running.pop(proc)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            seconds = time.monotonic() - began
            rec = collect(run_dir, cfg, seconds, proc.returncode)
            if proc.returncode == 0:
                durations[ds].append(seconds)
            results[f"{ds}/{name}"] = rec
            write_results("results", results, out, stamp=False)
            print(f"[{time.monotonic() - t0:6.0f} s] {ds}/{name}: rc {proc.returncode}, {seconds:.0f} s, "
                  f"{summary_line(rec)}", flush=True)
    if jobs:
        results["_not_run"] = [f"{d}/{s}" for s, d in jobs]
        write_results("results", results, out, stamp=False)
        print(f"not run (budget): {', '.join(results['_not_run'])}", flush=True)


def train_one(args) -> int:
    """One run: ``dtrain train -c CONFIG`` in this process, MLX's buffer cache capped first.

    MLX keeps freed buffers for reuse (its cache limit defaults to the memory
    limit); with new shapes every step each process's cache grew to ~28 GB on
    an H200 while ``mx.get_peak_memory`` stayed near 3.5 GB, so 5 runs at once
    ran out of GPU memory. The cap only bounds that cache.
    """
    from dtrain.blas import setup

    setup()  # before MLX, as `dtrain train` does
    import mlx.core as mx

    from dtrain.cli import main as dtrain_main

    if args.cache_limit_gb > 0:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    return dtrain_main(["train", "-c", args.config])


def first_last(rec: dict, key: str) -> tuple:
    """``(value at step 0, value at the last step)``; None where that eval did not happen."""
    vals = rec.get("eval", {}).get(key, {})
    last = str(rec["config"]["train"]["steps"])
    return vals.get("0"), vals.get(last)


def summary_line(rec: dict) -> str:
    a0, a1 = first_last(rec, "eval/rewards/accuracies")
    c0, c1 = first_last(rec, "eval/logps/chosen")
    if a1 is None or c1 is None:
        return "no final eval; " + " | ".join(rec.get("log_tail", []))[-300:]
    return f"acc {a0:.3f} -> {a1:.3f}, logps/chosen {c0:.3f} -> {c1:.3f}"


def rows(results: dict) -> list:
    """Flat table rows: one per dataset and setting that has a final evaluation."""
    out = []
    for key, rec in runs_of(results).items():
        ds, name = key.split("/", 1)
        t, lora = rec["config"]["train"], rec["config"]["lora"]
        row = {"dataset": ds, "setting": name, "learning_rate": t["learning_rate"], "schedule": t["schedule"],
               "warmup_steps": t["warmup_steps"], "rank": lora["rank"], "scale": lora["scale"],
               "lambda": rec["config"]["orpo"]["lambda"], "steps": t["steps"], "seconds": rec["seconds"],
               "guard_warnings": len(rec.get("guard_warnings", []))}
        for k in EVAL_KEYS:
            v0, v1 = first_last(rec, k)
            short = k.removeprefix("eval/")
            row[f"{short}@0"], row[f"{short}@end"] = v0, v1
        if row["rewards/accuracies@end"] is not None:
            out.append(row)
    return out


def report(args) -> None:
    out = Path(args.out)
    results = json.loads((out / "results.json").read_text())
    runs, table = runs_of(results), rows(results)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    order = [n for n, _ in VARIATIONS]
    sets = sorted({r["dataset"] for r in table}, key=["orca", "stack", "demo"].index)
    by = {(r["dataset"], r["setting"]): r for r in table}
    print("| setting | lr | schedule, warmup | rank / scale | λ | " + " | ".join(
        f"{d}: acc (base {by_base(table, d):.2f}) | {d}: Δ logps/chosen | {d}: nll" for d in sets) + " |")
    print("|---|---|---|---|---|" + "---|---|---|" * len(sets))
    for name in order:
        present = [by.get((d, name)) for d in sets]
        if not any(present):
            continue
        r0 = next(r for r in present if r)
        cells = []
        for r in present:
            if r is None:
                cells += ["–", "–", "–"]
                continue
            dc = r["logps/chosen@end"] - r["logps/chosen@0"]
            cells += [f"{r['rewards/accuracies@end']:.2f}", f"{dc:+.3f}",
                      f"{r['nll_loss@0']:.3f} → {r['nll_loss@end']:.3f}"]
        print(f"| {name} | {r0['learning_rate']:g} | {r0['schedule']}, {r0['warmup_steps']} | "
              f"{r0['rank']} / {r0['scale']:g} | {r0['lambda']:g} | " + " | ".join(cells) + " |")
    print("\nbase model (step-0 eval, the same for every setting of a dataset):")
    for ds in ("orca", "stack", "demo"):
        rec = next((r for k, r in runs.items() if k.startswith(f"{ds}/") and r.get("eval", {}).get(EVAL_KEYS[0])), None)
        if rec is not None:
            base = {k.removeprefix("eval/"): first_last(rec, k)[0] for k in EVAL_KEYS}
            print(f"- {ds}: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items() if v is not None))
    failed = sorted(k for k, r in runs.items() if r["returncode"] != 0)
    if failed:
        print(f"\nfailed or stopped ({len(failed)}): {', '.join(failed)}")
    if results.get("_not_run"):
        print(f"\nnot run (budget): {', '.join(results['_not_run'])}")
    if args.png:
        plot(table, sets, order, Path(args.png))


def by_base(table: list, ds: str) -> float:
    return next(r["rewards/accuracies@0"] for r in table if r["dataset"] == ds)


def plot(table: list, sets: list, order: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in order if any(r["setting"] == n for r in table)]
    by = {(r["dataset"], r["setting"]): r for r in table}
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.5), sharex=True)
    width = 0.8 / len(sets)
    for i, ds in enumerate(sets):
        xs = [j + (i - (len(sets) - 1) / 2) * width for j in range(len(names))]
        acc = [by[(ds, n)]["rewards/accuracies@end"] if (ds, n) in by else float("nan") for n in names]
        dc = [by[(ds, n)]["logps/chosen@end"] - by[(ds, n)]["logps/chosen@0"] if (ds, n) in by else float("nan")
              for n in names]
        bars = axes[0].bar(xs, acc, width, label=ds)
        axes[0].axhline(by_base(table, ds), color=bars.patches[0].get_facecolor(), ls="--", lw=1)
        axes[1].bar(xs, dc, width, label=ds)
    axes[0].set_ylabel("held-out reward accuracy\n(dashed: base model)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(ncol=len(sets), loc="upper left")
    axes[1].axhline(0, color="black", lw=0.8)
    axes[1].set_ylabel("held-out logps/chosen\nchange from base (nats/token)")
    axes[1].set_xticks(range(len(names)), names, rotation=35, ha="right")
    fig.suptitle("ORPO + LoRA sweep, SmolLM2-135M-Instruct: final held-out metrics of the runs that finished")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"\nwrote {png}")


def steps_report(args) -> None:
    """Table and plot of the same settings run for different step counts (one sweep folder per count)."""
    runs = []
    for d in args.outs:
        runs += rows(json.loads((Path(d) / "results.json").read_text()))
    sets = [d for d in ("orca", "stack", "demo") if any(r["dataset"] == d for r in runs)]
    counts = sorted({r["steps"] for r in runs})
    names = [n for n, _ in VARIATIONS if len({r["steps"] for r in runs if r["setting"] == n}) > 1]  # run at 2+ lengths
    by = {(r["dataset"], r["setting"], r["steps"]): r for r in runs}
    print("| dataset | setting | lr | " + " | ".join(f"{c} steps: acc / Δ logps/chosen / nll" for c in counts) + " |")
    print("|---|---|---|" + "---|" * len(counts))
    for ds in sets:
        for n in names:
            cells = []
            for c in counts:
                r = by.get((ds, n, c))
                cells.append("–" if r is None else f"{r['rewards/accuracies@end']:.2f} / "
                             f"{r['logps/chosen@end'] - r['logps/chosen@0']:+.3f} / {r['nll_loss@end']:.3f}")
            lr = next(r["learning_rate"] for r in runs if r["setting"] == n)
            print(f"| {ds} | {n} | {lr:g} | " + " | ".join(cells) + " |")
    if not args.png:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sets), figsize=(4.2 * len(sets), 6.5), sharex=True, squeeze=False)
    for j, ds in enumerate(sets):
        for n in names:
            pts = [(c, by[(ds, n, c)]) for c in counts if (ds, n, c) in by]
            if not pts:
                continue
            xs = [c for c, _ in pts]
            axes[0][j].plot(xs, [r["rewards/accuracies@end"] for _, r in pts], marker="o", label=n)
            axes[1][j].plot(xs, [r["logps/chosen@end"] - r["logps/chosen@0"] for _, r in pts], marker="o", label=n)
        axes[0][j].axhline(by_base(runs, ds), color="grey", ls="--", lw=1)
        axes[0][j].set_title(ds)
        axes[0][j].set_ylim(0, 1.05)
        axes[1][j].axhline(0, color="black", lw=0.8)
        axes[1][j].set_xlabel("optimizer steps (8 pairs each)")
    axes[0][0].set_ylabel("held-out reward accuracy\n(dashed: base model)")
    axes[1][0].set_ylabel("held-out logps/chosen\nchange from base (nats/token)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Learning rate against run length, SmolLM2-135M-Instruct, ORPO + LoRA")
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"\nwrote {args.png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--model", default="demo")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--engine", default="segmented", help="segmented bounds memory for many runs on one GPU")
    r.add_argument("--segment-layers", type=int, default=6)
    r.add_argument("--head-chunk", type=int, default=512)
    r.add_argument("--data-dir", default=str(DATA_DIR))
    r.add_argument("--datasets", nargs="+", default=["orca", "stack", "demo"], choices=["orca", "stack", "demo"])
    r.add_argument("--grid", choices=sorted(GRIDS), default="full")
    add_flags(r, steps=24, help={"steps": "training steps per run"})
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--micro", type=int, default=4)
    r.add_argument("--max-length", type=int, default=1024)
    r.add_argument("--eval-pairs", type=int, default=0, help="held-out pairs per evaluation; 0 = all")
    r.add_argument("--workers", type=int, default=8)
    r.add_argument("--cache-limit-gb", type=float, default=4.0, help="MLX buffer cache per run (0 = MLX's default)")
    r.add_argument("--budget-s", type=float, default=270.0, help="start no run that would end after this")
    r.add_argument("--grace-s", type=float, default=20.0, help="then stop runs still going this much later")
    r.add_argument("--first-guess-s", type=float, default=150.0, help="run length assumed before one finished")
    t = sub.add_parser("train", help="one run (what `run` starts per setting)")
    t.add_argument("config")
    t.add_argument("--cache-limit-gb", type=float, default=0.0)
    g = sub.add_parser("report")
    g.add_argument("out")
    g.add_argument("--png", default=None)
    st = sub.add_parser("steps", help="the same settings at several step counts: table and plot")
    st.add_argument("outs", nargs="+", help="sweep folders, one per step count")
    st.add_argument("--png", default=None)
    args = p.parse_args()
    if args.command == "run":
        need_data(r, Path(args.data_dir), args.datasets)
    if args.command == "train":
        sys.exit(train_one(args))
    {"run": run, "report": report, "steps": steps_report}[args.command](args)


if __name__ == "__main__":
    main()
