"""The LoRA product's dtype on a bfloat16 model: step time, peak memory and gradients.

    python bench/lora_branch.py --model llama3.1-8b --lengths 1024 4096     # GPU
    python bench/lora_branch.py --model smollm2 --layers 2 --lengths 64    # CPU smoke run

A random-weight model of ``--model``'s shape in bfloat16 with LoRA (rank 8, scale 20, every
linear of every layer, non-zero ``lora_b``) runs one pair (prompt = response = L/2 per side)
through the reference engine and the single pass (prefix sharing, one range), once with
``lora.branch_dtype: auto`` (the product ``B A x`` in bfloat16 from float32 factors,
``dtrain.lora.BranchLoRALinear``) and once with ``float32`` (mlx-lm's ``LoRALinear``: the input
promoted to the float32 factors). Per cell: the median ``mx.eval`` time of loss and gradients
over ``--steps`` after one untimed step, peak memory, the loss, and the largest relative L2
difference of a LoRA gradient from the float32 product's. Prints a table, writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import MODELS, build_model, dtrain_engine, make_pairs, write_results  # before MLX
from prelude import RESULTS, add_flags

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.tuner.lora import LoRALinear  # noqa: E402

from dtrain.engine import Totals  # noqa: E402
from dtrain.lora import BranchLoRALinear  # noqa: E402

ENGINES = {"reference": ("reference", {}), "single pass": ("segmented", dict(segment_layers=0, prefix_sharing=True))}


def set_branch(model, branch: str) -> None:
    """Every LoRA layer of ``model`` as ``lora.branch_dtype: branch`` makes it (the same module, its class)."""
    cls = BranchLoRALinear if branch == "auto" else LoRALinear
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.__class__ = cls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=list(MODELS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096], help="P + R per side")
    add_flags(ap, steps=3, layers=None, out=str(RESULTS))
    a = ap.parse_args(argv)
    model = build_model(a.model, a.layers, mx.bfloat16, lora_scale=20.0)
    mx.random.seed(1)
    model.update(tree_map(lambda p: 0.01 * mx.random.normal(p.shape, dtype=p.dtype), model.trainable_parameters()))
    mx.eval(model.parameters())
    rows = []
    for length in a.lengths:
        pairs = make_pairs(1, length, 0.5, model.args.vocab_size)
        totals = Totals(nll_tokens=float(len(pairs[0].prompt) + len(pairs[0].chosen)), pairs=1.0)
        for ename, (kind, keys) in ENGINES.items():
            base = None
            for branch in ("float32", "auto"):
                set_branch(model, branch)
                engine = dtrain_engine(model, kind, **keys)
                mx.reset_peak_memory()
                times = []
                for i in range(a.steps + 1):
                    out = engine.step(pairs, totals)
                    t = time.perf_counter()
                    mx.eval(out.loss, out.grads)
                    if i:
                        times.append(time.perf_counter() - t)
                    else:
                        grads = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(out.grads)}
                        loss = out.loss.item()
                    del out
                base = base or grads
                worst = max(float(np.linalg.norm(grads[k] - base[k]) / np.linalg.norm(base[k])) for k in base)
                rows.append({"length": length, "engine": ename, "branch_dtype": branch, "eval_s": statistics.median(times),
                             "times": times, "peak_gb": mx.get_peak_memory() / 1e9, "loss": loss,
                             "worst_rel_grad_diff": worst})
                print(rows[-1], flush=True)
    print(f"\n{a.model} bfloat16, one pair, LoRA rank 8 on every linear\n")
    print("| L | engine | branch_dtype | eval s (median) | × float32's | peak GB | loss | worst rel. grad diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = next(x for x in rows if x["length"] == r["length"] and x["engine"] == r["engine"])
        print(f"| {r['length']} | {r['engine']} | {r['branch_dtype']} | {r['eval_s']:.3f} | "
              f"{r['eval_s'] / ref['eval_s']:.2f} | {r['peak_gb']:.1f} | {r['loss']:.6f} | {r['worst_rel_grad_diff']:.3g} |")
    path = write_results("lora_branch", {"model": a.model, "layers": a.layers, "rows": rows}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
