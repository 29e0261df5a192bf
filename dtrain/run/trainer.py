"""The training loop: data -> engine -> all-reduce -> AdamW step -> logs, adapter.

Read top to bottom: :func:`train` calls :func:`setup` (model, data, LoRA,
engine, handshake, output folder, optimizer, resume, logger, the
``step.Step``) and then :func:`loop`, which keeps cadence only: a step, its
record, and when to stop, check, evaluate and save.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from . import checkpoint as ckpt, output
from .. import sampler
from ..blas import warn_if_slow
from ..config import Config, to_dict
from ..config_checks import unread_keys
from ..contract import TB_RUN_VAR
from ..data.templates import template_date, trained_template
from ..device import resolve_auto
from ..distributed import Group, check_in_sync, handshake, main_rank_check
from ..engine import fit_dataset, make_engine, make_objective
from . import best as keep_best, lambda_control
from .evaluation import evaluate_and_log
from .held_out import held_out_steering, steering_notices
from ..errors import UserError
from ..files import OutputDir, storage
from ..identity import settings
from ..lora import (adapter_keys_source, apply_lora, load_adapter_weights, lora_from_adapter, replaced_by_adapter,
                    save_adapter)
from ..memory import is_out_of_memory, out_of_memory_text, run_budget_bytes, wired_limit
from ..notices import for_rank
from ..types import example_noun, refuse_ids_past_vocabulary
from .optimizer import AdamWStep, schedule_notice
from .reference import ReferenceLogps, engine_settings, init_adapter_identity, reference_pass
from .result import TrainResult
from .step import Step
from .stop import StopRequest
from .tracking import RunLogger, tensorboard_dir


def _nothing(*_) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """Explicit entry points into a run, for tests (fault injection, recording what
    each step trains); the defaults change nothing.

    ``engine(engine) -> engine`` wraps the engine :func:`setup` builds;
    ``before_step(step, run)`` runs at the start of each optimizer step (inside
    it: a signal that arrives there is agreed in this step); ``after_step(step, run)``
    right after the update, before the step is logged; ``reference_engine(engine) ->
    engine`` wraps the engine of DPO's reference pass; ``stop_signals=False`` leaves
    SIGINT/SIGTERM/SIGHUP to the caller's handlers (no stop after the step, no save).
    """

    engine: Callable = lambda engine: engine
    before_step: Callable = _nothing
    after_step: Callable = _nothing
    reference_engine: Callable = lambda engine: engine
    stop_signals: bool = True


@dataclass
class Run:
    """Everything :func:`loop` needs, built by :func:`setup`; ``state.step`` is the last step done."""

    cfg: Config
    group: Group
    model: Any
    engine: Any
    optimizer: Any
    sampler: sampler.Sampler
    train_pairs: list
    valid: list
    state: ckpt.RunState
    log: RunLogger
    stop: StopRequest
    resolved: dict
    base_model: dict
    result: TrainResult
    step: Optional[Step] = None
    resumed_from: Optional[Path] = None
    cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    hooks: Hooks = Hooks()
    chat_template: Optional[str] = None  # the prompts' template, if not the model's (adapter_config.json)
    best: keep_best.BestAdapter = field(default_factory=keep_best.BestAdapter)  # train.keep_best: rank 0's copy
    lock: Optional[output.OutputLock] = None  # rank 0's hold on the output folder

    @property
    def checkpoints(self) -> Path:
        return OutputDir(Path(self.cfg.train.output_dir)).checkpoints


def train(cfg: Config, group: Optional[Group] = None, loaded=None, dataset=None, hooks: Hooks = Hooks()) -> TrainResult:
    """Run a whole training job described by ``cfg``.

    Args:
        cfg: the resolved config.
        group: the process group (world size 1 when None).
        loaded: an already loaded model (``dtrain.models.LoadedModel``); loaded
            from ``cfg.model`` when None.
        dataset: already tokenized pairs (``dtrain.data.Dataset``); built from
            ``cfg.data`` when None.
        hooks: test entry points (:class:`Hooks`); none by default.
    Raises:
        UserError: bad model, data or config; a global batch larger than the
            training pairs; an output folder in use by another run, unusable,
            or holding another run's checkpoints or adapter; a checkpoint that cannot be
            continued; too many non-finite steps in a row; the device ran out of
            memory (MLX's error, :func:`dtrain.memory.is_out_of_memory`).
    """
    run = None
    try:
        run = setup(cfg, group, loaded, dataset, hooks)
        with run.cleanup:  # stop handlers, event file, output-folder lock
            return loop(run)
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        # in the step after the last one done, or in an evaluation; or in setup (DPO's reference pass)
        where = f"after step {run.state.step} of {cfg.train.steps}" if run else "while setting up the run"
        raise UserError(out_of_memory_text(where, cfg.engine.memory_budget_gb, err)) from None


def loop(run: Run) -> TrainResult:
    """Steps ``state.step + 1 .. train.steps``; evaluations, checkpoints, the adapter at the end."""
    t, result = run.cfg.train, run.result
    if eval_pending(run):  # step 0, or a checkpoint saved before its step's evaluation (a stop, skipped steps)
        if end := evaluate_and_steer(run, run.state.step):
            return end(run, run.state.step)
        if run.resumed_from is not None:  # its checkpoint then covers it: a later resume does not log it again
            held(run, lambda: save(run, run.state.step))
    elif run.state.step < t.steps and keep_best.early_stop_due(run):  # a resumed run that had stopped early
        return end_early(run, run.state.step, again=True)
    # the end of a run is idempotent: a resume of the checkpoint that closed it evaluates, saves and logs nothing
    # again (decided before the loop: after it, a resumed run that trained its last steps is at train.steps too);
    # one cut after a checkpoint at the step a resume now ends at has its end written. A dtrain before
    # RunState.closed left it None: at train.steps with its evaluation, taken as closed
    closed = run.state.closed if run.state.closed is not None else not run.valid or str(t.steps) in run.state.evals
    done = run.resumed_from is not None and run.state.step == t.steps and closed
    if run.state.step < t.steps:
        run.log.doing(first_step_text(run))
    for step in range(run.state.step + 1, t.steps + 1):
        run.hooks.before_step(step, run)
        out = run.step(step, run.stop)
        run.hooks.after_step(step, run)
        record(run, step, out.metrics, out.applied)
        if run.state.skipped_in_row >= t.max_skipped_steps:
            # every rank raises after rank 0 saved: one that exits first makes ./launch abort a rank 0 still saving
            main_rank_check(run.group, lambda: save_stopped(run, step), "save its checkpoint", step)
            sources, streak = ", ".join(p.source or "?" for p in out.batch[:8]), run.state.skipped_in_row
            raise UserError(f"step {step}: {streak} steps in a row had {skip_reason(out.metrics, 'a ')} "
                            f"(last batch: {sources}); saved a checkpoint and stopped")
        if out.stop:
            return end_stopped(run, step)
        if _every(step, run.cfg.distributed.check_sync_every):
            check_in_sync(run.group, run.model.trainable_parameters(), step)
        if run.valid and _every(step, t.eval_every) and step != t.steps:
            if end := evaluate_and_steer(run, step):
                return end(run, step)
        if _every(step, t.save_every) and step != t.steps:
            held(run, lambda: save(run, step))
    if run.valid and str(t.steps) not in run.state.evals:
        if evaluate_and_steer(run, t.steps, may_stop=False) is end_early:  # the run ends here anyway
            run.log.message(f"step {t.steps}: {keep_best.no_new_best(t)}: an early stop at the run's last step "
                            f"(a resume with a larger train.steps trains no further)")
    # the evaluations decide it, so a resume of this run's end says the same
    result.early_stopped = keep_best.early_stop_due(run)
    if not done:
        log_hparams(run, t.steps)
        save(run, t.steps, closed=True)
    finish(run)
    return result


def held(run: Run, write: Callable[[], None]) -> None:
    """Rank 0's ``write`` between two collectives; with several ranks its failure is held
    (``StopRequest.fail``): the next step or evaluation agrees to stop, and rank 0 raises it then
    (:func:`raise_held`), as the other ranks stop with it."""
    try:
        write()
    except UserError as err:
        if run.group.size == 1:
            raise
        run.stop.fail(err)


def raise_held(run: Run) -> None:
    """Rank 0 raises the failure :func:`held` kept (before it saves or writes the adapter), if any."""
    if run.group.is_main and run.stop.failure is not None:
        raise run.stop.failure


def _every(step: int, n: int) -> bool:
    """Whether a cadence of every ``n`` steps (0 = never) falls on ``step``."""
    return bool(n) and step % n == 0


def eval_pending(run: Run) -> bool:
    """Whether the step the run starts from (0, or a resumed checkpoint's, before the last) is an
    evaluation step not evaluated yet: a stop or too many skipped steps save before the evaluation."""
    return run.state.step < run.cfg.train.steps and evaluation_due(run.valid, run.state, run.cfg.train)


def evaluation_due(valid: list, state: ckpt.RunState, t) -> bool:
    """Whether ``state.step`` (0, an ``eval_every`` step or the last, ``t``: the train config) is one to
    evaluate and was saved before it was (a stop, too many skipped steps)."""
    step = state.step
    return (bool(valid) and (step == 0 or _every(step, t.eval_every) or step == t.steps)
            and str(step) not in state.evals)


def evaluate_and_steer(run: Run, step: int, may_stop: bool = True) -> Optional[Callable[[Run, int], TrainResult]]:
    """Evaluate after ``step``, then let the λ controller and ``train.keep_best`` read the numbers.
    Returns how the run ends here, if it does (the same on every rank: the eval sums and the stop
    flag are all-reduced): :func:`end_stopped` when a signal came during the evaluation (with
    ``may_stop``; cut short, it is done again first on resume), :func:`end_early` when
    ``train.early_stop_evals`` says stop; None to go on."""
    if evaluate_and_log(run, step, may_stop):
        return end_stopped
    lambda_control.steer(run, step)
    return end_early if keep_best.track(run, step) else None


def end_stopped(run: Run, step: int) -> TrainResult:
    """Checkpoint ``step`` of a run a signal stopped (after the step, or during its evaluation)."""
    run.stop.agreed = True  # by every rank, in the step's or the evaluation's all-reduce
    save_stopped(run, step)
    run.log.message(f"stopped by signal {f'after step {step}' if step else 'before step 1'}; checkpoint saved, "
                    f"continue with --train.resume auto")
    run.result.steps, run.result.stopped, run.result.stop_signal = step, True, run.stop.signal
    return run.result


def end_early(run: Run, step: int, again: bool = False) -> TrainResult:
    """Checkpoint and adapters of a run that ``train.early_stop_evals`` stopped after ``step``;
    ``again``: a resume of that checkpoint, which only rewrites the adapter folders (the same bytes)."""
    run.result.steps, run.result.early_stopped = step, True  # before log_hparams: its `best` text says so
    if again:
        run.log.message(f"step {step}: {keep_best.no_new_best(run.cfg.train)} stopped this run early; a resume "
                        f"trains no further")
    else:
        run.log.message(f"step {step}: {keep_best.no_new_best(run.cfg.train)}; stopping early")
        log_hparams(run, step)
        save(run, step, closed=True)
    finish(run)
    return run.result


def run_template_date(cfg: Config, group: Group) -> str:
    """``data.template_date`` as the run renders it: the config's; else the day the checkpoint ``train.resume``
    continues recorded; else rank 0's today. Every rank gets rank 0's (clocks and time zones may differ)."""
    if cfg.data.template_date is not None:
        return cfg.data.template_date
    day = ""
    if group.is_main:
        day = (ckpt.recorded_setting(cfg.train.resume, OutputDir(Path(cfg.train.output_dir)).checkpoints,
                                     "data.template_date") or template_date(cfg.data))
    return group.broadcast_text(day, None, "data.template_date of rank 0")


def setup(cfg: Config, group: Optional[Group] = None, loaded=None, dataset=None, hooks: Hooks = Hooks()) -> Run:
    """Model, data, LoRA, engine, handshake, output folder, optimizer, resume, logger: a ready :class:`Run`.

    What it takes (the output-folder lock, signal handlers, the event file) is
    released by ``run.cleanup``, or here when a later part fails.
    """
    group = replace(group or Group(), timeout_s=cfg.distributed.collective_timeout_s)  # arms the collective watchdog
    own_lora = cfg.lora
    if cfg.train.init_adapter:  # the adapter's rank, scale and keys are the run's LoRA
        cfg = replace(cfg, lora=lora_from_adapter(cfg.lora, cfg.train.init_adapter))
    warn_if_slow()  # an API caller that imported MLX before dtrain.blas.setup() learns what it costs
    notice = for_rank(group.is_main)  # the run's notices, rank 0's only (run.log.message once the logger exists)
    for line in unread_keys(cfg) if notice else ():
        notice(line)
    if notice and (replaced := replaced_by_adapter(own_lora, cfg.lora)):
        notice(f"train.init_adapter {cfg.train.init_adapter} sets the LoRA's shape: {', '.join(replaced)} "
               "(the adapter's values are trained, not the config's)")
    cfg = replace(cfg, data=replace(cfg.data, template_date=run_template_date(cfg, group)))
    spelled = settings(to_dict(cfg))  # `auto` as written, which a checkpoint that recorded the word compares
    chosen, auto = resolve_auto(cfg)  # the device's `auto` values, decided once here, shown in the run's first line
    ran = settings(to_dict(chosen), to_dict(resolve_auto(Config())[0]))  # what a resume compares: the choices
    cfg = replace(cfg, lora=chosen.lora)  # the LoRA product's dtype, as the run's settings and checkpoints record it
    t = cfg.train
    mx.random.seed(t.seed)
    if loaded is None:
        from ..models import load_model

        loaded = load_model(cfg.model.path, cfg.model.dtype)
    model = loaded.model
    cache_entries, cache_bytes = [], 0  # tokenized pairs for OUT/data_cache, written once this run owns OUT
    by_prompt = False  # a caller's own train/valid pairs were split as it chose
    if dataset is None:
        from ..data import entries_bytes, load_dataset

        dataset = load_dataset(cfg.data, loaded.tokenizer, t.seed, log=notice,
                               cache_dir=OutputDir(Path(t.output_dir)).data_cache,
                               pairwise=cfg.objective.kind != "sft",  # SFT trains preference rows' chosen side
                               progress=t.progress)
        cache_entries, by_prompt = dataset.cache_entries, dataset.by_prompt
        cache_bytes = entries_bytes(cache_entries)
    objective = make_objective(cfg)
    dataset = fit_dataset(objective, dataset)
    refuse_ids_past_vocabulary((*dataset.train, *dataset.valid), model)
    steering = held_out_steering(cfg, len(dataset.train), len(dataset.valid))
    pairs_sampler = sampler.for_run(cfg, dataset.train)
    apply_lora(model, cfg.lora, adapter_keys_source(t.init_adapter) if t.init_adapter else "lora.keys")
    if t.init_adapter:
        load_adapter_weights(model, t.init_adapter)
    model.train()
    engine = hooks.engine(make_engine(chosen.engine, model, objective, report=notice))
    resolved = to_dict(cfg)
    lora_shapes = {k: list(v.shape) for k, v in tree_flatten(model.trainable_parameters())}
    init_adapter = init_adapter_identity(cfg)  # its weights: one path may name other files on other machines
    valid = dataset.valid[: t.eval_pairs] if t.eval_pairs > 0 else dataset.valid
    held_out = len(dataset.valid)
    # the token ids: a template file may differ
    data = ckpt.data_identity(dataset.fingerprint, dataset.train, valid, by_prompt)
    handshake(group, {"config": resolved, "model": loaded.identity, "data": data, "lora shapes": lora_shapes,
                      "initial adapter": init_adapter})
    for line in steering_notices(cfg, steering, len(valid), len(dataset.valid)) if notice else ():
        notice(line)
    state = ckpt.RunState(step=0, skipped_steps=0, run_id=ckpt.new_run_id(), settings=ran,
                          schedule_steps=t.steps, world_size=group.size,
                          data=data,
                          model=loaded.identity, lora_shapes=lora_shapes, init_adapter=init_adapter)
    out = OutputDir(Path(t.output_dir))
    with contextlib.ExitStack() as cleanup:
        stop = StopRequest()  # installed below; restored last, so a stop while the log closes is no traceback
        cleanup.callback(stop.uninstall)
        plan = output.DiskPlan(output.estimate_bytes(model), t.steps, t.save_every, max(t.keep_last, 1),
                               2 if t.keep_best is not None else 1,  # keep_best: adapters/ and adapters-last/
                               cache_bytes)
        lock = main_rank_check(group, lambda: output.prepare_output(out.root, plan, t.resume is not None),
                               "prepare the output folder")
        if lock is not None:
            cleanup.callback(lock.release)
        optimizer = AdamWStep(chosen.train, model.trainable_parameters(), cfg.lora.plus_ratio)
        # a resume is checked (and refused) before the run writes its caches or computes DPO's reference
        resumed = ckpt.resume(t.resume, out.checkpoints, state, lambda s: [i for _, i in pairs_sampler.global_batch(s)],
                              group, report=notice, model_aliases=loaded.aliases, spelled=spelled,
                              like=(dict(tree_flatten(model.trainable_parameters())), dict(tree_flatten(optimizer.state))))
        if resumed is not None and resumed.state.step > t.steps:
            raise UserError(f"resume: {resumed.path} is at step {resumed.state.step}, beyond train.steps={t.steps}; "
                            f"raise train.steps to continue it")
        if cache_entries:
            from ..data import write_entries

            write_entries(cache_entries)
        if getattr(objective, "needs_reference", False):  # before a resume loads its weights: step 0's model
            ref_engine = make_engine(chosen.engine, model, ReferenceLogps(), report=None)
            # the reference pass's micro-batches, whose auto plans count
            batches = [*sampler.micro_batches(dataset.train, t.micro_batch_pairs),
                       *sampler.micro_batches(valid, t.micro_batch_pairs)]
            ref_settings = engine_settings(ref_engine, chosen.engine.kernels, batches)
            ref_engine = hooks.reference_engine(ref_engine)
            # only the held-out pairs evaluations run (train.eval_pairs), cut into their micro-batches: at step 0
            # the policy's log-probs are then the reference's bit for bit (fit_dataset gave this copy)
            dataset.valid = valid
            dataset = reference_pass(cfg, model, dataset, loaded.identity, group, ref_engine, out.data_cache, notice,
                                     init_adapter=state.init_adapter, settings=ref_settings)
            valid = dataset.valid  # the same held-out pairs, now carrying their reference log-probs
        if resumed is not None:
            ckpt.restore(model, optimizer, resumed.adapter, resumed.optimizer)
            if notice is not None and (masks := ckpt.world_size_notice(resumed.state, group.size, cfg.lora.dropout)):
                notice(masks)
            state = replace(resumed.state, world_size=group.size)
            optimizer.schedule_steps = state.schedule_steps
        if notice and (line := schedule_notice(t, state.step, state.schedule_steps, resumed is not None)):
            notice(line)
        state.lambda_control = lambda_control.start(cfg.orpo, state.lambda_control)
        # a launcher's restart from step 0 names the TensorBoard run its failed attempt began: continued, not orphaned
        kept = state.tensorboard_run if resumed is not None else os.environ.get(TB_RUN_VAR)
        # a checkpoint saved before its step's evaluation is logged at that step again, as a resume cut while it
        # saved that step again had logged it: the START drops that step too, and its training scalars are logged
        # again (a checkpoint of a dtrain before RunState.last_metrics keeps its step)
        again = (resumed is not None and evaluation_due(valid, state, t)
                 and (state.step == 0 or bool(state.last_metrics)))
        purge = None if resumed is None else state.step if again else state.step + 1

        # with several ranks rank 0's failed writes are agreed: at once here, mid-run at the next collective
        def open_log() -> RunLogger:
            return RunLogger(tensorboard_dir(out.root, kept), t.steps, progress=t.progress, first_step=state.step,
                             purge_step=purge, hold=stop.fail if group.size > 1 else None)

        log = main_rank_check(group, open_log, "create its TensorBoard event file") or RunLogger(None, t.steps)
        if again and state.last_metrics:
            log.scalars(state.step, state.last_metrics)
        run_dir = log.run_dir
        state.tensorboard_run = str(run_dir.relative_to(out.root)) if group.is_main else None
        cleanup.push(lambda failed, *_: log.close(quiet=failed is not None))  # a failing run keeps its own error
        if hooks.stop_signals:
            stop.install()
        cleanup.enter_context(wired_limit(model, report=notice))  # Metal only
        result = TrainResult(steps=t.steps, run_dir=run_dir if group.is_main else None, skipped_steps=state.skipped_steps,
                             evals={int(k): v for k, v in state.evals.items()}, best_metric=t.keep_best,
                             nll_of=f"the {'prompts and ' if objective.nll_scope == 'full' else ''}completions")
        if t.keep_best is not None and state.evals:
            result.best = keep_best.pick_best(state.evals, t.keep_best, t.keep_best_guard)
        log.config(resolved, auto)
        noun = example_noun(cfg.objective.kind)
        at = f"at step {state.step + 1}" if state.step < t.steps else f"after its last step, {state.step}"
        of = f" of {held_out}" if len(valid) < held_out else ""  # train.eval_pairs evaluates fewer
        log.message(f"model {loaded.source}; {len(dataset.train)} train / {len(valid)}{of} valid {noun}s; "
                    f"world size {group.size}; engine {engine.name}"
                    + (f"; auto: {', '.join(f'{k} {v}' for k, v in auto.items())}" if auto else "")
                    + (f"; resumed from {resumed.path} {at}" if resumed else ""))
        step = Step(engine, model, optimizer, pairs_sampler, dataset.train, t, group,
                    hyper=lambda_control.hyper(cfg.orpo, state.lambda_control, engine.objective.hyper()),
                    memory_budget=run_budget_bytes(cfg.engine.memory_budget_gb))
        kept = keep_best.BestAdapter(state.best_step, resumed.best if resumed and group.is_main else None)
        return Run(cfg, group, model, engine, optimizer, pairs_sampler, dataset.train, valid, state, log, stop,
                   resolved, {**loaded.reference, "source": loaded.source}, result, step,
                   resumed.path if resumed else None, cleanup.pop_all(), hooks,
                   trained_template(loaded.tokenizer, cfg.data, getattr(dataset, "messages", False)), kept, lock)


def first_step_text(run: Run) -> str:
    """What the next step does, shown until it ends (the first step also warms MLX up)."""
    t, size, noun = run.cfg.train, run.group.size, example_noun(run.cfg.objective.kind)
    mine = math.ceil(t.global_batch_pairs / size)
    return (f"step {run.state.step + 1}: forward+backward of {t.global_batch_pairs} {noun}s "
            f"(<= {mine} on each of {size} rank(s), micro-batches of {min(mine, t.micro_batch_pairs)})")


def record(run: Run, step: int, metrics: dict, applied: bool) -> None:
    """Count a skipped update (the streak too: a checkpoint carries it), name a zero gradient, log the step's
    metrics, advance the state and the bar."""
    run.state.skipped_in_row = 0 if applied else run.state.skipped_in_row + 1
    if not applied:
        run.state.skipped_steps += 1
        run.log.message(f"step {step}: {skip_reason(metrics)}, update skipped")
    elif metrics["grad_norm"] == 0.0:  # trained on nothing: said, as a skipped step is
        run.log.message(f"step {step}: zero gradient: the loss gives this batch no learning signal (flat or "
                        f"saturated for every {example_noun(run.cfg.objective.kind)}: check the objective's "
                        f"hyper-parameters and the learning rate); the update is AdamW's momentum alone")
    metrics["skipped_steps"] = float(run.state.skipped_steps)
    run.state.step, run.state.last_metrics = step, metrics
    run.result.skipped_steps = run.state.skipped_steps
    run.result.history.append(metrics)
    run.log.scalars(step, metrics)
    run.log.progress(step, metrics)


def skip_reason(metrics: dict, article: str = "") -> str:
    """Why a step's update was skipped, from its metrics: ``article`` + a non-finite loss or gradient, or else
    LoRA weights the update would have made NaN or inf (a learning rate near float32's range, say)."""
    if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        return f"{article}non-finite loss or gradient"
    return f"non-finite LoRA weights after the update (learning rate {metrics['learning_rate']:.3g})"


def save(run: Run, step: int, closed: bool = False) -> None:
    """Rank 0 writes checkpoint ``step`` after the event file is on disk (so it covers every logged step);
    ``closed``: the run's end record was written (:func:`log_hparams`), so a resume at ``step`` is done.

    Raises:
        UserError: the output folder was removed or replaced since the run took it.
    """
    raise_held(run)
    if run.group.is_main:
        if run.lock is not None and run.lock.lost():
            raise UserError(f"output folder {run.cfg.train.output_dir} was removed or replaced while this run ran (its "
                            f"lock file is not the one this run holds); step {step} is not saved there, and the "
                            f"checkpoints and TensorBoard events written before went with the old folder")
        state = replace(run.state, step=step, position=run.sampler.position(step), closed=closed)
        run.log.flush()
        ckpt.drop_left(run.checkpoints, state.run_id, step)  # before the save: a kill after it keeps no step left
        ckpt.save_checkpoint(run.checkpoints, state, run.model, run.optimizer, run.cfg.lora, run.resolved,
                             run.base_model, run.chat_template, run.best.weights)
        ckpt.prune(run.checkpoints, max(run.cfg.train.keep_last, 1), state.run_id)


def save_stopped(run: Run, step: int) -> None:
    """Checkpoint ``step`` of a run stopped before its end (a signal, ``train.max_skipped_steps``). Stopped in
    its last step with nothing to evaluate, it is done: its resume writes only the adapter, so the run's
    HPARAMS record goes with this checkpoint, as at an uninterrupted run's end."""
    raise_held(run)
    closed = step == run.cfg.train.steps and not run.valid
    if closed:
        log_hparams(run, step)
    save(run, step, closed)


def log_hparams(run: Run, step: int) -> None:
    """Record the config with the final metrics of ``step`` (TensorBoard HPARAMS; with ``train.keep_best`` the
    kept step's eval metrics and the ``best`` text; rank 0's logger) before the run's last checkpoint, whose save
    flushes it: a run killed after that checkpoint keeps the record."""
    final = {**run.state.last_metrics, **keep_best.recorded_evals(run, step)}  # a resume at its end trains none
    run.log.hparams(run.resolved, final, step)
    keep_best.log_kept(run, step)


def finish(run: Run) -> None:
    """Rank 0 writes the adapter (the same bytes when written again; with ``train.keep_best``: the best
    step's, and the last step's to ``adapters-last/``), after removing the run's checkpoints past its last step
    (a run continued from an older checkpoint at its end saves none, whose save would remove them)."""
    raise_held(run)
    if run.group.is_main:
        t, step, out = run.cfg.train, run.state.step, OutputDir(Path(run.cfg.train.output_dir))
        ckpt.drop_left(run.checkpoints, run.state.run_id, step)
        ckpt.prune(run.checkpoints, max(t.keep_last, 1), run.state.run_id)
        kept = f"; checkpoint {ckpt.checkpoint_dir(run.checkpoints, step)} holds the same weights"
        with storage(f"write the adapter {out.adapters_last}", kept):
            weights = keep_best.last_and_best(run, out.adapters_last)
        if weights is not None:  # the best step's weights: the last checkpoint's adapter is the last step's
            kept = (f"; checkpoint {ckpt.checkpoint_dir(run.checkpoints, step)} holds step {run.best.step}'s "
                    f"weights in {ckpt.BEST}")
        with storage(f"write the adapter {out.adapters}", kept):
            run.result.adapter_dir = save_adapter(run.model, run.cfg.lora, out.adapters, run.base_model,
                                                  run.chat_template, weights)
        run.log.message(f"adapter written to {run.result.adapter_dir}"
                        + (f": step {run.best.step}, the best by {t.keep_best}" if weights is not None else ""))
