"""A training process on a tiny random model, for tests that kill, resume or
run several ranks: ``python tests/train_worker.py OUT_DIR [--section.key VALUE ...]``.

Writes ``OUT_DIR/result-rank<R>.json`` (per-step metrics, eval metrics, adapter
folder) when training ends; exits 2 with one line on a user error.
"""

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_pairs, make_tiny_model  # noqa: E402

from dtrain.cli import split_overrides  # noqa: E402
from dtrain.config import load_config  # noqa: E402
from dtrain.distributed import init_group  # noqa: E402
from dtrain.errors import UserError  # noqa: E402
from dtrain.run import trainer  # noqa: E402
from dtrain.run.trainer import train  # noqa: E402


def slow_steps(seconds: float, marks: Optional[Path]) -> trainer.Hooks:
    """Test harness only: make each optimizer step take ``seconds`` longer (the
    sleep is inside the step, in ``Hooks.before_step``), so a test can kill or
    interrupt the process mid-run; with ``marks``, touch ``marks/in-step-N`` when step N begins."""

    def delayed(step, run):
        if marks is not None:
            (marks / f"in-step-{step}").touch()
        time.sleep(seconds)

    return trainer.Hooks(before_step=delayed)


def on_nth_save(spec: str, instead) -> None:
    """Test harness only: ``NAME:N`` makes the N-th ``mx.save_safetensors`` of a file NAME call ``instead(path)``."""
    import mlx.core as mx

    name, nth = spec.rsplit(":", 1)
    real, seen = mx.save_safetensors, []

    def save(path, *a, **k):
        if Path(path).name == name:
            seen.append(path)
            if len(seen) == int(nth):
                return instead(Path(path))
        return real(path, *a, **k)

    mx.save_safetensors = save


def fail_save(path: Path) -> None:
    """Raise MLX's write error."""
    raise RuntimeError("[write] Unable to write 17309 bytes to file.")


def hold_save(folder: Path):
    """Write half the file, touch ``folder/in-save`` and wait there, so a test kills the process inside that write."""

    def hold(path: Path) -> None:
        path.write_bytes(b"half")
        (folder / "in-save").touch()
        while True:
            time.sleep(0.01)

    return hold


def held_step(hold_at: int, folder: Path) -> trainer.Hooks:
    """Test harness only: when step ``hold_at`` begins, touch ``folder/in-step-N`` and wait until
    ``folder/go-N`` exists, so a test kills or signals the process inside that step, not near it."""

    def hold(step, run):
        if step == hold_at:
            (folder / f"in-step-{step}").touch()
            while not (folder / f"go-{step}").exists():
                time.sleep(0.01)

    return trainer.Hooks(before_step=hold)


def main(argv):
    out = Path(argv[0])
    if os.environ.get("WORKER_FAIL_SAVE"):
        on_nth_save(os.environ["WORKER_FAIL_SAVE"], fail_save)
    if os.environ.get("WORKER_HOLD_SAVE"):
        on_nth_save(os.environ["WORKER_HOLD_SAVE"], hold_save(out))
    hooks = trainer.Hooks()
    if os.environ.get("WORKER_STEP_DELAY"):
        hooks = slow_steps(float(os.environ["WORKER_STEP_DELAY"]), out if os.environ.get("WORKER_MARK_STEPS") else None)
    if os.environ.get("WORKER_HOLD_AT"):
        hooks = held_step(int(os.environ["WORKER_HOLD_AT"]), out)
    overrides = [f"train.output_dir={out}", "data.demo_pairs=1", "train.progress=false", "lora.rank=2",
                 "train.learning_rate=1e-2", *split_overrides(argv[1:])]
    try:
        cfg = load_config(None, overrides)
        group = init_group(cfg.distributed.backend, cfg.distributed.collective_timeout_s)
        pairs = make_pairs(24)
        loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny", source="tiny-llama",
                                 reference={"path": "tiny-llama"})
        dataset = SimpleNamespace(train=pairs[:20], valid=pairs[20:], fingerprint="tiny-pairs")
        result = train(cfg, group=group, loaded=loaded, dataset=dataset, hooks=hooks)
    except UserError as err:
        print(f"dtrain: error: {err}", file=sys.stderr, flush=True)
        return 2
    (out / f"result-rank{group.rank}.json").write_text(json.dumps({
        "history": result.history, "evals": {str(k): v for k, v in result.evals.items()},
        "adapter_dir": str(result.adapter_dir) if result.adapter_dir else None,
        "run_dir": str(result.run_dir) if result.run_dir else None, "stopped": result.stopped,
        "steps": result.steps, "skipped_steps": result.skipped_steps,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
