"""Where a training step's time goes: host graph building, evaluation, the optimizer.

    python bench/breakdown.py --model smollm2 --dtype float32 --steps 24          # real orca pair lengths
    python bench/breakdown.py --model smollm2 --layers 2 --steps 4 --modes exact  # smoke run on a CPU
    python bench/breakdown.py --model smollm2 --modes bucketed --optimizers eager compiled  # optimizer before/after
    python bench/breakdown.py --model smollm2 --optimizer-only --optimizers eager compiled --steps 20

Random weights of ``--model``'s shape with LoRA rank 8 (scale 20) on every linear
layer; pairs are the first ``--steps`` orca pairs of ``--data`` tokenized with
SmolLM2's tokenizer (``--tokenizer-dir``, else the converted demo model's) and
cut at ``--max-length`` as ``dtrain train`` cuts them. For each engine mode
(``exact``: the single pass with exact shapes, eager; ``bucketed``: lengths
padded to 128-token buckets, eager; ``compiled``: buckets + ``mx.compile``;
``auto``: the default engine) it times, per step:

- ``build``: the host building the lazy graph (``engine.step`` returning);
- ``eval``: ``mx.eval`` of loss and gradients (device work plus per-op
  dispatch, cuDNN/JIT setup of new shapes, allocation);
- ``optimizer``: clipping + AdamW on the LoRA parameters and their ``mx.eval``, as the
  trainer does it (``dtrain.run.optimizer.AdamWStep``; ``--optimizers``: ``eager``, the norm
  read before the update, as the trainer did before, or ``compiled``: one ``mx.compile``d
  function, one evaluation; ``train.compile_optimizer``);

first over ``--repeat`` steps of one pair repeated (one shape, warm), then over
``--steps`` new pairs (one step each, as in training; the first, which builds the
graphs, is reported apart, the other ``--steps`` - 1 timed). Prints a markdown table
and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import BLAS, DTYPES, MODELS, build_model, write_results  # before MLX
from prelude import ORCA, RESULTS, SMOLLM2_F32, add_flags, need_file

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dtrain.config import Config  # noqa: E402
from dtrain.engine import batch_totals, make_engine  # noqa: E402
from dtrain.engine import ORPO  # noqa: E402
from dtrain.run.optimizer import AdamWStep  # noqa: E402

MODES = {"exact": dict(kind="segmented", segment_layers=0, length_bucket=0, compile=False),
         "bucketed": dict(kind="segmented", segment_layers=0, length_bucket=128, compile=False),
         "compiled": dict(kind="segmented", segment_layers=0, length_bucket=128, compile=True),
         "auto": dict(kind="auto")}


def real_pairs(tokenizer_dir: Path, data: str, n: int, max_length: int):
    from mlx_lm.utils import load_tokenizer

    from dtrain.data import load_dataset

    cfg = Config()
    cfg.data.train, cfg.data.valid_fraction, cfg.data.max_length, cfg.data.max_prompt_length = data, 0.0, max_length, max_length
    tok = load_tokenizer(tokenizer_dir, eos_token_ids=[2])
    pairs = load_dataset(cfg.data, tok, 0, log=None).train
    return pairs[:n]


def make_optimizer(kind: str, model) -> AdamWStep:
    """The trainer's optimizer step, ``train.compile_optimizer`` set by ``kind`` (``eager`` or ``compiled``)."""
    cfg = Config()
    cfg.train.learning_rate, cfg.train.compile_optimizer = 1e-5, kind == "compiled"
    return AdamWStep(cfg.train, model.trainable_parameters())


def timed_step(engine, optimizer, model, pairs) -> dict:
    norm = batch_totals(pairs, "full")
    t0 = time.perf_counter()
    out = engine.step(pairs, norm)
    t1 = time.perf_counter()
    mx.eval(out.loss, out.sums, out.grads)
    t2, c2 = time.perf_counter(), time.process_time()
    optimizer.apply(model, out.grads, 1e-5, loss_finite=True)  # as dtrain.run.step.Step (evaluated)
    t3, c3 = time.perf_counter(), time.process_time()
    return {"build": t1 - t0, "eval": t2 - t1, "optimizer": t3 - t2, "total": t3 - t0,
            "optimizer_cpu": c3 - c2,  # CPU seconds of this process (all its threads): host cost on a busy machine
            "shape": list(engine.layout(pairs).shape)}


def optimizer_only(a) -> int:
    """``--optimizer-only``: the optimizer step alone on random LoRA gradients, per ``--optimizers`` kind."""
    from mlx.utils import tree_map

    model = build_model(a.model, a.layers, DTYPES[a.dtype], lora_scale=20.0)
    grads = tree_map(lambda p: 0.1 * mx.random.normal(p.shape).astype(p.dtype), model.trainable_parameters())
    mx.eval(grads)
    print(f"{BLAS.line()}\n{a.model} {a.dtype}, {len(tree_flatten(grads))} LoRA arrays; optimizer step alone, "
          f"{a.steps} steps after the first")
    rows = []
    for kind in a.optimizers:
        optimizer, times = make_optimizer(kind, model), []
        for _ in range(a.steps + 1):
            t, c = time.perf_counter(), time.process_time()
            optimizer.apply(model, grads, 1e-5, loss_finite=True)
            times.append({"wall": time.perf_counter() - t, "cpu": time.process_time() - c})
        rows.append({"optimizer": kind, "first": times[0], "steps": times[1:]})
        print(f"{kind}: first {times[0]['wall']:.3f} s wall ({times[0]['cpu']:.3f} s CPU); then median "
              f"{med(times[1:], 'wall') * 1e3:.1f} ms wall, {med(times[1:], 'cpu') * 1e3:.1f} ms CPU", flush=True)
    print(f"wrote {write_results('breakdown-optimizer', {'model': a.model, 'dtype': a.dtype, 'rows': rows}, a.out)}")
    return 0


def med(rows, key):
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=list(MODELS))
    add_flags(ap, layers=None, dtype="float32", steps=24, help={"steps": "new pairs timed (one step each)"})
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=1024)
    add_flags(ap, data=ORCA)
    ap.add_argument("--tokenizer-dir", type=Path, default=SMOLLM2_F32)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--optimizers", nargs="+", default=["compiled"], choices=["eager", "compiled"])
    add_flags(ap, out=str(RESULTS))
    ap.add_argument("--optimizer-only", action="store_true",
                    help="time only the optimizer step, on random gradients (no data, no engine)")
    a = ap.parse_args(argv)
    if a.optimizer_only:
        return optimizer_only(a)
    need_file(ap, a.data, "--data")
    if not a.tokenizer_dir.is_dir():
        ap.error(f"--tokenizer-dir {a.tokenizer_dir}: no such folder (bench/peer.py converts the demo model there "
                 "once; or pass a folder with SmolLM2's tokenizer files)")
    pairs = real_pairs(a.tokenizer_dir, a.data, a.steps, a.max_length)
    rows = []
    for mode, kind in [(m, k) for m in a.modes for k in a.optimizers]:
        model = build_model(a.model, a.layers, DTYPES[a.dtype], lora_scale=20.0)
        cfg = Config()
        for k, v in MODES[mode].items():
            setattr(cfg.engine, k, v)
        engine = make_engine(cfg.engine, model, ORPO.from_config(cfg))
        optimizer = make_optimizer(kind, model)
        mx.reset_peak_memory()
        first = timed_step(engine, optimizer, model, [pairs[0]])
        same = [timed_step(engine, optimizer, model, [pairs[0]]) for _ in range(a.repeat)]
        new = [timed_step(engine, optimizer, model, [p]) for p in pairs[1:]]
        row = {"mode": f"{mode}, {kind} optimizer", "first": first, "same": same, "new": new, "peak_gb": mx.get_peak_memory() / 1e9,
               "shapes": len({tuple(r["shape"] or ()) for r in new})}
        rows.append(row)
        print({k: (v if not isinstance(v, list) else [round(r["total"], 3) for r in v]) for k, v in row.items()},
              flush=True)
        del engine, optimizer, model
        mx.clear_cache()
    path = write_results("breakdown", {"model": a.model, "dtype": a.dtype, "rows": rows}, a.out)
    print(f"\n{BLAS.line()}\n{a.model} {a.dtype}, {len(pairs) - 1} new pairs, {a.repeat} repeats of pair 0; median seconds per step")
    print("| mode | first step | same pair: build / eval / optimizer / total | new pairs: build / eval / optimizer "
          "/ total | new ÷ same | shapes | peak GB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        s, n = r["same"], r["new"]
        print(f"| {r['mode']} | {r['first']['total']:.2f} | {med(s, 'build'):.3f} / {med(s, 'eval'):.3f} / "
              f"{med(s, 'optimizer'):.3f} / {med(s, 'total'):.3f} | {med(n, 'build'):.3f} / {med(n, 'eval'):.3f} / "
              f"{med(n, 'optimizer'):.3f} / {med(n, 'total'):.3f} | {med(n, 'total') / med(s, 'total'):.2f} "
              f"| {r['shapes']} | {r['peak_gb']:.2f} |")
    print("optimizer CPU seconds of the process, median same pair / new pairs: "
          + "; ".join(f"{r['mode']} {med(r['same'], 'optimizer_cpu'):.3f} / {med(r['new'], 'optimizer_cpu'):.3f}"
                      for r in rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
