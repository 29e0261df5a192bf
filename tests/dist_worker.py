"""One training rank for the distributed tests: a tiny random llama and generated pairs, no downloads.

    python tests/dist_worker.py OUT_DIR [options] [section.key=value ...]
    python tests/dist_worker.py OUT_DIR --allreduce-check       # bucketed all_sum vs mpi4py (under mpirun)
    python tests/dist_worker.py OUT_DIR --broadcast-check       # rank 0's arrays on every rank, bit for bit
    python tests/dist_worker.py OUT_DIR --lost-peer handshake   # rank 0 exits; rank 1 gathers once OUT_DIR/go exists

It joins whatever group its launcher set up (``mlx.launch``/ring variables,
``mpirun``, or none: one rank), runs :func:`dtrain.run.trainer.train` and writes
``OUT_DIR/rank{R}.json`` (per-step metrics, eval metrics, the pair sources this
rank trained on at each step) and ``OUT_DIR/rank{R}.safetensors`` (its LoRA
weights). A :class:`UserError` prints ``dtrain: error: ...`` and exits 2, as
the CLI does.

Fault injection, each ``STEP:RANK``: ``--kill-at`` (SIGKILL at the start of the
step), ``--stall-at`` (SIGSTOP there), ``--drift-at`` (nudge the LoRA weights
after the step); ``--rank-override RANK:section.key=value`` and
``--data-seed RANK:SEED`` give one rank a different config or data (``--raw-fingerprint``: with the
raw data's fingerprint the same on every rank); ``--slow-save SECONDS`` makes rank 0's checkpoint saves
take that much longer and touch ``OUT_DIR/saved-STEP`` when each is written; ``--full-disk STEP:WHAT`` fills
rank 0's disk after step STEP for its checkpoints or TensorBoard events (WHAT: checkpoint, events): each such
write then fails with ENOSPC.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dtrain.blas import setup  # noqa: E402

setup()  # before MLX: the BLAS the test passed in DTRAIN_BLAS/LD_PRELOAD, else the fastest correct one
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from dtrain import distributed  # noqa: E402
from dtrain.run import trainer  # noqa: E402
from dtrain.config import load_config  # noqa: E402
from dtrain.errors import UserError  # noqa: E402

# No clipping and a small learning rate: Adam's first steps are near-sign updates
# (lr * g / |g|), even for gradient elements near zero, which amplifies float32
# summation-order noise; these settings keep 5 steps well conditioned.
DEFAULTS = [
    "data.demo_pairs=1", "train.steps=5", "train.global_batch_pairs=6", "train.micro_batch_pairs=6",
    "train.learning_rate=1e-3", "train.grad_clip=0", "lora.rank=2", "train.progress=false", "train.eval_every=0",
    "distributed.check_sync_every=2", "distributed.collective_timeout_s=60",
]


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--pairs", type=int, default=9, help="training pairs; 3 more are held out")
    p.add_argument("--kill-at", default=None)
    p.add_argument("--stall-at", default=None)
    p.add_argument("--drift-at", default=None)
    p.add_argument("--rank-override", action="append", default=[])
    p.add_argument("--data-seed", action="append", default=[])
    p.add_argument("--slow-save", type=float, default=None)
    p.add_argument("--full-disk", default=None)
    p.add_argument("--raw-fingerprint", default=None, help="Dataset.fingerprint whatever the pairs (the raw data's, "
                   "which a chat template file that differs between machines leaves as it is)")
    p.add_argument("--allreduce-check", action="store_true")
    p.add_argument("--broadcast-check", action="store_true")
    p.add_argument("--lost-peer", choices=["handshake", "sync"], default=None)
    return p.parse_known_args(argv)


def at(spec, rank):
    """The step of a ``STEP:RANK`` spec when it names ``rank``, else None."""
    if spec is None:
        return None
    step, r = map(int, spec.split(":"))
    return step if r == rank else None


def for_rank(items, rank):
    """Values of ``RANK:value`` items that name ``rank``."""
    return [v for r, v in (i.split(":", 1) for i in items) if int(r) == rank]


def hooks_for(args, group, seen) -> trainer.Hooks:
    """Trainer hooks (this process only) that record each step's pair sources, as the
    engine receives them, and inject the requested faults."""
    kill, stall, drift = (at(s, group.rank) for s in (args.kill_at, args.stall_at, args.drift_at))
    current = {}

    def before_step(step, run):
        current["step"] = step
        if step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == stall:
            os.kill(os.getpid(), signal.SIGSTOP)

    def after_step(step, run):
        if step == drift:
            run.model.update(tree_map(lambda p: p + 1e-3, run.model.trainable_parameters()))

    class Recording:
        def __init__(self, engine):
            self.engine, self.name, self.objective = engine, engine.name, engine.objective

        def step(self, chunk, totals, key=None, hyper=None):
            seen.setdefault(current["step"], []).extend(p.source for p in chunk)
            return self.engine.step(chunk, totals, key, hyper)

        def evaluate(self, chunk, totals, key=None, hyper=None):
            return self.engine.evaluate(chunk, totals, key, hyper)

    return trainer.Hooks(engine=Recording, before_step=before_step, after_step=after_step)


def full_disk(spec: str, group) -> trainer.Hooks:
    """``STEP:WHAT``: after step STEP, rank 0's writes of WHAT (``checkpoint``: ``mx.save_safetensors``;
    ``events``: TensorBoard's record writer) raise ENOSPC, as a disk filled from outside would."""
    import errno

    from tensorboardX.record_writer import RecordWriter

    step, what = spec.split(":")
    full = {"on": False}
    owner, name = (mx, "save_safetensors") if what == "checkpoint" else (RecordWriter, "write")
    real = getattr(owner, name)

    def write(*a, **k):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    if group.is_main:
        setattr(owner, name, write)

    def after_step(s, run):
        full["on"] |= s == int(step)

    return trainer.Hooks(after_step=after_step)


def slow_saves(seconds: float, out: Path) -> None:
    """Rank 0's ``save_checkpoint`` sleeps ``seconds`` first and touches ``out/saved-STEP`` once written."""
    import time

    real = trainer.ckpt.save_checkpoint

    def save(folder, state, *rest, **kw):
        time.sleep(seconds)
        real(folder, state, *rest, **kw)
        (out / f"saved-{state.step}").touch()

    trainer.ckpt.save_checkpoint = save


def run_training(args, overrides, group):
    from conftest import make_pairs, make_tiny_model

    out = Path(args.out)
    if args.slow_save is not None and group.is_main:
        slow_saves(args.slow_save, out)
    cfg = load_config(None, [*DEFAULTS, f"train.output_dir={out / 'run'}", *overrides,
                             *for_rank(args.rank_override, group.rank)])
    seed = int((for_rank(args.data_seed, group.rank) or [0])[0])
    pairs = make_pairs(args.pairs + 3, seed=seed)
    data_id = args.raw_fingerprint or distributed.fingerprint([[p.prompt, p.chosen, p.rejected] for p in pairs])
    dataset = SimpleNamespace(train=pairs[: args.pairs], valid=pairs[args.pairs :], fingerprint=data_id)
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny-llama-seed0", source="tiny",
                             reference={"path": "tiny"})
    seen: dict = {}
    hooks = full_disk(args.full_disk, group) if args.full_disk else hooks_for(args, group, seen)
    result = trainer.train(cfg, group=group, loaded=loaded, dataset=dataset, hooks=hooks)
    mx.save_safetensors(str(out / f"rank{group.rank}.safetensors"), dict(tree_flatten(loaded.model.trainable_parameters())))
    report = {
        "rank": group.rank, "size": group.size, "backend": group.backend,
        "history": result.history, "evals": {str(k): v for k, v in result.evals.items()},
        "pairs": {str(k): v for k, v in seen.items()},
        "adapter": str(result.adapter_dir) if result.adapter_dir else None,
        "steps": result.steps, "best_step": result.best.step if result.best else None,
    }
    (out / f"rank{group.rank}.json").write_text(json.dumps(report))


def allreduce_check(args, group):
    """Bucketed ``Group.all_sum_tree`` against mpi4py's ``Allreduce`` on the same data.

    Leaves have odd sizes so that buckets split them; one run uses 4 KiB
    buckets, one the real 32 MiB bucket with a 36 MiB leaf. Counts the
    ``mx.distributed.all_sum`` calls. Writes ``OUT_DIR/allreduce{R}.json``.
    """
    import numpy as np
    from mpi4py import MPI

    calls = []
    real_all_sum = mx.distributed.all_sum
    mx.distributed.all_sum = lambda x, **kw: calls.append(x.size) or real_all_sum(x, **kw)
    rng = np.random.default_rng(group.rank)
    report = {"rank": group.rank, "cases": []}
    for name, shapes, bucket in (("small buckets", [(7, 13), (1000,), (3, 5, 11), (2,)], 4096),
                                 ("32 MiB buckets", [(9 * 1024 * 1024 + 3,), (1025, 1024)], distributed.BUCKET_BYTES)):
        tree = {f"w{i}": mx.array(rng.standard_normal(s).astype(np.float32)) for i, s in enumerate(shapes)}
        calls.clear()
        got = group.all_sum_tree(tree, step=1, bucket_bytes=bucket)
        flat = np.concatenate([np.array(tree[k]).reshape(-1) for k in sorted(tree, key=lambda k: int(k[1:]))])
        want = np.empty_like(flat)
        MPI.COMM_WORLD.Allreduce(flat, want, op=MPI.SUM)
        mine = np.concatenate([np.array(got[k]).reshape(-1) for k in sorted(got, key=lambda k: int(k[1:]))])
        report["cases"].append({
            "name": name, "elements": int(flat.size), "calls": list(calls),
            "expected_calls": len(distributed.bucket_bounds(flat.size, 4, bucket)),
            "max_abs_diff": float(np.abs(mine - want).max()), "max_abs": float(np.abs(want).max()),
            "shapes_kept": all(tuple(got[k].shape) == tuple(tree[k].shape) for k in tree),
        })
    Path(args.out, f"allreduce{group.rank}.json").write_text(json.dumps(report))


def broadcast_check(args, group):
    """``Group.broadcast_arrays`` of awkward values (signed zeros, NaN, inf, a
    subnormal, uint64 beyond 2**32, bfloat16); other ranks start from their own
    garbage. Writes ``OUT_DIR/broadcast{R}.json``: each array's bytes in hex."""
    import numpy as np

    special = [-0.0, 0.0, float("nan"), float("-inf"), 1e-45, 3.5]
    mine = {
        "f32": mx.array(special, dtype=mx.float32),
        "bf16": mx.array(special, dtype=mx.bfloat16),
        "step": mx.array(2**40 + 7, dtype=mx.uint64),
        "i32": mx.array([[-5, 7], [0, 1]], dtype=mx.int32),
    }
    if not group.is_main:
        mine = {k: (v + 1).astype(v.dtype) for k, v in mine.items()}
    got = group.broadcast_arrays(mine, None)
    hexes = {k: np.array(v.view(mx.uint8) if v.ndim else v.reshape(1).view(mx.uint8)).tobytes().hex()
             for k, v in got.items()}
    shapes = {k: list(v.shape) for k, v in got.items()}
    dtypes = {k: str(v.dtype) for k, v in got.items()}
    Path(args.out, f"broadcast{group.rank}.json").write_text(json.dumps({"hex": hexes, "shapes": shapes, "dtypes": dtypes}))


def lost_peer(args, group):
    """Rank 0 exits after one collective; rank 1 waits for ``OUT_DIR/go`` (the test writes it once rank 0
    has ended), runs the ``--lost-peer`` gather and writes the error it raised to ``OUT_DIR/lost1.json``."""
    import time

    group.all_sum_scalars({"joined": 1.0}, None)
    if group.is_main:
        os._exit(0)
    while not Path(args.out, "go").exists():
        time.sleep(0.01)
    got = {"error": None}
    try:
        if args.lost_peer == "handshake":
            distributed.handshake(group, {"config": {"a": 1}})
        else:
            distributed.check_in_sync(group, {"w": mx.ones(4)}, 7)
    except UserError as err:
        got = {"error": type(err).__name__, "message": str(err)}
    Path(args.out, f"lost{group.rank}.json").write_text(json.dumps(got))


def main(argv=None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        group = distributed.init_group("any", timeout_s=60)
        if args.allreduce_check:
            allreduce_check(args, group)
        elif args.broadcast_check:
            broadcast_check(args, group)
        elif args.lost_peer:
            lost_peer(args, group)
        else:
            run_training(args, overrides, group)
    except UserError as err:
        print(f"dtrain: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
