"""Step time when every step repeats the same pair vs when each step brings a new pair.

    python bench/repeat.py --model llama3.2-1b --length 4096 --dtype bfloat16   # on a GPU
    python bench/repeat.py --model smollm2 --layers 2 --length 64               # smoke run on a CPU

``bench/engines.py`` and ``bench/mfu.py`` time one pair repeated; a training run
sees a new pair every step. For each engine (the single pass: prefix sharing,
one range, whole head; and the reference engine) this times ``engine.step``
(loss and LoRA gradients evaluated) for ``--steps`` steps in three modes:
``same`` (the same pair each step), ``new-lengths`` (each step's pair is 4
tokens longer per side than the last: 2 in the prompt, 2 in each response) and ``new-tokens`` (the same lengths,
other random token ids). Prints a markdown table (median and all times) and
writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import DTYPES, MODELS, build_model, dtrain_engine, make_pairs, write_results  # before MLX
from prelude import RESULTS, add_flags

import mlx.core as mx  # noqa: E402

from dtrain.engine import Totals  # noqa: E402

MODES = ("same", "new-lengths", "new-tokens")


def pair_for(mode: str, i: int, length: int, vocab: int):
    if mode == "same":
        return make_pairs(1, length, 0.5, vocab)
    if mode == "new-lengths":
        return make_pairs(1, length + 4 * (i + 1), 0.5, vocab)
    return make_pairs(1, length, 0.5, vocab, seed=i + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.2-1b", choices=list(MODELS))
    add_flags(ap, layers=None)
    ap.add_argument("--length", type=int, default=4096, help="P + R per side")
    add_flags(ap, dtype="float32", steps=6, out=str(RESULTS), help={"steps": "timed steps per mode (after one warm-up step)"})
    a = ap.parse_args(argv)
    model = build_model(a.model, a.layers, DTYPES[a.dtype], lora_scale=20.0)
    vocab = model.args.vocab_size
    engines = {"single pass": dtrain_engine(model, segment_layers=0, prefix_sharing=True),
               "reference": dtrain_engine(model, "reference")}
    rows = []
    for name, engine in engines.items():
        for mode in MODES:
            times = []
            for i in range(a.steps + 1):
                pairs = pair_for(mode, i, a.length, vocab)
                P, R = len(pairs[0].prompt), len(pairs[0].chosen)
                t = time.perf_counter()
                out = engine.step(pairs, Totals(nll_tokens=float(P + R), pairs=1.0))
                mx.eval(out.loss, out.grads)
                times.append(time.perf_counter() - t)
                del out
            rows.append({"engine": name, "mode": mode, "warmup_s": times[0], "times": times[1:],
                         "median_s": statistics.median(times[1:])})
            print(rows[-1], flush=True)
    path = write_results("repeat", {"model": a.model, "length": a.length, "dtype": a.dtype, "rows": rows}, a.out)
    same = {r["engine"]: r["median_s"] for r in rows if r["mode"] == "same"}
    print("| engine | mode | median s/step | ÷ same | steps (s) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['mode']} | {r['median_s']:.3f} | {r['median_s'] / same[r['engine']]:.2f} "
              f"| {', '.join(f'{t:.2f}' for t in r['times'])} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
