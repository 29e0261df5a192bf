"""The training loop: data -> engine -> all-reduce -> AdamW step -> logs, adapter.

Read top to bottom: :func:`train` sets up the run, then each step takes this
rank's shard of the global batch (``sampler``), splits it into micro-batches,
asks the engine for loss contributions and LoRA gradients normalised by the
*global* counts, sums them over micro-batches and ranks, clips, checks they
are finite on every rank, and applies one AdamW update with the learning rate
of ``schedule.learning_rate(step)``.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from . import checkpoint as ckpt
from . import sampler
from .blas import warn_if_slow
from .config import Config, to_dict
from .distributed import Group, check_in_sync, handshake
from .engine import Norm, make_engine
from .engine.loss import finalize_metrics
from .errors import UserError
from .lora import apply_lora, save_adapter
from .schedule import learning_rate
from .tracking import RunLogger, new_run_dir, peak_memory_gb
from .types import TokenizedPair


@dataclass
class TrainResult:
    """What a finished run reports: final metrics, where things were written."""

    steps: int
    history: list = field(default_factory=list)  # per-step metric dicts
    evals: dict = field(default_factory=dict)  # step -> eval metrics
    adapter_dir: Optional[Path] = None
    run_dir: Optional[Path] = None
    skipped_steps: int = 0
    stopped: bool = False  # stopped early by a signal (checkpoint saved)


def nll_token_count(pair: TokenizedPair, nll_scope: str) -> int:
    """Tokens in the NLL term of one pair: predictions over ``[prompt; chosen]``."""
    return len(pair.chosen) + (len(pair.prompt) - 1 if nll_scope == "full" else 0)


def global_norm(pairs: list[TokenizedPair], nll_scope: str) -> Norm:
    """Global normalisers of a step; every rank computes them from the global batch."""
    return Norm(nll_tokens=float(sum(nll_token_count(p, nll_scope) for p in pairs)), pairs=float(len(pairs)))


METRIC_KEYS = ("nll_sum", "or_sum", "log_odds_ratio_sum", "log_odds_chosen_sum", "logps_chosen_sum",
               "logps_rejected_sum", "accuracy_sum", "pairs", "nll_tokens", "input_tokens", "fallback_pairs")


def run_micro_batches(engine, pairs: list[TokenizedPair], norm: Norm, micro: int, with_grads: bool):
    """Sum engine results over micro-batches of ``pairs``.

    Returns:
        ``(sums, grads)``: every ``METRIC_KEYS`` sum as a Python float (zeros
        when ``pairs`` is empty) and the summed gradient tree (None without
        grads or pairs).
    """
    sums, grads, device = dict.fromkeys(METRIC_KEYS, 0.0), None, {}
    for chunk in sampler.micro_batches(pairs, micro):
        result = engine.step(chunk, norm) if with_grads else engine.evaluate(chunk, norm)
        if with_grads:
            grads = result.grads if grads is None else tree_map(lambda a, b: a + b, grads, result.grads)
        for k, v in result.sums.items():  # device sums stay on the device; host counts add here
            if isinstance(v, mx.array):
                device[k] = device[k] + v if k in device else v
            else:
                sums[k] += v
        mx.eval(result.loss, list(device.values()), grads)  # one sync per micro-batch bounds memory
    if device:  # one read for all of them
        for k, v in zip(device, mx.stack(list(device.values())).tolist()):
            sums[k] += v
    return sums, grads


def evaluate(engine, model, pairs: list[TokenizedPair], cfg: Config, group: Group, step: int) -> dict:
    """``eval/`` metrics over held-out ``pairs``, each rank taking its shard."""
    model.eval()
    norm = global_norm(pairs, cfg.orpo.nll_scope)
    mine = sampler.rank_shard(pairs, group.rank, group.size)
    sums, _ = run_micro_batches(engine, mine, norm, cfg.train.micro_batch_pairs, with_grads=False)
    sums = group.all_sum_scalars(sums, step, "all_sum of eval metrics")
    model.train()
    return finalize_metrics(sums, cfg.orpo.lam, prefix="eval/")


def train_step(step, engine, model, optimizer, train_pairs, cfg: Config, group: Group, stop_requested: bool = False):
    """One optimizer step.

    Returns ``(metrics, applied, stop)``: ``applied`` is False when the loss or
    gradients were not finite and the update was skipped (the same decision on
    every rank, since both are all-reduced); ``stop`` is True on every rank when
    any rank asked to stop (signal), agreed through the same all-reduce.
    """
    t = cfg.train
    start = time.perf_counter()
    mx.random.seed(step_seed(t.seed, step))  # dropout etc.: a pure function of the step
    batch = [train_pairs[i] for _, i in sampler.global_batch(step, len(train_pairs), t.global_batch_pairs, t.seed)]
    norm = global_norm(batch, cfg.orpo.nll_scope)
    mine = sampler.rank_shard(batch, group.rank, group.size)
    sums, grads = run_micro_batches(engine, mine, norm, t.micro_batch_pairs, with_grads=True)
    if grads is None:  # this rank got no pairs this step: contribute zeros
        grads = tree_map(mx.zeros_like, model.trainable_parameters())
    reduce_start = time.perf_counter()
    grads = group.all_sum_tree(grads, step)  # evaluated inside: this times the communication alone
    reduce_seconds = time.perf_counter() - reduce_start
    sums = group.all_sum_scalars({**sums, "stop": float(stop_requested)}, step)
    if t.grad_clip > 0:
        grads, grad_norm = optim.clip_grad_norm(grads, t.grad_clip)
    else:
        grad_norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for _, g in tree_flatten(grads)))
    grad_norm = float(grad_norm)
    metrics = finalize_metrics(sums, cfg.orpo.lam)
    lr = learning_rate(step, t)
    finite = math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)
    if finite:
        optimizer.learning_rate = lr
        optimizer.update(model, grads)
        mx.eval(model.trainable_parameters(), optimizer.state)
    seconds = time.perf_counter() - start
    metrics.update({
        "grad_norm": grad_norm,
        "learning_rate": lr,
        "tokens_per_second": sums["input_tokens"] / seconds,
        "pairs_per_second": sums["pairs"] / seconds,
        "peak_memory_gb": peak_memory_gb(),
        "perf/step_seconds": seconds,
        "perf/allreduce_seconds": reduce_seconds,
        "prefix_sharing/fallback_pairs": sums["fallback_pairs"],
    })
    return metrics, finite, sums["stop"] > 0


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of an optimizer step, so a resumed run draws the same numbers."""
    return (seed * 1_000_003 + step) % (2**63)


def train(cfg: Config, group: Optional[Group] = None, loaded=None, dataset=None) -> TrainResult:
    """Run a whole training job described by ``cfg``.

    Args:
        cfg: the resolved config.
        group: the process group (world size 1 when None).
        loaded: an already loaded model (``dtrain.models.LoadedModel``); loaded
            from ``cfg.model`` when None.
        dataset: already tokenized pairs (``dtrain.data.Dataset``); built from
            ``cfg.data`` when None.
    Raises:
        UserError: bad model, data or config; an unusable output folder or
            checkpoint; too many non-finite steps in a row.
    """
    group = replace(group or Group(), timeout_s=cfg.distributed.collective_timeout_s)  # arms the collective watchdog
    warn_if_slow()  # an API caller that imported MLX before dtrain.blas.setup() learns what it costs
    t = cfg.train
    mx.random.seed(t.seed)
    if loaded is None:
        from .models import load_model

        loaded = load_model(cfg.model.path, cfg.model.dtype)
    model = loaded.model
    cache_entries = []  # tokenized pairs for OUT/data_cache, written once this run owns OUT
    if dataset is None:
        from .data import load_dataset

        dataset = load_dataset(cfg.data, loaded.tokenizer, t.seed, log=_stderr if group.is_main else None,
                               cache_dir=Path(t.output_dir) / "data_cache")
        cache_entries = dataset.cache_entries
    if not dataset.train:
        raise UserError("no training pairs left after loading and filtering the data")
    apply_lora(model, cfg.lora)
    model.train()
    engine = make_engine(cfg, model)
    lora_shapes = {k: list(v.shape) for k, v in tree_flatten(model.trainable_parameters())}
    resolved = to_dict(cfg)
    identity = {"model": loaded.identity, "data": dataset.fingerprint, "lora shapes": lora_shapes}
    handshake(group, {"config": resolved, **identity})

    out = Path(t.output_dir)
    ckpt_root = out / "checkpoints"
    _main_rank_check(group, lambda: _check_output(out, ckpt_root, t.resume, ckpt.estimate_bytes(model)))
    if cache_entries:
        from .data import write_entries

        write_entries(cache_entries)
    # bias_correction: the standard AdamW (Loshchilov & Hutter; PyTorch, TRL); MLX defaults to off
    optimizer = optim.AdamW(learning_rate=learning_rate(1, t), weight_decay=t.weight_decay, bias_correction=True)
    optimizer.init(model.trainable_parameters())
    start_step, skipped, run_dir = 1, 0, None
    resume_from = _resume_path(t.resume, ckpt_root, group)
    if resume_from is not None:
        saved = ckpt.load_checkpoint(resume_from)
        ckpt.check_compatible(saved, identity, t.global_batch_pairs)
        ckpt.restore(saved, model, optimizer)
        start_step, skipped = saved.state["step"] + 1, saved.state["skipped_steps"]
        run_dir = Path(saved.state["tensorboard_dir"]) if saved.state.get("tensorboard_dir") else None
    if group.is_main and (run_dir is None or not run_dir.is_dir()):
        run_dir = new_run_dir(out / "tb")
    log = RunLogger(run_dir if group.is_main else None, t.steps, progress=t.progress,
                    first_step=start_step - 1, purge_step=start_step if resume_from else None)
    result = TrainResult(steps=t.steps, run_dir=run_dir if group.is_main else None, skipped_steps=skipped)
    valid = dataset.valid[: t.eval_pairs] if t.eval_pairs > 0 else dataset.valid
    extra = {"base_model": loaded.source}
    stop = StopRequest()

    def save(step: int) -> None:
        if group.is_main:
            state = {"skipped_steps": result.skipped_steps, "rng": {"seed": t.seed, "per_step": "step_seed(seed, step)"},
                     "data": data_position(step, len(dataset.train), t.global_batch_pairs, t.seed),
                     "tensorboard_dir": str(run_dir), "world_size": group.size,
                     "global_batch_pairs": t.global_batch_pairs, "identity": identity}
            ckpt.save_checkpoint(ckpt_root, step, model, optimizer, cfg.lora, state, resolved)
            ckpt.prune(ckpt_root, max(t.keep_last, 1))

    try:
        stop.install()
        log.config(resolved)
        log.message(f"model {loaded.source}; {len(dataset.train)} train / {len(valid)} valid pairs; "
                    f"world size {group.size}; engine {engine.name}"
                    + (f"; resumed from {resume_from} at step {start_step}" if resume_from else ""))
        if valid and resume_from is None:
            result.evals[0] = evaluate(engine, model, valid, cfg, group, 0)
            log.scalars(0, result.evals[0])
        skipped_in_row = 0
        step = start_step - 1
        for step in range(start_step, t.steps + 1):
            metrics, applied, stopping = train_step(step, engine, model, optimizer, dataset.train, cfg, group, stop.requested)
            if not applied:
                result.skipped_steps += 1
                skipped_in_row += 1
                log.message(f"step {step}: non-finite loss or gradient, update skipped")
            else:
                skipped_in_row = 0
            metrics["skipped_steps"] = float(result.skipped_steps)
            result.history.append(metrics)
            log.scalars(step, metrics)
            log.progress(step, metrics)
            if skipped_in_row >= t.max_skipped_steps:
                save(step)
                batch = sampler.global_batch(step, len(dataset.train), t.global_batch_pairs, t.seed)
                sources = ", ".join(dataset.train[i].source or str(i) for _, i in batch[:8])
                raise UserError(f"step {step}: {skipped_in_row} steps in a row had a non-finite loss or gradient "
                                f"(last batch: {sources}); saved a checkpoint and stopped")
            if stopping:
                save(step)
                log.message(f"stopped by signal after step {step}; checkpoint saved, resume with train.resume=auto")
                result.steps = step
                result.stopped = True
                return result
            if cfg.distributed.check_sync_every and step % cfg.distributed.check_sync_every == 0:
                check_in_sync(group, model.trainable_parameters(), step)
            if valid and t.eval_every and step % t.eval_every == 0 and step != t.steps:
                result.evals[step] = evaluate(engine, model, valid, cfg, group, step)
                log.scalars(step, result.evals[step])
            if t.save_every and step % t.save_every == 0 and step != t.steps:
                save(step)
        if valid:
            result.evals[t.steps] = evaluate(engine, model, valid, cfg, group, t.steps)
            log.scalars(t.steps, result.evals[t.steps])
        save(t.steps)
        if group.is_main:
            result.adapter_dir = save_adapter(model, cfg.lora, out / "adapters", extra)
            final = {**(result.history[-1] if result.history else {}), **result.evals.get(t.steps, {})}
            log.hparams(resolved, final)
            log.message(f"adapter written to {result.adapter_dir}")
    finally:
        stop.uninstall()
        log.close()
    return result


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def data_position(step: int, n_pairs: int, global_batch_pairs: int, seed: int) -> dict:
    """Where the global pair stream stands after ``step``: epoch, cursor, seed."""
    epoch, cursor = divmod(step * global_batch_pairs, n_pairs)
    return {"epoch": epoch, "cursor": cursor, "shuffle_seed": seed}


def _check_output(out: Path, ckpt_root: Path, resume: Optional[str], need_bytes: int) -> None:
    """Writable, room for a checkpoint, and no earlier run's checkpoints unless resuming.

    A fresh run into a folder holding another run's checkpoints would mix the
    two (``resume: auto`` would later pick the other run's newest step).
    """
    ckpt.check_output_dir(out, need_bytes)
    if resume is None:
        earlier = ckpt.find_latest(ckpt_root, report=lambda _: None)
        if earlier is not None:
            raise UserError(f"{out} already holds checkpoints of an earlier run (newest {earlier.name}); "
                            f"continue it with train.resume=auto, or choose another train.output_dir")


def _resume_path(resume: Optional[str], root: Path, group: Group) -> Optional[Path]:
    if resume is None:
        return None
    if resume == "auto":
        return ckpt.find_latest(root, report=lambda m: print(m, file=sys.stderr) if group.is_main else None)
    return Path(resume)


def _main_rank_check(group: Group, check) -> None:
    """Run ``check`` on rank 0; every rank raises when it failed there."""
    message = ""
    if group.is_main:
        try:
            check()
        except UserError as err:
            message = str(err)
    failed = group.all_sum_scalars({"failed": float(bool(message))}, None, "all_sum of the output-folder check")["failed"] > 0
    if message:
        raise UserError(message)
    if failed:
        raise UserError("rank 0 could not prepare the output folder; see its message")


class StopRequest:
    """SIGINT/SIGTERM set ``requested``; the loop stops at the next step boundary.

    Handlers are installed only in the main thread and restored on exit.
    """

    def __init__(self):
        self.requested = False
        self._old = {}

    def _handle(self, signum, _frame):
        self.requested = True

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
