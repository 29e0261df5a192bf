"""Bucketed LoRA-gradient all-reduce (``Group.all_sum_tree``) at 1, 2, 3 ranks on loopback.

    python bench/allreduce.py [--repeats 5] [--step-tokens 256]

For two LoRA sizes: the demo model's (SmolLM2-135M: 30 layers, hidden 576,
intermediate 1536, 9 heads / 3 KV heads of dim 64; rank 8 on every linear
layer) and a 7B one (Llama-2-7B shape: 32 layers, hidden 4096, intermediate
11008; rank 16 on every linear layer). Ranks run over the ring backend
(``mlx.launch -n N``) and over OpenMPI's ``mpirun``; each rank sums
random float32 trees shaped like the LoRA gradients, and the median of
``--repeats`` timed calls is reported. The share of step time uses one
reference-engine step of a random SmolLM2-shaped model (one pair, ``--step-tokens``
tokens per side) on this machine; no 7B step fits on it, so that share is left out.
Prints a markdown table and writes ``allreduce.json`` to ``--out`` (default bench/results/).

    python bench/allreduce.py --endurance 10000 [--timeout 30] [--runs ring:3,mpi:2] [--minutes M]

Endurance instead: that many consecutive ``all_sum_tree`` calls of the
SmolLM2-135M r8 LoRA gradient (2,442,240 float32) at 3 ranks over the ring and
2 ranks over MPI, each under the collective watchdog. Every call sums
integer-valued contributions that change with the call and the rank, so each
rank checks the exact sum of every call. A worker that exits (a watchdog
firing = a hang, or a failure) is started again from the next call, as
``./launch --max-restarts`` would. Reports hangs, failures, wrong sums and
per-call latency percentiles, and every 250 calls each thread's CPU seconds
(``rank-R.cpu``: MLX's ring socket threads poll while they wait); with
``--minutes`` a run is stopped after that long and reports the calls it made.
Writes ``allreduce-endurance-<runs>.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import write_results  # sets up BLAS before MLX; blas_env() gives the workers the same choice
from prelude import RESULTS, ROOT, add_flags

from dtrain.blas import CHILD_VARS, blas_env  # noqa: E402
from dtrain.models import DEMO_SHAPE  # noqa: E402

# (layers, hidden, intermediate, q width, kv width, LoRA rank)
_S = DEMO_SHAPE
SHAPES = {"SmolLM2-135M r8": (_S["num_hidden_layers"], _S["hidden_size"], _S["intermediate_size"], _S["hidden_size"],
                              _S["hidden_size"] * _S["num_key_value_heads"] // _S["num_attention_heads"], 8),
          "Llama-2-7B r16": (32, 4096, 11008, 4096, 4096, 16)}


def lora_shapes(layers, hidden, inter, q, kv, r, keys=("q", "k", "v", "o", "gate", "up", "down")) -> list[tuple[int, int]]:
    """``(in, r)`` and ``(r, out)`` of every LoRA matrix on the ``keys`` linear layers of every layer."""
    linears = {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden), "gate": (hidden, inter),
               "up": (hidden, inter), "down": (inter, hidden)}
    return [s for _ in range(layers) for key in keys for i, o in [linears[key]] for s in ((i, r), (r, o))]


# Endurance gradients: the demo's LoRA (every linear layer), or only on q_proj and v_proj (5.3x smaller).
ENDURANCE = {"all": SHAPES["SmolLM2-135M r8"], "qv": (*SHAPES["SmolLM2-135M r8"], ("q", "v"))}


def worker(out: Path, repeats: int) -> None:
    """One rank: time ``all_sum_tree`` on each LoRA size; rank 0 writes the timings."""
    import mlx.core as mx

    from dtrain.distributed import init_group

    group = init_group("any", timeout_s=300)
    times = {}
    for name, spec in SHAPES.items():
        tree = {f"p{i}": mx.random.normal(s) for i, s in enumerate(lora_shapes(*spec))}
        mx.eval(tree)
        group.all_sum_tree(tree, 0)  # warm-up: connections, allocation
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            group.all_sum_tree(tree, 0)
            runs.append(time.perf_counter() - start)
        times[name] = sorted(runs)[len(runs) // 2]
    if group.is_main:
        (out / f"{group.backend}-{group.size}.json").write_text(json.dumps(times))


def run_ranks(backend: str, n: int, worker_args: list, check: bool = True, port: int = 33500,
              timeout: float | None = None, launcher: str = "mlx.launch") -> int | None:
    """Run this script with ``worker_args`` on ``n`` ranks (ring via mlx.launch, or mpirun); returns the exit
    status, or None when ``timeout`` seconds passed first (the launcher and its ranks are then killed).

    ``launcher="direct"`` starts ring ranks here, with the ``MLX_RANK``/``MLX_HOSTFILE`` mlx.launch would
    give them: mlx.launch 0.32 polls without sleeping (``select`` on its ranks' always-writable stdin
    pipes, and on its own stdin when that is /dev/null), which takes CPU from the ranks on a small machine.
    """
    env, _ = blas_env(dict(os.environ))
    env.update(PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, __file__, *worker_args]
    quiet = {}
    if n == 1:
        argv = cmd
    elif backend == "mpi":
        blas_flags = [x for k in CHILD_VARS if k in env for x in ("-x", k)]
        argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), *blas_flags, "-x", "PYTHONPATH", "-x",
                "OPENBLAS_NUM_THREADS", *cmd]
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif launcher == "direct":
        return run_direct(n, cmd, env, port, check, timeout)
    else:
        argv = [str(Path(sys.executable).parent / "mlx.launch"), "-n", str(n), "--starting-port", str(port),
                "--python", sys.executable, "--", *cmd[1:]]
    # A session of its own, so that a timeout ends the launcher and every rank it started (one process group).
    proc = subprocess.Popen(argv, env=env, start_new_session=True, **quiet)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None
    if check and code:
        raise subprocess.CalledProcessError(code, argv)
    return code


def run_direct(n: int, cmd: list, env: dict, port: int, check: bool, timeout: float | None) -> int | None:
    """``n`` ring ranks of ``cmd`` on loopback without a launcher; the first non-zero exit status, 0, or None
    when ``timeout`` passed first (every rank is then killed)."""
    from dtrain.contract import ring_hostfile

    hosts = Path(f"/tmp/allreduce-ring-{os.getpid()}-{port}.json")
    hosts.write_text(json.dumps(ring_hostfile([["127.0.0.1"]] * n, port)))
    procs = [subprocess.Popen(cmd, env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)}) for r in range(n)]
    end = time.time() + (timeout if timeout is not None else float("inf"))
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(end - time.time(), 0.01) if timeout is not None else None))
            if codes[-1] and any(q.poll() is None for q in procs):  # one rank failed: the others cannot finish
                time.sleep(5)
                break
    except subprocess.TimeoutExpired:
        codes = [None]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    hosts.unlink()
    code = next((c for c in codes if c != 0), 0)
    if check and code:
        raise subprocess.CalledProcessError(code, cmd)
    return code


def launch(backend: str, n: int, out: Path, repeats: int) -> dict:
    run_ranks(backend, n, ["--worker", str(out), "--repeats", str(repeats)])
    return json.loads((out / f"{backend if n > 1 else 'none'}-{n}.json").read_text())


def endurance_worker(out: Path, start: int, calls: int, timeout_s: float, lora: str = "all") -> int:
    """One rank: calls ``start .. calls-1`` of ``all_sum_tree``, each sum checked exactly.

    Rank ``r`` contributes ``base * (r + 1) + (i % 1000)`` at call ``i`` (``base``:
    integers 0..999), so the sum is ``base * n(n+1)/2 + n * (i % 1000)``, exact in
    float32. Each rank appends ``i seconds ok`` per call to ``out/rank-R.txt``.
    Returns 4 when MLX reported a lost peer; a hang ends the process through
    the watchdog (exit status 3).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from dtrain.distributed import CollectiveError, init_group

    group = init_group("any", timeout_s=timeout_s)
    n, r = group.size, group.rank
    shapes = lora_shapes(*ENDURANCE[lora])
    sizes = [a * b for a, b in shapes]
    base_flat = mx.arange(sum(sizes), dtype=mx.int32) % 1000  # (2442240,) for "all"
    base, offset = {}, 0
    for k, (shape, size) in enumerate(zip(shapes, sizes)):
        base[f"p{k}"] = base_flat[offset : offset + size].reshape(shape).astype(mx.float32)
        offset += size
    base_flat = base_flat.astype(mx.float32)
    mx.eval(base, base_flat)
    t_start = time.time()
    with open(out / f"rank-{r}.txt", "a") as log:
        for i in range(start, calls):
            tree = {k: v * (r + 1) + (i % 1000) for k, v in base.items()}
            mx.eval(tree)
            t0 = time.perf_counter()
            try:
                summed = group.all_sum_tree(tree, i, "endurance all_sum")
            except CollectiveError as err:
                print(f"rank {r} call {i}: {err}", file=sys.stderr, flush=True)
                return 4
            seconds = time.perf_counter() - t0
            flat = mx.concatenate([v.reshape(-1) for _, v in tree_flatten(summed)])
            ok = bool(mx.array_equal(flat, base_flat * (n * (n + 1) // 2) + n * (i % 1000)).item())
            log.write(f"{i} {seconds:.6f} {int(ok)}\n")
            log.flush()
            if (i + 1) % 250 == 0 or i == calls - 1:  # CPU seconds of each thread so far: which ones spin
                with open(out / f"rank-{r}.cpu", "a") as f:
                    f.write(json.dumps({"call": i, "calls": i + 1 - start, "wall_s": round(time.time() - t_start, 2),
                                        "loadavg": os.getloadavg()[0], "threads": thread_cpu()}) + "\n")
    return 0


def thread_cpu() -> list[float]:
    """CPU seconds (user + system) of each thread of this process, largest first (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = []
    for task in Path("/proc/self/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        cpu.append((int(fields[11]) + int(fields[12])) / tick)  # utime, stime (stat fields 14, 15)
    return sorted(cpu, reverse=True)


def endurance(backend: str, n: int, calls: int, timeout_s: float, scratch: Path, max_restarts: int = 50,
              deadline: float = float("inf"), launcher: str = "mlx.launch", lora: str = "all") -> dict:
    """Run ``calls`` checked all-reduces on ``n`` ranks, restarting workers that exit, until ``deadline``
    (``time.time()``; the workers are killed then); returns the counts."""
    import statistics

    out = scratch / f"{backend}-{n}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    exits, start, t0, stopped = [], 0, time.time(), False
    while start < calls and len(exits) <= max_restarts:
        code = run_ranks(backend, n, ["--endurance-worker", str(out), "--start", str(start), "--endurance", str(calls),
                                      "--timeout", str(timeout_s), "--lora", lora], check=False, port=33500 + 10 * len(exits),
                         timeout=max(deadline - time.time(), 1), launcher=launcher)
        done = [int(line.split()[0]) for line in (out / "rank-0.txt").read_text().splitlines()] if (out / "rank-0.txt").exists() else []
        stopped = code is None
        if stopped or code == 0 and done and done[-1] == calls - 1:
            break
        exits.append({"code": code, "after_call": done[-1] if done else None})
        start = (done[-1] + 1) if done else 0
    # A killed worker may leave a half-written last line; only whole lines count.
    rows = {r: [x for x in (line.split() for line in (out / f"rank-{r}.txt").read_text().splitlines()) if len(x) == 3]
            for r in range(n)}
    wrong = sorted({int(i) for r in rows.values() for i, _, ok in r if ok != "1"})
    lat = sorted(float(s) for _, s, _ in rows[0])
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3  # noqa: E731
    hangs = sum(1 for e in exits if e["code"] == 3 or e["code"] == 3 + 128)
    cpu = [json.loads(line) for line in (out / "rank-0.cpu").read_text().splitlines()] if (out / "rank-0.cpu").exists() else []
    return {"backend": backend, "launcher": launcher if backend == "ring" else "mpirun", "ranks": n, "calls": len({int(i) for i, _, _ in rows[0]}), "target_calls": calls, "stopped_at_deadline": stopped,
            "lora": lora, "params": sum(a * b for a, b in lora_shapes(*ENDURANCE[lora])), "watchdog_s": timeout_s,
            "worker_exits": exits, "hangs": hangs, "failures": len(exits) - hangs, "wrong_sums": len(wrong),
            "wrong_calls": wrong[:20], "p50_ms": pick(0.50), "p99_ms": pick(0.99), "max_ms": lat[-1] * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3, "wall_minutes": (time.time() - t0) / 60,
            "rank0_cpu": cpu, "loadavg": os.getloadavg()}


def demo_step_seconds(tokens: int) -> float:
    """One reference-engine ORPO step (1 pair, ``tokens`` per side) of a random SmolLM2-135M-shaped model."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from dtrain.config import LoraConfig
    from dtrain.engine import ReferenceEngine, batch_totals, run_micro_batches
    from dtrain.lora import apply_lora
    from dtrain.engine import ORPO
    from dtrain.types import TokenizedPair

    args = llama.ModelArgs.from_dict(DEMO_SHAPE)
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    apply_lora(model, LoraConfig(rank=8))
    half = tokens // 2
    pair = TokenizedPair(list(range(1, half + 1)), list(range(100, 100 + half)), list(range(200, 200 + half)))
    engine = ReferenceEngine(model, ORPO(0.1))
    norm = batch_totals([pair], "full")
    run_micro_batches(engine, [[pair]], norm, with_grads=True)  # warm-up
    start = time.perf_counter()
    run_micro_batches(engine, [[pair]], norm, with_grads=True)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-tokens", type=int, default=256)
    p.add_argument("--endurance", type=int, default=0, help="checked all-reduce calls per backend (endurance mode)")
    p.add_argument("--timeout", type=float, default=30.0, help="endurance: collective watchdog in seconds")
    p.add_argument("--runs", default="ring:3,mpi:2", help="endurance: BACKEND:RANKS, comma separated")
    p.add_argument("--minutes", type=float, default=0, help="endurance: stop each run after this long (0: no limit)")
    p.add_argument("--lora", choices=tuple(ENDURANCE), default="all",
                   help="endurance: SmolLM2-135M rank-8 LoRA on every linear layer, or on q_proj and v_proj only")
    p.add_argument("--launcher", choices=("mlx.launch", "direct"), default="mlx.launch",
                   help="endurance: start ring ranks with mlx.launch or directly (MLX_RANK, MLX_HOSTFILE)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--endurance-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    add_flags(p, out=str(RESULTS))
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker), args.repeats)
        return 0
    if args.endurance_worker:
        return endurance_worker(Path(args.endurance_worker), args.start, args.endurance, args.timeout, args.lora)
    results = Path(args.out)
    if args.endurance:
        scratch = results / f"allreduce-endurance-scratch-{args.lora}"
        runs = [(b, int(n)) for b, n in (x.split(":") for x in args.runs.split(","))]
        rows = []
        for backend, n in runs:
            deadline = time.time() + 60 * args.minutes if args.minutes else float("inf")
            rows.append(endurance(backend, n, args.endurance, args.timeout, scratch, deadline=deadline,
                                  launcher=args.launcher, lora=args.lora))
            print(json.dumps(rows[-1]), flush=True)
        name = "allreduce-endurance-" + "-".join(f"{b}{n}" for b, n in runs) + f"-{args.lora}"
        write_results(name, {"rows": rows}, results, stamp=False)
        return 0
    scratch = results / "allreduce-scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    step = demo_step_seconds(args.step_tokens)
    backends = ["ring"] + (["mpi"] if shutil.which("mpirun") else [])
    rows = []
    for backend in backends:
        for n in (1, 2, 3):
            if n == 1 and backend != backends[0]:
                continue
            for name, seconds in launch(backend, n, scratch, args.repeats).items():
                params = sum(a * b for a, b in lora_shapes(*SHAPES[name]))
                share = seconds / (step + seconds) if name.startswith("SmolLM2") else None
                rows.append({"backend": backend if n > 1 else "none", "ranks": n, "lora": name, "params": params,
                             "mib": params * 4 / 2**20, "buckets": -(-params * 4 // (32 * 2**20)),
                             "seconds": seconds, "share_of_step": share})
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"demo step (1 pair, {args.step_tokens} tokens per side, reference engine, this CPU): {step:.2f} s\n")
    print("| backend | ranks | LoRA | params | MiB | buckets | all-reduce (s) | share of step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = f"{100 * r['share_of_step']:.1f}%" if r["share_of_step"] is not None else "n/a"
        print(f"| {r['backend']} | {r['ranks']} | {r['lora']} | {r['params']:,} | {r['mib']:.1f} | {r['buckets']} | "
              f"{r['seconds']:.4f} | {share} |")
    write_results("allreduce", {"demo_step_seconds": step, "step_tokens": args.step_tokens, "rows": rows}, results,
                  stamp=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
