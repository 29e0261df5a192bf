"""Model FLOPs utilisation of a training step against a matmul measured in the same run.

    python bench/mfu.py --models smollm2 --lengths 512 1024                 # CPU, float32
    python bench/mfu.py --models llama3.2-1b llama3.1-8b --dtype bfloat16 \\
        --lengths 1024 4096 8192 --steps 3 --warmup 1                       # GPU (MLX CUDA/Metal)

For each model (random weights, LoRA rank 8 scale 20 on every linear layer of
every layer), length ``L`` (one pair, prompt = response = L/2 tokens per side)
and engine (``reference``; ``segmented`` = ranges of ~sqrt(layers) + prefix
sharing + chunked head), it times ``engine.step`` (loss and LoRA gradients,
no optimizer) and divides the model FLOPs of the step by that time and by the
rate of a ``--matmul-size``³ matmul in ``--dtype``, measured before and after
the model runs (median of both sets).

FLOPs per step, with N the parameters that take part in matmuls (the decoder
layers' base weights plus the ``V × D`` head; the embedding lookup is not a
matmul, so a tied model's N is its parameter count) and T the tokens the
engine runs (``2L`` for the reference engine; ``P + 2R`` under prefix sharing):

- ``6NT`` (headline, the issue's count): forward 2NT + backward 4NT.
- ``+ 2NT`` recompute, for the segmented engine (the forward it repeats).
- ``4NT``: what a LoRA step does need (the frozen base has no weight gradient).
- attention scores (``~4 · layers · L · D`` per token forward) are not counted.

Prints a markdown table and writes JSON to bench/results/. Nothing here needs
a CPU: memory is ``mx.get_peak_memory``, the device is MLX's default.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from common import DTYPES, MODELS, build_model, dtrain_engine, make_pairs, measure, spread, write_results  # before MLX
from prelude import RESULTS, add_flags

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dtrain.engine import Totals  # noqa: E402


def matmul_gflops(n: int, dtype, reps: int) -> list[float]:
    """GFLOP/s of ``reps`` timed ``(n, n) @ (n, n)`` products (2n³ FLOPs each), after one warm-up."""
    a = mx.random.normal((n, n)).astype(dtype)
    b = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b, a @ b)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(a @ b)
        rates.append(2 * n**3 / (time.perf_counter() - t) / 1e9)
    return rates


def matmul_params(model) -> int:
    """Base weights of the decoder layers (LoRA factors excluded) plus the ``V × D`` head."""
    layers = sum(v.size for k, v in tree_flatten([layer.parameters() for layer in model.layers]) if "lora_" not in k)
    return layers + model.args.vocab_size * model.args.hidden_size


def make_engine(kind: str, model, segment: int, chunk: int):
    if kind == "reference":
        return dtrain_engine(model, "reference")
    if kind == "one-range":  # prefix sharing, one range, whole head: one pass, no recompute
        return dtrain_engine(model, segment_layers=0, prefix_sharing=True)
    return dtrain_engine(model, segment_layers=segment, prefix_sharing=True, head_chunk_tokens=chunk)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2"], choices=list(MODELS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024], help="P + R per side")
    add_flags(ap, dtype="float32")
    ap.add_argument("--engines", nargs="+", default=["reference", "segmented"], choices=["reference", "segmented", "one-range"])
    ap.add_argument("--pairs", type=int, default=1, help="pairs per step (one micro-batch)")
    add_flags(ap, steps=1, warmup=0, layers=None)
    ap.add_argument("--segment", type=int, default=0, help="layers per range; 0 = round(sqrt(layers))")
    ap.add_argument("--chunk", type=int, default=512, help="head_chunk_tokens of the segmented engine")
    ap.add_argument("--matmul-size", type=int, default=0, help="n of the n³ matmul; 0 = 2048 on a CPU, 8192 on a GPU")
    ap.add_argument("--matmul-reps", type=int, default=5)
    add_flags(ap, out=str(RESULTS))
    ap.add_argument("--table", metavar="JSON", help="print the table of an earlier results file and exit")
    a = ap.parse_args(argv)
    if a.table:
        saved = json.loads(Path(a.table).read_text())
        print(table(saved["rows"], saved["matmul"]))
        return 0
    dtype = DTYPES[a.dtype]
    n = a.matmul_size or (8192 if mx.default_device() == mx.gpu else 2048)

    before = matmul_gflops(n, dtype, a.matmul_reps)
    print(json.dumps({"matmul": n, "dtype": a.dtype, "gflops_before": before}), flush=True)
    rows = []
    for name in a.models:
        model = build_model(name, a.layers, dtype, lora_scale=20.0)
        n_layers = len(model.layers)
        segment = a.segment or max(1, round(math.sqrt(n_layers)))
        N = matmul_params(model)
        for length in a.lengths:
            pairs = make_pairs(a.pairs, length, 0.5, model.args.vocab_size)
            P, R = len(pairs[0].prompt), len(pairs[0].chosen)
            norm = Totals(nll_tokens=float(a.pairs * (P + R)), pairs=float(a.pairs))
            for kind in a.engines:
                try:
                    r = measure(make_engine(kind, model, segment, a.chunk), pairs, norm, a.steps, a.warmup)
                except RuntimeError as err:  # e.g. out of GPU memory: report it, go on
                    print(json.dumps({"failed": f"{name} {length} {kind}: {str(err)[:120]}"}), flush=True)
                    mx.clear_cache()
                    continue
                T = a.pairs * (2 * (P + R) if kind == "reference" else P + 2 * R)
                recompute = 2 * N * T if kind == "segmented" else 0
                r.update(model=name, layers=n_layers, segment=segment if kind == "segmented" else None, engine=kind,
                         length=length, dtype=a.dtype, params=N, tokens=T, logical_tokens=a.pairs * 2 * (P + R),
                         pairs=a.pairs,
                         flops_6nt=6 * N * T, flops_recompute=recompute, flops_4nt=4 * N * T)
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
        del model
    after = matmul_gflops(n, dtype, a.matmul_reps)
    peak = statistics.median(before + after)
    for r in rows:
        s = r["s_per_step"] * 1e9
        r.update(matmul_gflops=peak, achieved_gflops_6nt=r["flops_6nt"] / s,
                 mfu_6nt=r["flops_6nt"] / s / peak, hfu_with_recompute=(r["flops_6nt"] + r["flops_recompute"]) / s / peak,
                 mfu_4nt_lora=r["flops_4nt"] / s / peak,
                 mfu_6nt_logical=6 * r["params"] * r["logical_tokens"] / s / peak)
    matmul = {"n": n, "dtype": a.dtype, "before": spread(before), "after": spread(after), "used_gflops": peak}
    path = write_results("mfu", {"matmul": matmul, "rows": rows}, a.out)
    print(table(rows, matmul), "\n", f"wrote {path}")
    return 0


def table(rows: list[dict], matmul: dict) -> str:
    b, f = matmul["before"], matmul["after"]
    head = (f"{matmul['n']}³ {matmul['dtype']} matmul: before {b['median']:.1f} GFLOP/s ({b['min']:.1f}–{b['max']:.1f}), "
            f"after {f['median']:.1f} ({f['min']:.1f}–{f['max']:.1f}); MFU uses the median of both, "
            f"{matmul['used_gflops']:.1f}\n\n")
    fastest = max(b["max"], f["max"])  # the least loaded moment of a shared machine
    lines = ["| model | engine | L | N (M) | T | s/step | GFLOP/s (6NT) | MFU 6NT | MFU 6NT vs fastest matmul | + recompute "
             "| 4NT (LoRA) | 6NT on 2L tokens | peak GB |", "|" + "---|" * 13]
    for r in rows:
        eng = r["engine"] + (f" ({r['segment']}-layer ranges)" if r["segment"] else "") + (
            f", {r['pairs']} pairs" if r.get("pairs", 1) > 1 else "")
        rec = f"{r['hfu_with_recompute']:.1%}" if r["flops_recompute"] else "-"
        lines.append(f"| {r['model']} ({r['layers']}L) | {eng} | {r['length']} | {r['params'] / 1e6:.0f} | {r['tokens']} "
                     f"| {r['s_per_step']:.2f} | {r['achieved_gflops_6nt']:.1f} | {r['mfu_6nt']:.1%} "
                     f"| {r['achieved_gflops_6nt'] / fastest:.1%} | {rec} "
                     f"| {r['mfu_4nt_lora']:.1%} | {r['mfu_6nt_logical']:.1%} | {r['peak_gb']:.2f} |")
    return head + "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
