"""Fixed λ against the dynamic-λ controller and keep_best (issue 25, part 3).

Every arm is trained on every dataset and seed by the real trainer (one
``dtrain train`` process per run, several at once, as ``bench/sweep.py`` does),
from ``configs/preference.yaml`` as shipped with only the data, the seed, the
arm's keys, the evaluation cadence and the output folder changed. One command
runs what is missing and then writes the table and the plots:

    python bench/lambda_sweep.py run OUT [--seeds 0 1 2] [--datasets orca stack demo] \\
        [--extra NAME=FILE ...] [--workers 12] [--budget-s 540] [--png docs/lambda_sweep.png]
    python bench/lambda_sweep.py report OUT [--png docs/lambda_sweep.png]   # the table and plots again

``run`` writes ``OUT/results.json`` after every run (a re-run continues: what
finished is not run again), then prints the markdown table, writes
``OUT/results.csv`` and, with ``--png``, the plots (matplotlib, the ``bench``
extra): per dataset, held-out accuracy, chosen log-prob change from the base
and λ per evaluated step, one line per arm (mean over seeds).

Arms (``ARMS``): fixed λ 0.05/0.1/0.2/0.5 (0.1: the default before the controller
shipped), ``adaptive`` (the controller with ε 0.005, as first shipped),
``adaptive-eps`` (ε 0.06, from the measured noise), ``best`` / ``best-guard``
(λ 0.1 + ``train.keep_best: eval/rewards/accuracies``, without / with
``train.keep_best_guard: 0.0``), ``adaptive+best``, ``lor-guard`` (λ 0.1 +
keep_best ``eval/log_odds_ratio`` with guard 0.0) and ``shipped``
(``configs/preference.yaml`` untouched); every arm but ``shipped`` starts from
fixed λ without keep_best (``FIXED``). Datasets: those of
``bench/sweep.py`` (orca, stack, demo, each with its own held-out split) and any
``--extra NAME=FILE`` (a preference file dtrain reads, 10% held out). Since
keep_best does not change training, ``report`` also applies each rule of
``PICKS`` to every trained arm's evaluations with the trainer's own
``dtrain.run.best.pick_best``.

Reported per run, at the end and at the *written* adapter (the kept step with
keep_best, else the last): held-out reward accuracy, margin, chosen log-prob
minus the base's (step 0) and NLL.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

import sweep  # bench/sweep.py: datasets, the per-run train command
from prelude import DATA_DIR, ROOT, add_flags, need_file, runs_of, write_results

from dtrain.run.best import pick_best  # noqa: E402  (no MLX import)
from dtrain.run.tracking import read_scalars  # noqa: E402  (no MLX import)

ACC, MARGIN, CHOSEN, NLL = ("eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen", "eval/nll_loss")
LOR = "eval/log_odds_ratio"
BEST = {"keep_best": ACC}
EPS_NOISE = 0.06  # ε at 2 sd of the 3-point slope of held-out ℓw, measured on orca/demo (docs/defaults.md)
# Every arm but "shipped" starts from fixed λ without keep_best (the earlier default), then sets its own keys.
FIXED = {"orpo": {"lambda_schedule": "static"}, "train": {"keep_best": None, "keep_best_guard": None}}
ADAPTIVE = {"lambda_schedule": "adaptive"}
ARMS = {  # name -> {section: {key: value}} over configs/preference.yaml and FIXED
    "lam0.05": {"orpo": {"lambda": 0.05}},
    "lam0.1": {"orpo": {"lambda": 0.1}},  # the default before configs/preference.yaml shipped the controller
    "lam0.2": {"orpo": {"lambda": 0.2}},
    "lam0.5": {"orpo": {"lambda": 0.5}},
    "adaptive": {"orpo": {**ADAPTIVE, "lambda_epsilon": 0.005}},  # ε as first shipped: a placeholder
    "best": {"train": BEST},
    "best-guard": {"train": {**BEST, "keep_best_guard": 0.0}},
    "adaptive+best": {"orpo": {**ADAPTIVE, "lambda_epsilon": 0.005}, "train": BEST},
    "adaptive-eps": {"orpo": {**ADAPTIVE, "lambda_epsilon": EPS_NOISE}},
    "lor-guard": {"train": {"keep_best": LOR, "keep_best_guard": 0.0}},  # λ 0.1, best log-odds at or above the base
    "shipped": {},  # configs/preference.yaml as it is (adaptive-eps + lor-guard)
}
# keep_best rules applied to each trained run's evaluations after the fact, with the trainer's own
# rule (dtrain.run.best.pick_best): keep_best does not change training, only which step is written.
PICKS = {"end": None, "acc": (ACC, None), "acc+guard0": (ACC, 0.0), "lor": (LOR, None), "lor+guard0": (LOR, 0.0)}


def keeps_best(arm: str) -> bool:
    """Whether ``arm`` sets train.keep_best itself (its trainer writes a kept step)."""
    return "keep_best" in ARMS[arm].get("train", {})


def run_config(base: dict, arm: str, data: dict, seed: int, args, out_dir: Path) -> dict:
    """configs/preference.yaml with this run's data, seed, arm keys, cadence and folder."""
    cfg = json.loads(json.dumps(base))
    cfg["data"] = dict(data)
    cfg["model"]["path"] = args.model
    if args.dtype:
        cfg["model"]["dtype"] = args.dtype
    cfg["engine"].update({"kind": args.engine, "segment_layers": args.segment_layers})
    if args.budget_gb:  # several runs share one GPU: each plans for its share, not the whole card
        cfg["engine"]["memory_budget_gb"] = args.budget_gb
    steps = args.steps or cfg["train"]["steps"]
    cfg["train"].update({"steps": steps, "seed": seed, "eval_every": max(steps // args.evals, 1),
                         "eval_pairs": args.eval_pairs, "output_dir": str(out_dir), "progress": False})
    if args.batch:
        cfg["train"].update({"global_batch_pairs": args.batch, "micro_batch_pairs": min(args.batch, 8)})
    if args.steps:
        cfg["train"]["warmup_steps"] = round(base["train"]["warmup_steps"] * steps / base["train"]["steps"])
    for section, keys in (FIXED if arm != "shipped" else {}).items():
        cfg[section].update(keys)
    for section, keys in ARMS[arm].items():
        cfg[section].update(keys)
    return cfg


def collect(run_dir: Path, cfg: dict, seconds: float, rc: int) -> dict:
    """One run: ``bench/sweep.py``'s record (held-out scalars per evaluated step, timing) plus λ per
    step and the kept step."""
    rec = sweep.collect(run_dir, cfg, seconds, rc)
    tb = sorted((run_dir / "train" / "tb").glob("*"))
    if tb:
        scalars = read_scalars(tb[-1])
        rec["lambda"] = {str(s): v for s, v in scalars.get("train/lambda", [])}
        best = scalars.get("best/step", [])
        rec["best_step"] = int(best[-1][1]) if best else None
    return rec


def run(args) -> None:
    """Run every missing (dataset, arm, seed), ``args.workers`` at once, inside the budget; then report."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load((ROOT / "configs" / "preference.yaml").read_text())
    data = sweep.datasets(out, Path(args.data_dir).resolve(), args.max_length, args.datasets)  # runs start in their own folders
    args.model = sweep.as_read(args.model)
    for item in args.extra:
        name, path = item.split("=", 1)
        data[name] = {"train": sweep.as_read(path), "valid_fraction": 0.1, "max_length": args.max_length,
                      "max_prompt_length": args.max_length // 2}
    results_path = out / "results.json"
    results = runs_of(json.loads(results_path.read_text())) if results_path.is_file() else {}
    jobs = [(d, a, s) for s in args.seeds for d in args.datasets + [e.split("=")[0] for e in args.extra]
            for a in args.arms if f"{d}/{a}/{s}" not in results]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    t0, running, durations = time.monotonic(), {}, []
    print(f"lambda sweep: {len(jobs)} runs, {args.workers} at once, budget {args.budget_s} s", flush=True)
    while jobs or running:
        guess = statistics.median(durations) if durations else args.first_guess_s
        while jobs and len(running) < args.workers and time.monotonic() - t0 + guess <= args.budget_s:
            ds, arm, seed = jobs.pop(0)
            run_dir = out / "runs" / ds / arm / str(seed)
            run_dir.mkdir(parents=True, exist_ok=True)
            cfg = run_config(base, arm, data[ds], seed, args, run_dir / "train")
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
            log = open(run_dir / "log.txt", "w")
            cmd = [sys.executable, str(ROOT / "bench" / "sweep.py"), "train", str(run_dir / "config.yaml"),
                   "--cache-limit-gb", str(args.cache_limit_gb)]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir)
            running[proc] = (f"{ds}/{arm}/{seed}", run_dir, cfg, time.monotonic(), log)
        if not running:
            break  # what is left cannot finish inside the budget
        time.sleep(1.0)
        over = time.monotonic() - t0 > args.budget_s + args.grace_s
        for proc in [p for p in running if p.poll() is not None or over]:
            key, run_dir, cfg, began, log = running.pop(proc)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            seconds = time.monotonic() - began
            if proc.returncode == 0:
                durations.append(seconds)
            results[key] = collect(run_dir, cfg, seconds, proc.returncode)
            write_results("results", results, out, stamp=False)
            print(f"[{time.monotonic() - t0:6.0f} s] {key}: rc {proc.returncode}, {seconds:.0f} s", flush=True)
    if jobs:
        print(f"not run (budget; run again to continue): {', '.join('/'.join(map(str, j)) for j in jobs)}", flush=True)
    report(args)


def at(rec: dict, key: str, step) -> float | None:
    return rec.get("eval", {}).get(key, {}).get(str(step))


def row(key: str, rec: dict) -> dict | None:
    """A flat record of one finished run: end and written-adapter metrics."""
    ds, arm, seed = key.split("/")
    last = rec["config"]["train"]["steps"]
    if at(rec, ACC, last) is None or at(rec, CHOSEN, 0) is None:
        return None
    written = rec.get("best_step") or last
    out = {"dataset": ds, "arm": arm, "seed": int(seed), "steps": last, "written_step": written,
           "seconds": rec["seconds"], "base_acc": at(rec, ACC, 0), "base_chosen": at(rec, CHOSEN, 0)}
    for where, step in (("end", last), ("written", written)):
        out[f"acc@{where}"] = at(rec, ACC, step)
        out[f"margin@{where}"] = at(rec, MARGIN, step)
        out[f"dchosen@{where}"] = at(rec, CHOSEN, step) - out["base_chosen"]
        out[f"nll@{where}"] = at(rec, NLL, step)
    lams = list(rec.get("lambda", {}).values())
    out["lambda_last"] = lams[-1] if lams else None
    return out


def mean_sd(values: list, signed: bool = False) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):{'+' if signed else ''}.3f} ± {sd:.3f}"


def report(args) -> None:
    out = Path(args.out)
    results = runs_of(json.loads((out / "results.json").read_text()))
    table = [r for k, rec in results.items() if (r := row(k, rec)) is not None]
    failed = sorted(k for k, rec in results.items() if rec["returncode"] != 0 or row(k, rec) is None)
    if not table:
        print("no finished runs" + (f"; failed: {', '.join(failed)}" if failed else ""))
        return
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    sets = list(dict.fromkeys(r["dataset"] for r in table))
    print("Mean ± sd over seeds; Δ chosen = held-out logps/chosen minus the base's (step 0), nats/token; "
          "'written' = the adapter in adapters/ (the kept step with keep_best, else the last).\n")
    print("| dataset | arm | seeds | acc end | acc written | margin written | Δ chosen end | Δ chosen written | "
          "nll written | written step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ds in sets:
        for arm in ARMS:
            rs = [r for r in table if r["dataset"] == ds and r["arm"] == arm]
            if not rs:
                continue
            cols = [mean_sd([r[k] for r in rs], k.startswith("dchosen")) for k in (
                "acc@end", "acc@written", "margin@written", "dchosen@end", "dchosen@written", "nll@written")]
            steps = ", ".join(str(r["written_step"]) for r in sorted(rs, key=lambda r: r["seed"]))
            print(f"| {ds} | {arm} | {len(rs)} | " + " | ".join(cols) + f" | {steps} |")
    print("\nbase (step 0): " + "; ".join(
        f"{ds} acc {statistics.mean(r['base_acc'] for r in table if r['dataset'] == ds):.3f}, logps/chosen "
        f"{statistics.mean(r['base_chosen'] for r in table if r['dataset'] == ds):.3f}" for ds in sets))
    print("\nnoise of held-out logps/chosen between evaluations (fixed-λ arms; for orpo.lambda_epsilon):")
    for ds in sets:
        sigma = chosen_noise(results, ds)
        if sigma is not None:
            print(f"- {ds}: σ {sigma:.4f} nats/token; the 3-point slope's noise σ/√2 {sigma / 2**0.5:.4f}; "
                  f"ε at 2 sd of it: {2 * sigma / 2**0.5:.4f} per evaluation")
    picks_table(results, sets)
    if failed:
        print(f"\nfailed or unfinished ({len(failed)}): {', '.join(failed)}")
    if args.png:
        plot(results, sets, Path(args.png))


def picked(rec: dict, rule) -> int | None:
    """The step a keep_best ``rule`` ((metric, guard) or None: the last step) writes for one run."""
    ev = rec.get("eval", {})
    steps = sorted(int(s) for s in ev.get(ACC, {}))
    if not steps:
        return None
    if rule is None:
        return steps[-1]
    evals = {s: {k: series[str(s)] for k, series in ev.items() if str(s) in series} for s in steps}
    return pick_best(evals, *rule).step or steps[-1]  # none eligible: the trainer writes the last step


def picks_table(results: dict, sets: list) -> None:
    """Each keep_best rule of :data:`PICKS` applied to every trained arm's evaluations (mean ± sd over seeds),
    and, for the arms that ran keep_best in the trainer, whether the trainer wrote the step the rule picks."""
    arms = [a for a in ARMS if a != "shipped" and not keeps_best(a)]
    print("\nkeep_best rules applied to each run's evaluations (acc / Δ chosen / nll at the written step; "
          "'end' = no keep_best):\n")
    print("| dataset | arm | seeds | " + " | ".join(PICKS) + " |")
    print("|---|---|---|" + "---|" * len(PICKS))
    for ds in sets:
        for arm in arms:
            recs = [rec for k, rec in results.items() if k.startswith(f"{ds}/{arm}/") and row(k, rec)]
            if not recs:
                continue
            cells = []
            for rule in PICKS.values():
                got = [(rec["eval"], str(picked(rec, rule))) for rec in recs]
                cells.append(" / ".join(f"{statistics.mean(v):{'+' if signed else ''}.3f}" for v, signed in (
                    ([e[ACC][s] for e, s in got], False), ([e[CHOSEN][s] - e[CHOSEN]["0"] for e, s in got], True),
                    ([e[NLL][s] for e, s in got], False))))
            print(f"| {ds} | {arm} | {len(recs)} | " + " | ".join(cells) + " |")
    for k, rec in sorted(results.items()):
        keep = rec.get("config", {}).get("train", {}).get("keep_best")
        if keep and row(k, rec):
            rule = (keep, rec["config"]["train"].get("keep_best_guard"))
            print(f"- {k}: the trainer wrote step {rec.get('best_step')}, the rule picks step {picked(rec, rule)}")


def chosen_noise(results: dict, ds: str) -> float | None:
    """σ of held-out ℓw around a smooth trend, pooled over the fixed-λ runs of ``ds``.

    Each inner point's residual from the line through its two neighbours,
    ``r = y[i] - (y[i-1] + y[i+1]) / 2``, has variance 1.5 σ² for white noise on
    a locally linear trend, so σ = rms(r) / √1.5 (evaluation steps 1.. only:
    step 0 is the base). None with fewer than 3 evaluated steps.
    """
    res = []
    for k, rec in results.items():
        if not k.startswith(f"{ds}/lam") or rec["returncode"] != 0:
            continue
        series = rec.get("eval", {}).get(CHOSEN, {})
        ys = [series[s] for s in sorted(series, key=int) if int(s) > 0]
        res += [ys[i] - (ys[i - 1] + ys[i + 1]) / 2 for i in range(1, len(ys) - 1)]
    if not res:
        return None
    return (sum(r * r for r in res) / len(res) / 1.5) ** 0.5


def curves(results: dict, ds: str, arm: str, key: str, base_relative: bool = False) -> tuple:
    """``(steps, mean over seeds)`` of an eval scalar (or ``lambda``) per evaluated step."""
    per_step: dict = {}
    for k, rec in results.items():
        if not k.startswith(f"{ds}/{arm}/") or rec["returncode"] != 0:
            continue
        series = rec.get("lambda", {}) if key == "lambda" else rec.get("eval", {}).get(key, {})
        base = at(rec, key, 0) if base_relative else 0.0
        for s, v in series.items():
            per_step.setdefault(int(s), []).append(v - (base or 0.0))
    steps = sorted(per_step)
    return steps, [statistics.mean(per_step[s]) for s in steps]


def plot(results: dict, sets: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(ACC, "held-out reward accuracy", False), (CHOSEN, "held-out logps/chosen\nminus base (nats/token)", True),
              ("lambda", "λ of the step", False)]
    fig, axes = plt.subplots(len(panels), len(sets), figsize=(4.6 * len(sets), 9), sharex="col", squeeze=False)
    for j, ds in enumerate(sets):
        for arm in ARMS:
            for i, (key, _, rel) in enumerate(panels):
                xs, ys = curves(results, ds, arm, key, rel)
                if xs:
                    axes[i][j].plot(xs, ys, marker="." if key != "lambda" else None, label=arm,  # one colour per arm
                                    ls="--" if keeps_best(arm) else "-",
                                    color=f"C{list(ARMS).index(arm) % 10}")
        axes[0][j].set_title(ds)
        axes[1][j].axhline(0, color="black", lw=0.8)
        axes[-1][j].set_xlabel("optimizer step")
    for i, (_, label, _) in enumerate(panels):
        axes[i][0].set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Fixed λ vs the λ controller vs keep_best\n(mean over seeds; dashed: keep_best arms)", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"\nwrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run what is missing, then report")
    r.add_argument("out")
    r.add_argument("--model", default="demo")
    r.add_argument("--dtype", default=None, help="model.dtype; default: configs/preference.yaml's (auto)")
    r.add_argument("--engine", default="segmented")
    r.add_argument("--segment-layers", type=int, default=0)
    r.add_argument("--data-dir", default=str(DATA_DIR))
    r.add_argument("--datasets", nargs="+", default=["orca", "stack", "demo"], choices=["orca", "stack", "demo"])
    r.add_argument("--extra", action="append", default=[], help="NAME=FILE: another preference file, 10%% held out")
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add_flags(r, steps=0, help={"steps": "training steps per run; 0: configs/preference.yaml's (warmup scaled with it)"})
    r.add_argument("--batch", type=int, default=0, help="global batch pairs; 0: configs/preference.yaml's")
    r.add_argument("--evals", type=int, default=10, help="evaluations per run after step 0 (eval_every = steps / this)")
    r.add_argument("--eval-pairs", type=int, default=0, help="held-out pairs per evaluation; 0 = all")
    r.add_argument("--max-length", type=int, default=512, help="orca, stack, --extra (demo: 128, as bench/sweep.py)")
    r.add_argument("--workers", type=int, default=12)
    r.add_argument("--budget-gb", type=float, default=0.0, help="engine.memory_budget_gb per run (0: the config's)")
    r.add_argument("--cache-limit-gb", type=float, default=4.0, help="MLX buffer cache per run (0 = MLX's default)")
    r.add_argument("--budget-s", type=float, default=540.0, help="start no run that would end after this")
    r.add_argument("--grace-s", type=float, default=30.0, help="then stop runs still going this much later")
    r.add_argument("--first-guess-s", type=float, default=200.0, help="run length assumed before one finished")
    r.add_argument("--png", default=None)
    g = sub.add_parser("report")
    g.add_argument("out")
    g.add_argument("--png", default=None)
    args = p.parse_args()
    if args.command == "run":
        sweep.need_data(r, Path(args.data_dir), args.datasets)
        for item in args.extra:
            need_file(r, item.split("=", 1)[-1], "--extra NAME=FILE")
    {"run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
