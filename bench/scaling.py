"""Inputs, validation and tables of the scaling model (bench/perfmodel.py, docs/scaling.md).

    python bench/scaling.py demo                                  # the demo job's per-pair and host time here
    python bench/scaling.py validate --ranks 2 3 4 --rates 1gbit 10gbit   # netns: predicted vs measured step
    python bench/scaling.py tables --demo bench/results/scaling-demo-STAMP.json

``demo`` runs ``dtrain.run.step.Step`` of configs/demo.yaml (the real SmolLM2-135M demo
model and pairs, one rank) and splits each step into engine compute (loss and
LoRA gradients evaluated) and the rest (host work: AdamW, clipping, metrics).

``validate`` simulates hosts with one network namespace per rank
(bench/netns.py; root, iproute2) and ``tc tbf`` on each rank's egress. For each
rate and rank count it first fits the link (hop latency and bus bandwidth)
from plain ``all_sum`` calls at 2 ranks, then runs dtrain's
``Step`` on a small random model with a large LoRA gradient in two
interleaved phases: A, each rank alone (a group of one, its own shard as the
whole batch: the same compute and host work, no collective) and B, the real
step over the ring. Predicted B = the slowest rank's median A step + the copy
work of ``all_sum_tree`` (timed in A) + the modelled all-reduce, with the fitted
or the nominal link; measured B = rank 0's median ``perf/step_seconds``.

``tables`` prints the markdown tables of docs/scaling.md from the model and
the inputs listed in ``H200_DP``, ``PAIR_SECONDS_8B`` and ``LINKS`` (sources and dates there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import build_model, machine, make_pairs, write_results  # before MLX: OpenBLAS
from prelude import RESULTS, ROOT, add_flags

import netns  # bench/netns.py: simulated hosts
import perfmodel as pm  # bench/perfmodel.py: the step-time model

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dtrain.config import load_config  # noqa: E402
from dtrain.distributed import Group, init_group  # noqa: E402
from dtrain.engine import make_engine  # noqa: E402
from dtrain.engine import ORPO  # noqa: E402
from dtrain.run.optimizer import AdamWStep  # noqa: E402
from dtrain.sampler import Sampler  # noqa: E402
from dtrain.run.step import Step  # noqa: E402

RANKS_TABLE = (2, 3, 4, 6, 8, 12, 16)

# Links as the ring sees them: bus bandwidth per rank (bytes/s) and hop latency (s).
LINKS = [
    pm.Link("1 GbE, TCP", pm.tcp_goodput(1e9), 50e-6,
            "line rate x TCP payload share (1448 of 1538 bytes per frame); hop latency assumed"),
    pm.Link("10 GbE, TCP", pm.tcp_goodput(10e9), 50e-6,
            "line rate x TCP payload share; hop latency assumed"),
    pm.Link("Thunderbolt ring, TCP", pm.bus_bandwidth(2e9, 4, 0.27), 0.19e-3,
            "ml-explore/mlx#1784 (2025-01-21): 2 GB 4-way all-reduce in 0.27 s, 4 M2 Ultra; "
            "latency: half the 0.38 ms Thunderbolt-bridge round trip in exo-explore/exo#2295"),
    pm.Link("Thunderbolt 5, JACCL", 12.2e9 * pm.bus_bandwidth(1, 4, 1), 10e-6,
            "ml-explore/mlx#3412 (2026-04-14): 12.2 GB/s algorithm bandwidth, 256 MB bf16 all-reduce, "
            "4 M3 Ultra (#3094, #3174); hop latency assumed"),
]

# 8B per-pair seconds: one H200, bf16, dtrain's single pass, one new pair per step (docs/gpu.md peer
# table, 2026-11-30). Those steps hold one pair, so each figure already includes a step's host work.
PAIR_SECONDS_8B = [(1024, 0.45), (4096, 1.68)]
LORA = {"smollm2-135m": 8, "llama3.2-1b": 16, "llama3.1-8b": 16, "llama3.1-70b": 64}  # rank, every linear layer


class TimedEngine:
    """An engine whose ``step`` evaluates its results and adds the seconds to ``seconds``."""

    def __init__(self, inner):
        self.inner, self.seconds, self.name, self.objective = inner, 0.0, inner.name, inner.objective

    def step(self, pairs, totals, key=None, hyper=None):
        start = time.perf_counter()
        out = self.inner.step(pairs, totals, key, hyper)
        mx.eval(out.loss, out.sums, out.grads)
        self.seconds += time.perf_counter() - start
        return out

    def evaluate(self, pairs, totals, key=None, hyper=None):
        return self.inner.evaluate(pairs, totals, key, hyper)


def timed_step(step, engine, model, optimizer, pairs, cfg, group) -> dict:
    """One ``dtrain.run.step.Step`` on ``pairs``: total, engine compute and all-reduce seconds."""
    engine.seconds = 0.0
    sampler = Sampler(len(pairs), cfg.train.global_batch_pairs, cfg.train.seed)
    metrics = Step(engine, model, optimizer, sampler, pairs, cfg.train, group)(step).metrics
    return {"step": metrics["perf/step_seconds"], "compute": engine.seconds, "reduce": metrics["perf/allreduce_seconds"]}


def new_optimizer(cfg, model) -> AdamWStep:
    return AdamWStep(cfg.train, model.trainable_parameters())  # as dtrain.run.trainer.setup


def measure_demo(steps: int, warmup: int) -> dict:
    """Per-pair compute and host seconds of configs/demo.yaml's ``Step`` at one rank."""
    from dtrain.data import load_dataset
    from dtrain.lora import apply_lora
    from dtrain.models import load_model

    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), ["train.progress=false"])
    loaded = load_model(cfg.model.path, cfg.model.dtype)
    dataset = load_dataset(cfg.data, loaded.tokenizer, cfg.train.seed, log=None)
    params = apply_lora(loaded.model, cfg.lora)
    loaded.model.train()
    engine = TimedEngine(make_engine(cfg.engine, loaded.model, ORPO.from_config(cfg)))
    optimizer = new_optimizer(cfg, loaded.model)
    rows = [timed_step(s, engine, loaded.model, optimizer, dataset.train, cfg, Group()) for s in range(1, warmup + steps + 1)]
    rows = rows[warmup:]
    g = cfg.train.global_batch_pairs
    lengths = [len(p.prompt) + len(p.chosen) + len(p.rejected) for p in dataset.train]
    return {"global_batch_pairs": g, "lora_parameters": params, "steps": rows,
            "pair_seconds": statistics.median(r["compute"] for r in rows) / g,
            "host_seconds": statistics.median(r["step"] - r["compute"] for r in rows),
            "tokens_per_pair": {"median": statistics.median(lengths), "max": max(lengths)}}


def worker(spec: dict) -> None:
    """One rank of a validation run: phases A (alone) and B (over the ring), interleaved."""
    mx.set_default_device(mx.cpu)
    group = init_group("any", timeout_s=600)
    n, p = group.size, spec["pairs_per_rank"]
    model = build_model("smollm2", spec["layers"], mx.float32, lora_scale=20.0, rank=spec["lora_rank"])
    model.train()
    overrides = ["engine.kind=reference", "data.demo_pairs=1", f"train.micro_batch_pairs={p}", "train.schedule=constant",
                 "train.progress=false", f"train.global_batch_pairs={p * n}"]
    cfg = load_config(None, overrides)
    alone = replace(cfg, train=replace(cfg.train, global_batch_pairs=p))
    pairs = make_pairs(64, spec["length"], 0.5, model.args.vocab_size)
    engine, optimizer = TimedEngine(make_engine(cfg.engine, model, ORPO.from_config(cfg))), new_optimizer(cfg, model)
    # A group of one MLX rank presented as size 2: all_sum_tree then flattens, casts and splits
    # the gradients while its all_sum is a no-op -- the copy work the collective adds to a step.
    single = mx.distributed.init(strict=False, backend="mpi")
    copier = Group(rank=0, size=2, backend="local", mlx_group=single) if single.size() == 1 else None
    records = []
    for step in range(1, spec["warmup"] + spec["steps"] + 1):
        a = timed_step(step, engine, model, optimizer, pairs, alone, Group())
        if copier is not None:
            start = time.perf_counter()
            copier.all_sum_tree(model.trainable_parameters(), step)
            a["copy"] = time.perf_counter() - start
        group.all_sum_scalars({"barrier": 0.0}, step)  # start B together
        b = timed_step(step, engine, model, optimizer, pairs, cfg, group)
        if step > spec["warmup"]:
            records.append({"A": a, "B": b})
    grads = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    mine = json.dumps({"rank": group.rank, "records": records, "lora_parameters": grads})
    everyone = [json.loads(t) for t in group.all_gather_text(mine, None)]
    if group.is_main:
        print(json.dumps(everyone))


def run_training(n: int, rate: str | None, burst: str, spec: dict) -> list:
    """Start ``n`` worker ranks in namespaces; every rank's records."""
    env_program = ["env", "OPENBLAS_NUM_THREADS=1", f"PYTHONPATH={ROOT}", sys.executable, __file__, "worker", json.dumps(spec)]
    with netns.namespaces(n, rate, burst) as (names, ips):
        results = netns.run_ranks(names, ips, env_program, 29600, timeout=900)
    for r, res in enumerate(results):
        if res.returncode != 0:
            raise RuntimeError(f"rank {r} failed: {res.stderr.strip()[-2000:]}")
    return json.loads(results[0].stdout.strip().splitlines()[-1])


def fit_link(rate: str | None, burst: str, elements: int, iters: int) -> pm.Link:
    """Hop latency and bus bandwidth from ``all_sum`` of 16 and ``elements`` float32 at 2 ranks."""
    t = netns.all_sum_seconds(2, rate, [16, elements], iters, burst=burst)
    latency = t[16] / 2  # 2 (N - 1) hops at N = 2
    bandwidth = pm.bus_bandwidth(elements * 4, 2, t[elements] - 2 * latency)
    return pm.Link(f"fitted {rate}", bandwidth, latency, f"all_sum at 2 ranks: {t[16] * 1e3:.2f} ms (16), "
                   f"{t[elements] * 1e3:.1f} ms ({elements})")


def burst_for(rate: str) -> str:
    """A tbf bucket of 8 ms at ``rate`` (at least 64 KB, one GSO segment): with 1 ms the loaded machine
    reached 95 MB/s at 1gbit, with 8 ms 113 MB/s (83 MB all_sum, 2 ranks)."""
    return f"{max(int(rate_bits(rate) * 8e-3), 64 * 8 * 1024) // 1000}kbit"


def validate(args) -> dict:
    spec = {"layers": args.layers, "lora_rank": args.lora_rank, "length": args.length,
            "pairs_per_rank": args.pairs_per_rank, "steps": args.steps, "warmup": args.warmup}
    elements = pm.lora_parameters(replace(pm.SHAPES["smollm2-135m"], layers=args.layers), args.lora_rank)
    rows = []
    for rate in args.rates:
        burst = burst_for(rate)
        for n in args.ranks:
            wait_for_quiet(args.quiet_load, args.quiet_wait)
            # the link is fitted at 2 ranks just before each run: the shared machine's load drifts
            fitted = fit_link(rate, burst, elements, args.iters)
            nominal = pm.Link(f"nominal {rate}", pm.tcp_goodput(rate_bits(rate), frame_overhead=14), fitted.hop_latency)
            load = os.getloadavg()[0]
            everyone = run_training(n, rate, burst, spec)
            assert everyone[0]["lora_parameters"] == elements, (everyone[0]["lora_parameters"], elements)
            med = lambda e, phase, key: statistics.median(r[phase][key] for r in e["records"])  # noqa: E731
            b = [r["B"] for r in everyone[0]["records"]]
            nbytes = (elements + len(ORPO.metric_keys) + 1) * 4  # one collective: gradients, metric sums, stop flag
            row = {"rate": rate, "ranks": n, "load_start": load, "load_end": os.getloadavg()[0], "grad_bytes": elements * 4,
                   "A_step": max(med(e, "A", "step") for e in everyone),  # the slowest rank sets the pace
                   "A_compute": max(med(e, "A", "compute") for e in everyone),
                   "A_copy": max(statistics.median(r["A"].get("copy", 0.0) for r in e["records"]) for e in everyone),
                   "B_step": statistics.median(r["step"] for r in b), "B_steps": [r["step"] for r in b],
                   "B_compute": max(med(e, "B", "compute") for e in everyone),
                   # the rank that arrives last waits least: its all_sum time is the collective's
                   "B_reduce": statistics.median(min(e["records"][i]["B"]["reduce"] for e in everyone) for i in range(len(b))),
                   "allreduce_fitted": pm.ring_allreduce_seconds(nbytes, n, fitted),
                   "allreduce_nominal": pm.ring_allreduce_seconds(nbytes, n, nominal),
                   "link": {"fitted_bandwidth": fitted.bandwidth, "hop_latency": fitted.hop_latency,
                            "fit": fitted.source, "nominal_bandwidth": nominal.bandwidth, "burst": burst}}
            for kind in ("fitted", "nominal"):
                row[f"predicted_{kind}"] = row["A_step"] + row["A_copy"] + row[f"allreduce_{kind}"]
            rows.append(row)
            print(f"{rate} {n} ranks: link {fitted.bandwidth / 1e6:.1f} MB/s, {fitted.hop_latency * 1e3:.2f} ms/hop; "
                  f"A {row['A_step']:.3f} s + copy {row['A_copy']:.3f}; B {row['B_step']:.3f} s measured, predicted "
                  f"{row['predicted_fitted']:.3f} / {row['predicted_nominal']:.3f} (fitted / nominal link); all-reduce "
                  f"{row['B_reduce']:.3f} measured vs {row['allreduce_fitted'] + row['A_copy']:.3f}; load {load:.1f}", flush=True)
    return {"spec": spec, "rows": rows}


def wait_for_quiet(load: float, patience_s: float) -> None:
    """Wait (at most ``patience_s``) until the 1-minute load average is below ``load``: other jobs share the cores."""
    deadline = time.time() + patience_s
    while os.getloadavg()[0] >= load and time.time() < deadline:
        time.sleep(10)


def rate_bits(rate: str) -> float:
    """``1gbit`` -> 1e9 bits per second (tc's units: gbit, mbit)."""
    return float(rate.lower().replace("gbit", "e9").replace("mbit", "e6"))


def print_validation(result: dict) -> None:
    """The validation table: step and all-reduce, model vs measured (fitted link / nominal link)."""
    print("\n| tbf rate | ranks | load avg | fitted link MB/s | phase A s + copy s | all-reduce + copy s: "
          "model (fitted / nominal) · measured | error | step s: predicted (fitted / nominal) · measured | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        reduce = [r[f"allreduce_{k}"] + r["A_copy"] for k in ("fitted", "nominal")]
        step = [r[f"predicted_{k}"] for k in ("fitted", "nominal")]
        pct = lambda pred, meas: " / ".join(f"{100 * (p / meas - 1):+.0f}%" for p in pred)  # noqa: E731
        print(f"| {r['rate']} | {r['ranks']} | {r['load_start']:.1f}–{r['load_end']:.1f} | "
              f"{r['link']['fitted_bandwidth'] / 1e6:.0f} | {r['A_step']:.2f} + {r['A_copy']:.2f} | "
              f"{reduce[0]:.2f} / {reduce[1]:.2f} · {r['B_reduce']:.2f} | {pct(reduce, r['B_reduce'])} | "
              f"{step[0]:.2f} / {step[1]:.2f} · {r['B_step']:.2f} | {pct(step, r['B_step'])} |")


def table_head(*first: str) -> str:
    """A blank line, then a markdown table header: ``first`` columns and one column per link."""
    names = [*first, *(link.name for link in LINKS)]
    return "\n| " + " | ".join(names) + " |\n" + "|---" * len(names) + "|"


def matmul_parameters(shape: pm.ModelShape, vocab: int = 128256) -> int:
    """Weights that take part in matmuls: every decoder linear layer plus the vocab x hidden head."""
    return shape.layers * sum(i * o for i, o in shape.linears().values()) + vocab * shape.hidden


def tables(demo: dict | None, global_batch: int) -> None:
    """The markdown tables of docs/scaling.md."""
    print("| model | LoRA | parameters | float32 MB | 32 MiB buckets |\n|---|---|---|---|---|")
    for key, shape in pm.SHAPES.items():
        params = pm.lora_parameters(shape, LORA[key])
        print(f"| {shape.name} | rank {LORA[key]}, all 7 linear layers | {params:,} | {params * 4 / 1e6:.1f} | "
              f"{-(-params * 4 // pm.BUCKET_BYTES)} |")
    print("\n| link | bus bandwidth GB/s | hop latency ms | source |\n|---|---|---|---|")
    for link in LINKS:
        print(f"| {link.name} | {link.bandwidth / 1e9:.3f} | {link.hop_latency * 1e3:.3f} | {link.source} |")
    for key, shape in pm.SHAPES.items():
        nbytes = pm.lora_parameters(shape, LORA[key]) * pm.FLOAT32_BYTES
        print(f"\n**{shape.name}, LoRA rank {LORA[key]}** ({nbytes / 1e6:.1f} MB): all-reduce ms per step | "
              f"compute per rank-step (s) for the all-reduce to be ≤ 10% of it")
        print(table_head("ranks"))
        for n in RANKS_TABLE:
            cells = []
            for link in LINKS:
                a = pm.ring_allreduce_seconds(nbytes, n, link)
                cells.append(f"{a * 1e3:,.1f} ms · {9 * a:,.2f} s")
            print(f"| {n} | " + " | ".join(cells) + " |")
    cases = []
    if demo:
        cases.append(("smollm2-135m", "demo pairs", demo["pair_seconds"], demo["host_seconds"], demo["global_batch_pairs"],
                      "this CPU, configs/demo.yaml (bench/scaling.py demo)"))
    host, c_1b = h200_fit()
    for (name, *_), c in list(zip(H200_DP, c_1b))[:2]:
        cases.append(("llama3.2-1b", name.split(", ")[1] + " per side", c, host, global_batch,
                      "c and h fitted on the 2 x H200 data-parallel run, docs/gpu.md (2026-11-30)"))
    for tokens, c in PAIR_SECONDS_8B:
        cases.append(("llama3.1-8b", f"{tokens:,} tokens per side", c, 0.0, global_batch,
                      "one H200, bf16, 1 pair per step (host work inside c), docs/gpu.md peer table (2026-11-30)"))
    ratio = matmul_parameters(pm.SHAPES["llama3.1-70b"]) / matmul_parameters(pm.SHAPES["llama3.1-8b"])
    for tokens, c in PAIR_SECONDS_8B:
        cases.append(("llama3.1-70b", f"{tokens:,} tokens per side", c * ratio, 0.0, global_batch,
                      f"NOT MEASURED: the 8B figure x {ratio:.2f} (matmul parameters, 6NT)"))
    for key, label, c, h, g, src in cases:
        shape = pm.SHAPES[key]
        nbytes = pm.lora_parameters(shape, LORA[key]) * pm.FLOAT32_BYTES
        print(f"\n**{shape.name}, {label}**: {c:.3g} s per pair, host {h:.3g} s per step, global batch {g} "
              f"({src}); speed-up over one rank")
        print(table_head("ranks"))
        for n in (n for n in RANKS_TABLE if n <= g):  # more ranks than pairs would idle
            s = [pm.speedup(c, g, n, pm.ring_allreduce_seconds(nbytes, n, link), h) for link in LINKS]
            print(f"| {n} | " + " | ".join(f"{x:.2f}×" for x in s) + " |")
    print("\nMost ranks (2-16, at most one per pair) with a speed-up of at least 0.75 x ranks")
    print(table_head("case", "s/pair"))
    for key, label, c, h, g, _ in cases:
        nbytes = pm.lora_parameters(pm.SHAPES[key], LORA[key]) * pm.FLOAT32_BYTES
        cells = [str(pm.largest_worthwhile(c, g, nbytes, link, h, ranks=range(2, min(16, g) + 1))) for link in LINKS]
        print(f"| {pm.SHAPES[key].name}, {label}, global batch {g} | {c:.3g} | " + " | ".join(cells) + " |")
    settings(cases)
    print()
    h200_comparison()


# docs/gpu.md, "Data parallel over NCCL, 2 x H200" (2026-11-30; global batch 8, micro-batch 4,
# Llama-3.2-1B shape, LoRA rank 16): pairs/s at 1 and 2 ranks and the all-reduce seconds per step
# (7-9 ms in bf16; float32: its 0.6% share of the 2-rank step).
H200_DP = [("bfloat16, 1,024 tokens", 10.24, 16.32, 0.008), ("bfloat16, 4,096 tokens", 1.84, 3.48, 0.008),
           ("float32 (TF32 off), 1,024 tokens", 3.20, 6.11, 0.006 * 8 / 6.11)]
NVLINK = pm.Link("NVLink 4, NCCL", 370e9, 5e-6, "NCCL busbw on NVLink 4 (NVIDIA/nccl-tests#212, maintainer); latency assumed")


def h200_fit() -> tuple[float, list]:
    """Host seconds fitted on the first H200_DP row (8c + h = T1, 4c + h + a = T2), and c of every row."""
    g = 8
    one, two, reduce = H200_DP[0][1:]
    c0 = (g / one - g / two + reduce) / (g - pm.pairs_per_rank(g, 2))
    host = g / one - g * c0
    return host, [(g / row[1] - host) / g for row in H200_DP]


def h200_comparison() -> None:
    """Predicted vs measured 2-rank step on 2 x H200, host work fitted once (on the first row)."""
    g = 8
    nbytes = pm.lora_parameters(pm.SHAPES["llama3.2-1b"], 16) * pm.FLOAT32_BYTES
    host, _ = h200_fit()
    print(f"link term for {nbytes / 1e6:.1f} MB over {NVLINK.name}: "
          f"{pm.ring_allreduce_seconds(nbytes, 2, NVLINK) * 1e3:.2f} ms; host work fitted on the first row: {host:.3f} s\n")
    print("| run | 1-rank step s | 2-rank step s measured | all-reduce s measured | predicted, host = 0 | "
          "predicted, fitted host | speed-up measured / predicted (fitted host) |\n|---|---|---|---|---|---|---|")
    for name, one, two, reduce in H200_DP:
        t1, t2 = g / one, g / two
        preds = [pm.step_seconds((t1 - h) / g, pm.pairs_per_rank(g, 2), reduce, h) for h in (0.0, host)]
        print(f"| {name} | {t1:.3f} | {t2:.3f} | {reduce:.3f} | {preds[0]:.3f} ({100 * (preds[0] / t2 - 1):+.0f}%) | "
              f"{preds[1]:.3f} ({100 * (preds[1] / t2 - 1):+.1f}%) | {t1 / t2:.2f} / {t1 / preds[1]:.2f} |")


def settings(cases: list, n: int = 8, backward_share: float = 0.5) -> None:
    """At ``n`` ranks: all-reduce, pairs per rank for a <= 10% share, overlap saving, bucket latency."""
    print(f"\n{n} ranks: all-reduce s · pairs per rank for it to be ≤ 10% of the step · saving of an overlap with "
          f"the backward of a 1-pair last micro-batch (backward = {backward_share} x compute) · share of the "
          f"all-reduce that is per-bucket latency")
    print(table_head("model", "s/pair"))
    for key, label, c, _, _, _ in cases:
        nbytes = pm.lora_parameters(pm.SHAPES[key], LORA[key]) * pm.FLOAT32_BYTES
        cells = []
        for link in LINKS:
            a = pm.ring_allreduce_seconds(nbytes, n, link)
            last = pm.ring_allreduce_seconds(min(nbytes, pm.BUCKET_BYTES), n, link)
            lat = pm.ring_allreduce_seconds(nbytes, n, replace(link, bandwidth=float("inf")))
            cells.append(f"{a:.3g} · {pm.pairs_for_share(a, c, 0.1)} · {pm.overlap_saving(a, last, backward_share * c):.2g} · "
                         f"{100 * lat / a:.0f}%")
        print(f"| {pm.SHAPES[key].name}, {label} | {c:.3g} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo")
    add_flags(d, steps=5, warmup=1, out=str(RESULTS))
    v = sub.add_parser("validate")
    v.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    v.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    add_flags(v, layers=4, help={"layers": "SmolLM2-width decoder layers"})
    v.add_argument("--lora-rank", type=int, default=128)
    v.add_argument("--length", type=int, default=128, help="P + R tokens per side")
    v.add_argument("--pairs-per-rank", type=int, default=1)
    add_flags(v, steps=6, warmup=1, out=str(RESULTS))
    v.add_argument("--iters", type=int, default=10, help="all_sum calls per size when fitting the link")
    v.add_argument("--table", nargs="+", default=None, help="print the table of earlier runs' JSON instead")
    v.add_argument("--quiet-load", type=float, default=2.0, help="wait for a 1-minute load average below this")
    v.add_argument("--quiet-wait", type=float, default=600, help="seconds to wait for it at most")
    t = sub.add_parser("tables")
    t.add_argument("--demo", default=None, help="JSON written by `demo`")
    t.add_argument("--global-batch", type=int, default=32)
    w = sub.add_parser("worker")
    w.add_argument("spec")
    a = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so namespaces and rank processes are removed (background jobs ignore SIGINT)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.cmd == "worker":
        worker(json.loads(a.spec))
        return 0
    if a.cmd == "demo":
        result = measure_demo(a.steps, a.warmup)
        print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
        print(f"wrote {write_results('scaling-demo', result, a.out)}")
    elif a.cmd == "validate" and a.table:
        for path in a.table:
            print_validation(json.loads(Path(path).read_text()))
    elif a.cmd == "validate":
        result = validate(a)
        print_validation(result)
        print(f"wrote {write_results('scaling-validate', result, a.out)}")
    else:
        demo = json.loads(Path(a.demo).read_text()) if a.demo else None
        tables(demo, a.global_batch)
    print(json.dumps(machine()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
