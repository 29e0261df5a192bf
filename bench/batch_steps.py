"""Engine step time and peak memory at a real batch's lengths, without the data or the tokenizer.

    python bench/padding.py --spans-out spans.json          # once, where the data and tokenizer are
    python bench/batch_steps.py spans.json --dtype float32 --steps 12 \\
        --variant attention_groups=1 --variant attention_groups=4

Each micro-batch in ``spans.json`` (the ``(P, C, R)`` of its pairs, as the trainer's
sampler cut them) becomes pairs of random token ids of those lengths. A random-weight
model of ``--model``'s shape with LoRA (rank 8, scale 20, every linear of every layer)
runs ``engine.step`` + ``mx.eval`` for each variant: ``--config``'s engine section with
the device's ``auto`` values resolved as a run resolves them (``device.resolve_auto``),
then the variant's ``engine`` keys. The variants alternate (A B, then B A) step by step;
each one's first step (kernel compilation, new shapes) is left out of its times. Peak
memory per variant: the most ``mx.get_peak_memory`` of its steps (reset before each).
``--mfu``: model FLOPs utilisation over the timed steps against a matmul in ``--dtype`` timed
before and after (as bench/mfu.py: N = the layers' base weights + the head), by 6·N·T over the
logical tokens (``2P + C + R`` per pair: the two sequences a preference step scores) and over
the tokens run under prefix sharing (``P + C + R``), and the LoRA-aware 4·N·T over the latter.
Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from common import MODELS, build_model, spread, write_results  # before MLX
from mfu import matmul_gflops, matmul_params
from prelude import RESULTS, ROOT, add_flags

import mlx.core as mx  # noqa: E402

from dtrain.config import load_config  # noqa: E402
from dtrain.device import resolve_auto  # noqa: E402
from dtrain.engine import batch_totals, make_engine, make_objective  # noqa: E402
from dtrain.types import TokenizedPair  # noqa: E402


def variant(text: str) -> dict:
    """``key=value,key=value`` engine keys (YAML values) -> dict."""
    import yaml

    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spans", help="JSON from bench/padding.py --spans-out")
    ap.add_argument("--model", default="smollm2", choices=list(MODELS))
    ap.add_argument("--config", default=str(ROOT / "configs" / "preference.yaml"))
    ap.add_argument("--variant", action="append", type=variant, required=True, metavar="KEY=VALUE[,KEY=VALUE]",
                    help="engine keys of one variant (repeat the flag for each variant)")
    ap.add_argument("--mfu", action="store_true", help="also MFU against a matmul timed before and after")
    ap.add_argument("--matmul-size", type=int, default=0, help="n of the n³ matmul; 0 = 2048 on a CPU, 8192 on a GPU")
    add_flags(ap, steps=12, dtype="float32", layers=None, out=str(RESULTS))
    a = ap.parse_args(argv)

    with open(a.spans) as f:
        batches = json.load(f)["micro_batches"][: a.steps + 1]
    cfg, choices = resolve_auto(load_config(a.config))  # its data section is not read
    size = a.matmul_size or (8192 if mx.default_device() == mx.gpu else 2048)
    before = matmul_gflops(size, getattr(mx, a.dtype), 5) if a.mfu else []
    model = build_model(a.model, a.layers, getattr(mx, a.dtype), lora_scale=20.0)
    vocab = model.args.vocab_size
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    pairs = [[TokenizedPair(ids(P), ids(C), ids(R)) for P, C, R in batch] for batch in batches]
    objective = make_objective(cfg)
    engines = [make_engine(dataclasses.replace(cfg.engine, **v), model, objective) for v in a.variant]
    seconds, peaks, losses = ([[] for _ in engines] for _ in range(3))
    for i, batch in enumerate(pairs):
        totals = batch_totals(batch, objective.nll_scope)
        for j in (range(len(engines)) if i % 2 == 0 else reversed(range(len(engines)))):
            mx.clear_cache()
            mx.reset_peak_memory()
            t = time.perf_counter()
            out = engines[j].step(batch, totals)
            mx.eval(out.loss, out.grads)
            dt = time.perf_counter() - t
            peaks[j].append(mx.get_peak_memory() / 1e9)
            losses[j].append(out.loss.item())
            if i:
                seconds[j].append(dt)
            print(f"step {i} variant {j}: {dt:.3f} s, loss {losses[j][-1]:.6f}", flush=True)
            del out
    mfu = None
    if a.mfu:
        after = matmul_gflops(size, getattr(mx, a.dtype), 5)
        rate = statistics.median(before + after) * 1e9
        N = matmul_params(model)
        logical = sum(2 * P + C + R for b in batches[1:] for P, C, R in b)
        run = sum(P + C + R for b in batches[1:] for P, C, R in b)
        mfu = {"matmul_n": size, "before": spread(before), "after": spread(after), "params": N,
               "logical_tokens": logical, "tokens_run": run}
    pairs_per_step = statistics.mean(len(b) for b in batches[1:]) if len(batches) > 1 else float("nan")
    print(f"\n{a.model} {a.dtype}, {len(batches) - 1} timed micro-batches of ~{pairs_per_step:.1f} pairs; "
          f"auto choices {choices}\n")
    cols = " MFU 6NT logical | MFU 6NT run | 4NT (LoRA) run |" if mfu else ""
    print(f"| variant | s/step median (min–max) | pairs/s (Σ/Σ) | peak GB |{cols}\n|---|---|---|---|"
          + "---|" * (3 if mfu else 0))
    rows, n = [], sum(len(b) for b in batches[1:])  # pairs in the timed steps
    for v, s, p, lo in zip(a.variant, seconds, peaks, losses):
        rows.append({"variant": v, "seconds": s, "peak_gb": max(p), "losses": lo,
                     "pairs_per_s": n / sum(s) if s else None})
        if s and mfu:
            f = {k: c * mfu["params"] * mfu[t] / sum(s) / rate
                 for k, c, t in (("mfu_6nt_logical", 6, "logical_tokens"), ("mfu_6nt_run", 6, "tokens_run"),
                                 ("mfu_4nt_run", 4, "tokens_run"))}
            rows[-1].update(f)
            cols = f" {f['mfu_6nt_logical']:.1%} | {f['mfu_6nt_run']:.1%} | {f['mfu_4nt_run']:.1%} |"
        if s:
            print(f"| {v} | {statistics.median(s):.3f} ({min(s):.3f}–{max(s):.3f}) | {n / sum(s):.1f} | {max(p):.2f} |"
                  + (cols if mfu else ""))
    path = write_results("batch_steps", {"spans": a.spans, "model": a.model, "dtype": a.dtype, "layers": a.layers,
                                         "config": a.config, "auto": choices, "mfu": mfu, "rows": rows}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
