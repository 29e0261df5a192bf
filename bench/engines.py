"""Peak memory and step time: reference engine vs the segmented variants.

    python bench/engines.py --models smollm2 --lengths 512 1024 2048 --steps 2 --warmup 1

For each model, pair shape and length it runs one micro-batch of ``--pairs``
pairs through each engine (reference; segmented; + prefix sharing; + chunked
head) and records the peak memory (``mx.get_peak_memory``, reset between
runs) and the median seconds per step after ``--warmup`` steps. Tokens/s count
the logical two-sequence tokens ``2P + Rc + Rr`` per pair for every engine, so
prefix sharing shows up as a speed-up, compared with its ideal
``(2P + Rc + Rr) / (P + Rc + Rr)``. ``--flat N`` instead runs N steps of the
full stack and checks that active memory stays flat within 2%.

Prints a markdown table and writes JSON to bench/results/. Models have random
weights (``--dtype``, float32 by default) and LoRA rank 8 on every layer; not a test.
"""

from __future__ import annotations

import argparse
import json
import math

from common import DTYPES, MODELS, SHAPES, build_model, dtrain_engine, make_pairs, measure, write_results  # before MLX
from prelude import RESULTS, add_flags

import mlx.core as mx  # noqa: E402

from dtrain.engine import Totals  # noqa: E402


ENGINES = ("reference", "segmented", "+ prefix sharing", "+ chunked head", "one range")  # engines()' keys


def engines(model, segment: int, chunk: int) -> dict:
    seg = lambda **kw: dtrain_engine(model, segment_layers=segment, **kw)  # noqa: E731
    return {
        "reference": lambda: dtrain_engine(model, "reference"),
        "segmented": lambda: seg(prefix_sharing=False),
        "+ prefix sharing": lambda: seg(prefix_sharing=True),
        "+ chunked head": lambda: seg(prefix_sharing=True, head_chunk_tokens=chunk),
        # prefix sharing, one range of all layers, unchunked head: nothing recomputed
        "one range": lambda: dtrain_engine(model, segment_layers=0, prefix_sharing=True),
    }


def flat_check(engine, pairs, norm, steps: int) -> dict:
    """Active memory after each of ``steps`` steps; flat = (max - min) / min <= 2%."""
    active = []
    for _ in range(steps):
        out = engine.step(pairs, norm)
        mx.eval(out.loss, out.grads)
        del out
        active.append(mx.get_active_memory())
    lo, hi = min(active[1:] or active), max(active[1:] or active)
    return {"steps": steps, "active_min_gb": lo / 1e9, "active_max_gb": hi / 1e9,
            "spread": (hi - lo) / lo, "flat": (hi - lo) / lo <= 0.02}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="P + R per side")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--pairs", type=int, default=1, help="pairs per micro-batch")
    add_flags(ap, steps=3, dtype="float32", warmup=1, layers=None,
              help={"dtype": "bfloat16 on a GPU", "layers": "depth of the smollm2 model (default 30)"})
    ap.add_argument("--segment", type=int, default=0, help="layers per range; 0 = round(sqrt(layers))")
    ap.add_argument("--chunk", type=int, default=512, help="head_chunk_tokens of the chunked variant")
    ap.add_argument("--only", nargs="+", default=None, choices=ENGINES, metavar="ENGINE",
                    help=f"engines to run (default: all): {', '.join(ENGINES)}")
    ap.add_argument("--flat", type=int, default=0, help="run N steps of the full stack; check active memory")
    add_flags(ap, out=str(RESULTS))
    a = ap.parse_args(argv)

    rows, flat, failed = [], [], []
    for name in a.models:
        model = build_model(name, a.layers if name == "smollm2" else None, DTYPES[a.dtype])
        n_layers = len(model.layers)
        segment = a.segment or max(1, round(math.sqrt(n_layers)))
        vocab = model.args.vocab_size
        for shape in a.shapes:
            for length in a.lengths:
                pairs = make_pairs(a.pairs, length, SHAPES[shape], vocab)
                P, R = len(pairs[0].prompt), len(pairs[0].chosen)
                norm = Totals(nll_tokens=float(a.pairs * (P + R)), pairs=float(a.pairs))
                logical = a.pairs * (2 * P + 2 * R)
                makers = engines(model, segment, a.chunk)
                if a.flat:
                    flat.append({"model": name, "length": length, "shape": shape,
                                 **flat_check(makers["+ chunked head"](), pairs, norm, a.flat)})
                    print(json.dumps(flat[-1]), flush=True)
                    continue
                for engine_name, make in makers.items():
                    if a.only and engine_name not in a.only:
                        continue
                    try:
                        r = measure(make(), pairs, norm, a.steps, a.warmup)
                    except RuntimeError as err:  # e.g. out of GPU memory: record it, go on
                        failed.append(f"{name} {shape} {length} {engine_name}: {str(err)[:120]}")
                        print(json.dumps({"failed": failed[-1]}), flush=True)
                        mx.clear_cache()
                        continue
                    r.update(model=name, layers=n_layers, segment=segment, shape=shape, length=length, P=P, R=R,
                             engine=engine_name, tokens_per_s=logical / r["s_per_step"],
                             pairs_per_s=a.pairs / r["s_per_step"], ideal_prefix_speedup=(2 * P + 2 * R) / (P + 2 * R))
                    rows.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
        del model
    path = write_results("engines", {"rows": rows, "flat": flat, "failed": failed}, a.out)
    print(table(rows) if rows else "", "\n", "".join(f"\nfailed: {f}" for f in failed), f"\nwrote {path}")
    return 0


def table(rows: list[dict]) -> str:
    """Markdown table; ratios are against the reference (memory, time) and the
    two-sequence segmented engine (prefix speed-up) of the same case."""
    key = lambda r: (r["model"], r["shape"], r["length"])  # noqa: E731
    ref = {key(r): r for r in rows if r["engine"] == "reference"}
    seg = {key(r): r for r in rows if r["engine"] == "segmented"}
    lines = ["| model | shape | P+R | engine | peak GB | peak / ref | s/step | time / ref | tokens/s | pairs/s "
             "| speed-up vs segmented (ideal) |", "|" + "---|" * 11]
    for r in rows:
        k = key(r)
        mem = f"{r['peak_gb'] / ref[k]['peak_gb']:.2f}" if k in ref else "-"
        tim = f"{r['s_per_step'] / ref[k]['s_per_step']:.2f}" if k in ref else "-"
        spd = (f"{seg[k]['s_per_step'] / r['s_per_step']:.2f} ({r['ideal_prefix_speedup']:.2f})"
               if k in seg and r["engine"] in ("+ prefix sharing", "+ chunked head") else "")
        lines.append(f"| {r['model']} ({r['layers']}L/{r['segment']}) | {r['shape']} | {r['length']} | {r['engine']} "
                     f"| {r['peak_gb']:.2f} | {mem} | {r['s_per_step']:.1f} | {tim} | {r['tokens_per_s']:.0f} "
                     f"| {r['pairs_per_s']:.3f} | {spd} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
