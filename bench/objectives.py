"""Each objective on the same pairs and budget, with a held-out split: issue 24's GPU comparison.

    python bench/objectives.py split OUT                      # the held-out split (CPU is enough)
    python bench/objectives.py run OUT [--kinds orpo dpo simpo sft dpo-lr5e-5] [--trl-python python3 \\
        --trl-model SmolLM2-135M-Instruct.Q4_1.gguf] [--trl-kinds dpo dpo-lr5e-5]
    python bench/objectives.py report OUT                     # the markdown tables again

``split`` tokenizes ``$DTRAIN_DATA_DIR/orca_dpo_pairs_validation.jsonl`` with
the model's tokenizer (dtrain's loader, nothing cut), keeps the pairs whose
prompt fits 512 tokens and each side 1,024 (so no tool cuts or drops a pair:
TRL's DPO and ORPO have no prompt limit) and holds out 20% of them at random
(seed 0): ``OUT/data/train.jsonl`` and ``OUT/data/valid.jsonl``, read by
every run.

``run`` trains, one ``dtrain train`` process after another, each kind from its
shipped config as it is (``configs/preference.yaml`` for orpo and simpo with
``objective.kind: simpo`` and its defaults, ``configs/dpo.yaml``,
``configs/sft.yaml``; ``dpo-lrX``: dpo.yaml at learning rate X), with only the
model's dtype (``--dtype``, float32 by default, the peer's), the data files,
the seed and the output folder changed: 100 steps of 8 pairs. Then every
adapter is evaluated on the held-out pairs with one yardstick, ORPO's
held-out metrics (a run from ``configs/preference.yaml`` with
``train.init_adapter`` = that adapter, read at its step-0 evaluation): reward
accuracy = the share of pairs whose chosen response has the higher mean
log-prob per token, ``logps/chosen`` (mean per token) and the NLL of the
chosen responses; the base is the ORPO run's own step 0. Each kind's own
held-out metrics (TRL's names; DPO's are summed log-probs against the
reference) are reported beside them.

pairs/s = 800 pairs ÷ (Σ ``perf/step_seconds`` + the DPO reference pass's
seconds, timed around ``dtrain.run.trainer.reference_pass``); evaluation and
loading are left out. Peak memory: the largest ``peak_memory_gb`` logged.
With ``--trl-python``, TRL's ``DPOTrainer`` (``bench/trl_peer.py --mode dpo``:
``precompute_ref_log_probs``, the same LoRA, batch, β, cosine schedule with
10 warm-up steps, float32 with TF32 off) trains the same files and is
evaluated on the same held-out pairs at the same steps; its pairs/s counts
its reference pass the same way. ``run`` skips what finished (re-run it to
continue) and writes ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import yaml

from prelude import ORCA, ROOT, need_file, runs_of, write_results

DATA = Path(ORCA)
MAX_LENGTH, MAX_PROMPT = 1024, 512
CONFIGS = {"orpo": "preference", "simpo": "preference", "dpo": "dpo", "sft": "sft"}  # kind -> its configs/*.yaml
KEYS = ("eval/rewards/accuracies", "eval/rewards/margins", "eval/logps/chosen", "eval/logps/rejected",
        "eval/nll_loss", "eval/loss")


def split(out: Path, data: Path, model: str, valid_fraction: float = 0.2, seed: int = 0) -> dict:
    """Write OUT/data/{train,valid}.jsonl (pairs no tool cuts) once; returns the split's record."""
    d = out / "data"
    if (d / "split.json").is_file():
        return json.loads((d / "split.json").read_text())
    from dataclasses import replace

    from dtrain.config import Config
    from dtrain.data import load_dataset
    from dtrain.models import load_model

    tok = load_model(model, "float32").tokenizer
    big = 1 << 20
    cfg = replace(Config().data, train=str(data), valid=None, valid_fraction=0.0, max_length=big,
                  max_prompt_length=big)
    pairs = load_dataset(cfg, tok, seed, log=None).train
    lines = [line for line in data.read_text(encoding="utf-8").splitlines()]
    keep = sorted(int(p.source.rsplit(":", 1)[1]) for p in pairs
                  if len(p.prompt) <= MAX_PROMPT and len(p.prompt) + max(len(p.chosen), len(p.rejected)) <= MAX_LENGTH)
    random.Random(seed).shuffle(keep)
    n_valid = round(valid_fraction * len(keep))
    valid, train = sorted(keep[:n_valid]), sorted(keep[n_valid:])
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.jsonl").write_text("".join(lines[i - 1] + "\n" for i in train))
    (d / "valid.jsonl").write_text("".join(lines[i - 1] + "\n" for i in valid))
    rec = {"source": str(data), "rows": len([x for x in lines if x.strip()]), "tokenized": len(pairs),
           "kept": len(keep), "train": len(train), "valid": len(valid), "valid_lines": valid, "seed": seed}
    (d / "split.json").write_text(json.dumps(rec))
    return rec


def kind_config(kind: str, out: Path, args) -> dict:
    """The shipped config of ``kind`` with the data, dtype, seed and folder of this comparison."""
    base, _, lr = kind.partition("-lr")
    src = CONFIGS[base]
    cfg = yaml.safe_load((ROOT / "configs" / f"{src}.yaml").read_text())
    if base == "simpo":  # preference.yaml's ORPO-only keys go: the λ controller and a log-odds keep_best
        cfg.pop("orpo", None)
        cfg["objective"] = {"kind": "simpo"}
        cfg["train"].update(keep_best=None, keep_best_guard=None)
    cfg["model"] = dict(cfg.get("model", {}), path=args.model, dtype=args.dtype)
    if getattr(args, "budget", 0):
        cfg["engine"] = dict(cfg.get("engine") or {}, memory_budget_gb=args.budget)
    cfg["data"] = dict(cfg["data"], train=str(out / "data" / "train.jsonl"), valid=str(out / "data" / "valid.jsonl"),
                       valid_fraction=0.0, max_length=MAX_LENGTH, max_prompt_length=MAX_PROMPT)
    cfg["train"].update(seed=0, eval_pairs=0, progress=False, output_dir=str(out / "runs" / kind))
    if lr:
        cfg["train"]["learning_rate"] = float(lr)
    if getattr(args, "steps", 0):  # smoke runs
        cfg["train"].update(steps=args.steps, eval_every=args.steps, warmup_steps=0)
    return cfg


def kind_name(text: str) -> str:
    """``--kinds``' type: a key of CONFIGS, or KIND-lrX with X a number."""
    base, sep, lr = text.partition("-lr")
    try:
        ok = base in CONFIGS and (not sep or float(lr) > 0)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"'{text}' is not {', '.join(CONFIGS)} or KIND-lrX (X a learning rate)")
    return text


def yard_config(kind: str, out: Path, args) -> dict:
    """configs/preference.yaml (ORPO) from ``kind``'s adapter: its step-0 evaluation is the yardstick."""
    cfg = kind_config("orpo", out, args)
    cfg["orpo"]["lambda_schedule"] = "static"  # the yardstick is the step-0 evaluation: fixed λ, the last step
    cfg["train"].update(init_adapter=str(out / "runs" / kind / "adapters"), steps=1, warmup_steps=0, eval_every=1,
                        keep_best=None, keep_best_guard=None, output_dir=str(out / "yard" / kind))
    return cfg


def train(config: str, record: str) -> int:
    """``dtrain train -c CONFIG`` in this process, DPO's reference pass timed into RECORD."""
    from dtrain.blas import setup

    setup()  # before MLX, as `dtrain train` does
    import mlx.core as mx

    import dtrain.run.trainer as trainer
    from dtrain.cli import main as dtrain_main

    inner, spent = trainer.reference_pass, []

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            mx.synchronize()
            spent.append(time.perf_counter() - t)

    trainer.reference_pass = timed
    try:
        return dtrain_main(["train", "-c", config])
    finally:
        Path(record).write_text(json.dumps({"reference_s": sum(spent)}))


def scalars_of(run_dir: Path) -> dict:
    from dtrain.run.tracking import read_scalars

    tb = sorted((run_dir / "tb").glob("*"))
    return read_scalars(tb[-1]) if tb else {}


def run_one(name: str, cfg: dict, where: Path, env: dict) -> dict:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t = time.perf_counter()
    with open(where / "log.txt", "w") as log:
        rc = subprocess.run([sys.executable, __file__, "train", str(where / "config.yaml"), str(where / "record.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t
    rec = {"name": name, "returncode": rc, "wall_s": wall, "config": cfg}
    rec.update(json.loads((where / "record.json").read_text()) if (where / "record.json").is_file() else {})
    s = scalars_of(Path(cfg["train"]["output_dir"]))
    rec["eval"] = {k: {str(st): v for st, v in s.get(k, [])} for k in KEYS if k in s}
    steps = [v for _, v in s.get("perf/step_seconds", [])]
    rec["steps"], rec["train_s"] = len(steps), sum(steps)
    rec["peak_gb"] = max((v for _, v in s.get("peak_memory_gb", [])), default=None)
    rec["log_tail"] = (where / "log.txt").read_text(errors="replace").strip().splitlines()[-4:]
    print(f"{name}: rc {rc}, {wall:.0f} s, {rec['steps']} steps, train {rec['train_s']:.1f} s, "
          f"reference {rec.get('reference_s', 0):.1f} s, peak {rec['peak_gb']}", flush=True)
    return rec


def run_trl(kind: str, out: Path, args) -> dict:
    cfg = kind_config(kind, out, args)
    t = cfg["train"]
    o = cfg.get("objective", {})
    cmd = [args.trl_python, str(ROOT / "bench" / "trl_peer.py"), "--mode", "dpo", "--data", cfg["data"]["train"],
           "--valid", cfg["data"]["valid"], "--model", args.trl_model, "--max-length", str(MAX_LENGTH),
           "--max-prompt-length", str(MAX_PROMPT), "--lora-rank", str(cfg["lora"]["rank"]),
           "--lora-alpha", str(cfg["lora"]["scale"] * cfg["lora"]["rank"]), "--batch", str(t["global_batch_pairs"]),
           "--steps", str(t["steps"]), "--dtype", args.dtype, "--lr", str(t["learning_rate"]),
           "--beta", str(o.get("beta") or 0.1), "--loss-type", o.get("loss_type", "sigmoid"), "--schedule", "cosine",
           "--warmup-steps", str(t.get("warmup_steps", 10)), "--min-lr-ratio", "0.1", "--eval-every",
           str(t["eval_every"]), "--skip-first", "0", "--out-dir", str(out / "trl" / kind)]
    (out / "trl").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / "trl" / f"{kind}.log").write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith('{"trl": ')]
    rec = {"name": f"trl {kind}", "returncode": proc.returncode, "wall_s": wall, "cmd": cmd}
    if lines:
        r = json.loads(lines[-1])["trl"]
        rec.update(train_s=r["train_s"], reference_s=r["reference_s"], steps=len(r["steps"]), peak_gb=r["peak_gb"],
                   trl=r, eval={k: {st: m.get(k.replace("eval/", "eval_")) for st, m in r["evals"].items()}
                                for k in KEYS})
    else:
        rec["log_tail"] = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    print(f"trl {kind}: rc {proc.returncode}, {wall:.0f} s", flush=True)
    return rec


def run(args) -> None:
    out = Path(args.out).resolve()
    print(json.dumps({k: v for k, v in split(out, Path(args.data), args.model).items() if k != "valid_lines"}), flush=True)
    path = out / "results.json"
    results = runs_of(json.loads(path.read_text())) if path.is_file() else {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    jobs = [(k, "train") for k in args.kinds] + [(k, "yard") for k in args.kinds if k.split("-")[0] != "orpo"]
    jobs += [(k, "trl") for k in (args.trl_kinds if args.trl_python else [])]
    for kind, what in jobs:
        key = f"{what}/{kind}"
        if key in results and results[key]["returncode"] == 0:
            continue
        if what == "train":
            results[key] = run_one(key, kind_config(kind, out, args), out / "runs" / f"{kind}-meta", env)
        elif what == "yard":
            if results.get(f"train/{kind}", {}).get("returncode") != 0:
                continue
            results[key] = run_one(key, yard_config(kind, out, args), out / "yard" / f"{kind}-meta", env)
        else:
            results[key] = run_trl(kind, out, args)
        write_results("results", results, out, stamp=False)
    report(args)


def _at(rec: dict, key: str, step) -> float | None:
    return (rec or {}).get("eval", {}).get(key, {}).get(str(step))


def fmt(x, spec=".3f", signed=False) -> str:
    return "–" if x is None else f"{x:{'+' if signed else ''}{spec}}"


def report(args) -> None:
    out = Path(args.out)
    results = runs_of(json.loads((out / "results.json").read_text()))
    split_rec = json.loads((out / "data" / "split.json").read_text())
    base = results.get("train/orpo")
    print(f"{split_rec['train']} training pairs, {split_rec['valid']} held out ({split_rec['kept']} of "
          f"{split_rec['rows']} orca rows fit 512 prompt / 1,024 tokens per side).\n")
    acc, chosen, nll = "eval/rewards/accuracies", "eval/logps/chosen", "eval/nll_loss"
    b_acc, b_ch, b_nll = _at(base, acc, 0), _at(base, chosen, 0), _at(base, nll, 0)
    print(f"Yardstick (ORPO's held-out metrics, mean log-prob per token): base accuracy {fmt(b_acc)}, "
          f"logps/chosen {fmt(b_ch)}, NLL {fmt(b_nll)}.\n")
    print("| kind | learning rate | yardstick accuracy | yardstick Δ logps/chosen vs base | yardstick NLL "
          "| own held-out accuracy (step 0 → end) | own held-out logps/chosen (step 0 → end) | train s "
          "| reference pass s | pairs/s | peak GB |")
    print("|" + "---|" * 11)
    for key, rec in results.items():
        what, kind = key.split("/", 1)
        if what == "yard":
            continue
        tool = "dtrain" if what == "train" else "TRL DPOTrainer"
        if rec.get("returncode") != 0 or not rec.get("steps"):
            print(f"| {kind} ({tool}) | failed: {' / '.join(rec.get('log_tail', []))[-300:]} |" + " |" * 9)
            continue
        last = rec["steps"]
        if tool == "dtrain":
            is_orpo = kind.split("-")[0] == "orpo"
            yard, ystep = (base, last) if is_orpo else (results.get(f"yard/{kind}"), 0)
            y = (_at(yard, acc, ystep), _at(yard, chosen, ystep), _at(yard, nll, ystep))
            lr = rec["config"]["train"]["learning_rate"]
        else:
            y, lr = (None, None, None), float(rec["cmd"][rec["cmd"].index("--lr") + 1])
        pps = 8 * rec["steps"] / (rec["train_s"] + (rec.get("reference_s") or 0.0))
        print(f"| {kind} ({tool}) | {lr:g} | {fmt(y[0])} | {fmt(None if y[1] is None or b_ch is None else y[1] - b_ch, signed=True)} "
              f"| {fmt(y[2])} | {fmt(_at(rec, acc, 0))} → {fmt(_at(rec, acc, last))} "
              f"| {fmt(_at(rec, chosen, 0), '.2f')} → {fmt(_at(rec, chosen, last), '.2f')} "
              f"| {fmt(rec.get('train_s'), '.1f')} | {fmt(rec.get('reference_s'), '.1f')} | {fmt(pps, '.1f')} "
              f"| {fmt(rec.get('peak_gb'), '.2f')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    r = sub.add_parser("run")
    p = sub.add_parser("report")
    t = sub.add_parser("train", help=argparse.SUPPRESS)
    t.add_argument("config")
    t.add_argument("record")
    for x in (s, r, p):
        x.add_argument("out")
        x.add_argument("--data", default=str(DATA))
        x.add_argument("--model", default="demo", help="model.path of every run (demo = SmolLM2-135M-Instruct)")
        x.add_argument("--dtype", default="float32")
        x.add_argument("--budget", type=float, default=0.0,
                       help="dtrain's engine.memory_budget_gb in every run (0 = the config's, its device default)")
    r.add_argument("--kinds", nargs="+", type=kind_name, default=["orpo", "dpo", "simpo", "sft"],
                   help="orpo, dpo, simpo, sft; KIND-lrX: that kind at learning rate X")
    r.add_argument("--steps", type=int, default=0, help="steps of every run (0 = the config's; smoke runs)")
    r.add_argument("--trl-python", default="", help="a python with torch, peft, datasets and TRL 1.16")
    r.add_argument("--trl-model", default=None, help="TRL's model: an HF folder or a .gguf file")
    r.add_argument("--trl-kinds", nargs="+", default=["dpo"], help="dpo kinds TRL's DPOTrainer runs too")
    a = ap.parse_args()
    if a.cmd == "train":
        raise SystemExit(train(a.config, a.record))
    if a.cmd != "report" and not (Path(a.out) / "data" / "split.json").is_file():  # split once, then its files
        need_file(ap, a.data, "--data")
    if a.cmd == "split":
        print(json.dumps(split(Path(a.out).resolve(), Path(a.data), a.model)))
    elif a.cmd == "run":
        if a.trl_python and not a.trl_model:
            ap.error("--trl-python needs --trl-model")
        run(a)
    else:
        report(a)


if __name__ == "__main__":
    main()
