"""Padding of the engine's layouts on real pairs at the recommended batch: no training.

    python bench/padding.py                                   # orca pairs from $DTRAIN_DATA_DIR, one pass
    python bench/padding.py --data pairs.jsonl --passes 3
    python bench/padding.py --time 3 --set train.micro_batch_pairs=2 data.max_length=256 data.max_prompt_length=128
    python bench/padding.py --spans-out spans.json            # the micro-batches' lengths for bench/batch_steps.py

Tokenizes ``--data`` with the demo model's tokenizer under ``--config``'s data
settings (default configs/preference.yaml: 1,024 tokens per side, 512 per
prompt), takes the steps the trainer's sampler gives (``train.global_batch_pairs``
per step, ``train.micro_batch_pairs`` per micro-batch, seed 0) and builds each
micro-batch's layout as the segmented engine would, for prefix sharing on and
off, exact shapes (the CPU's ``length_bucket``) and buckets of 128 (a GPU's),
padded to the longest sequence (before issue 26) and packed into one row.

Per variant: ``padding_fraction`` = 1 - real tokens / tokens computed (what
``perf/padding_fraction`` logs, ``dtrain.run.step.padding_fraction``), over all
steps (Σ / Σ) and the worst step; the distinct layout shapes (what a compiled
step traces); and the padding of the prefix-sharing attention rows (the query
slots whose outputs are read over the query slots of the grouped calls,
``engine.group_rows``: attention work only, not in padding_fraction), the
attention work of those calls (Σ rows x (length² - first query²)) over that of
one call padding every row to the longest with every query computed (before
the grouping), and the distinct (rows, length, first query) call shapes.

``--time N`` also times the first N steps on the CPU: the demo model (float32)
with LoRA as ``--config`` sets it (``--time-layers K``: a random-weight model of
SmolLM2's shape cut to K decoder layers, LoRA rank 8 scale 20, for a machine
without the memory or time for the whole model), ``--config``'s engine with ``pack`` off and
on (prefix sharing, exact shapes), each step's ``engine.step`` + ``mx.eval``
over its micro-batches, the two variants in alternating order (A B, then B A)
after one untimed warm-up step each; the losses of the two are compared.
Prints a markdown table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from common import write_results  # before MLX
from prelude import ORCA, RESULTS, ROOT, add_flags, need_file

from dtrain.config import load_config  # noqa: E402
from dtrain.engine import batch_totals, bucket_length, group_rows, make_engine, make_objective  # noqa: E402
from dtrain.sampler import Sampler  # noqa: E402


def measure(cfg, model, chunks_per_step: list, prefix: bool, bucket: int, pack: bool, groups: int) -> dict:
    """Padding and shapes of every micro-batch's layout (``engine.layout``), summed per step;
    the attention rows in at most ``groups`` calls (``engine.group_rows``)."""
    engine = make_engine(dataclasses.replace(cfg.engine, kind="segmented", prefix_sharing=prefix,
                                             length_bucket=bucket, pack=pack), model, make_objective(cfg), None)
    real = computed = att_real = att_computed = work_one = work_grouped = 0
    per_step, shapes, att_shapes = [], set(), set()
    for chunks in chunks_per_step:
        step_real = step_computed = 0
        for chunk in chunks:
            layout = engine.layout(chunk)
            shapes.add((layout.shape, int(layout.targets.shape[0])))
            step_real, step_computed = step_real + layout.input_tokens, step_computed + layout.computed_tokens
            if layout.block_sparse or layout.packed:  # attention by gathered rows: [prompt; chosen], [prompt; rejected]
                rows = [n for P, C, R in layout.spans for n in ((P + C, P + R) if R else (P + C,))]
                needs = [q for P, C, R in layout.spans for q in ((0, P) if R else (0,))]  # [P; R]: queries from P on
                calls = [(width, M, q0) for _, width, M, q0 in group_rows(rows, bucket, groups, needs)]
                att_real += sum(rows) - sum(needs)  # the query slots whose outputs are read
                att_computed += sum(width * (M - q0) for width, M, q0 in calls)
                work_one += len(rows) * bucket_length(max(rows), bucket) ** 2  # one call, every row padded to the longest
                work_grouped += sum(width * (M**2 - q0**2) for width, M, q0 in calls)
                att_shapes.update(calls)
        per_step.append(1 - step_real / step_computed)
        real, computed = real + step_real, computed + step_computed
    return {"prefix_sharing": prefix, "bucket": bucket, "pack": pack, "steps": len(per_step),
            "real_tokens": real, "computed_tokens": computed, "padding_fraction": 1 - real / computed,
            "worst_step": max(per_step), "mean_step": sum(per_step) / len(per_step), "shapes": len(shapes),
            "attention_padding": 1 - att_real / att_computed if att_computed else None,
            "attention_work_vs_one_call": work_grouped / work_one if work_one else None,
            "attention_shapes": len(att_shapes)}


def time_steps(cfg, model, chunks_per_step: list) -> dict:
    """Seconds of ``engine.step`` + ``mx.eval`` per step for ``pack`` off and on (see module doc)."""
    import time

    import mlx.core as mx

    objective = make_objective(cfg)
    engines = {pack: make_engine(dataclasses.replace(cfg.engine, pack=pack, length_bucket=0), model, objective, None)
               for pack in (False, True)}
    out = {pack: {"seconds": [], "loss": []} for pack in engines}
    for i, chunks in enumerate(chunks_per_step):
        totals = batch_totals([p for c in chunks for p in c], objective.nll_scope)
        for pack in ((False, True) if i % 2 == 0 else (True, False)):
            t = time.perf_counter()
            loss = 0.0
            for chunk in chunks:
                r = engines[pack].step(chunk, totals)
                mx.eval(r.loss, r.grads)
                loss += r.loss.item()
            seconds = time.perf_counter() - t
            print(f"step {i} ({'warm-up' if i == 0 else 'timed'}), {'packed' if pack else 'padded'}: {seconds:.1f} s, "
                  f"loss {loss:.5f}", file=sys.stderr, flush=True)
            if i > 0:  # step 0 is the warm-up
                out[pack]["seconds"].append(seconds)
                out[pack]["loss"].append(loss)
    return {("packed" if pack else "padded"): v for pack, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flags(ap, data=ORCA)
    ap.add_argument("--config", default=str(ROOT / "configs" / "preference.yaml"))
    ap.add_argument("--passes", type=int, default=1, help="passes over the pairs (steps = passes * pairs / batch)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. train.micro_batch_pairs=2 data.max_length=256 (a CPU's memory)")
    ap.add_argument("--time", type=int, default=0, help="also time the first N steps (+ 1 warm-up), pack off vs on")
    ap.add_argument("--spans-out", default=None, metavar="FILE",
                    help="write each micro-batch's (P, C, R) per pair as JSON, for bench/batch_steps.py")
    ap.add_argument("--time-layers", type=int, default=0,
                    help="time a random-weight SmolLM2-shaped model of this many layers (0 = the demo model)")
    add_flags(ap, out=str(RESULTS))
    a = ap.parse_args(argv)
    need_file(ap, a.data, "--data")

    from dtrain.data import load_dataset
    from dtrain.lora import apply_lora
    from dtrain.models import load_model

    cfg = load_config(a.config, [f"data.train={a.data}", "data.valid_fraction=0", "model.dtype=float32", *a.set])
    loaded = load_model(cfg.model.path, cfg.model.dtype)
    pairs = load_dataset(cfg.data, loaded.tokenizer, cfg.train.seed, log=None).train
    apply_lora(loaded.model, cfg.lora)  # the engines differentiate LoRA parameters only
    t = cfg.train
    sampler = Sampler(len(pairs), t.global_batch_pairs, t.seed)
    steps = max(1, a.passes * len(pairs) // t.global_batch_pairs)
    chunks = [sampler.take(s, pairs, 0, 1, t.micro_batch_pairs)[1] for s in range(1, steps + 1)]
    if a.spans_out:
        import json

        spans = [[[len(p.prompt), len(p.chosen), len(p.rejected)] for p in chunk] for step in chunks for chunk in step]
        with open(a.spans_out, "w") as f:
            json.dump({"data": a.data, "config": a.config, "set": a.set, "micro_batches": spans}, f)
    groups = 4 if cfg.engine.attention_groups == "auto" else cfg.engine.attention_groups  # auto: the CPU's
    rows = [measure(cfg, loaded.model, chunks, prefix, bucket, pack, groups)
            for prefix in (True, False) for bucket in (0, 128) for pack in (False, True)]
    lengths = sorted(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs)
    print(f"{len(pairs)} pairs from {a.data}, {steps} steps of {t.global_batch_pairs} pairs (micro-batches of "
          f"{t.micro_batch_pairs}); prompt + chosen + rejected tokens: median {lengths[len(lengths) // 2]}, "
          f"min {lengths[0]}, max {lengths[-1]}; attention in at most {groups} calls per layer "
          f"(engine.attention_groups; auto is 1 on CUDA, else 4)\n")
    print("| prefix sharing | length bucket | layout | padding_fraction (Σ/Σ) | worst step | shapes | tokens computed "
          "| attention-row padding | attention work ÷ one call | attention shapes |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gathered = r["attention_padding"] is not None
        att = f"{r['attention_padding']:.1%}" if gathered else "= padding_fraction (causal over the rows)"
        work = f"{r['attention_work_vs_one_call']:.2f} | {r['attention_shapes']}" if gathered else "– | –"
        print(f"| {'on' if r['prefix_sharing'] else 'off'} | {r['bucket']} | {'packed' if r['pack'] else 'padded'} "
              f"| {r['padding_fraction']:.1%} | {r['worst_step']:.1%} | {r['shapes']} | {r['computed_tokens']:,} "
              f"| {att} | {work} |")
    timing = None
    if a.time:
        import statistics

        model = loaded.model
        if a.time_layers:
            from common import build_model

            model = build_model("smollm2", a.time_layers, lora_scale=20.0)
        timing = time_steps(cfg, model, chunks[: a.time + 1])
        print(f"\n| layout | s/step median (min–max), {a.time} steps after 1 warm-up | loss per step |\n|---|---|---|")
        for name, v in timing.items():
            s = v["seconds"]
            print(f"| {name} | {statistics.median(s):.1f} ({min(s):.1f}–{max(s):.1f}) "
                  f"| {', '.join(f'{x:.5f}' for x in v['loss'])} |")
    path = write_results("padding", {"data": a.data, "config": a.config, "set": a.set, "time_layers": a.time_layers, "pairs": len(pairs), "steps": steps, "attention_groups": groups,
                                     "rows": rows, "timing": timing}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
