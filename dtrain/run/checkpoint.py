"""Run state and checkpoints: everything needed to continue a run exactly.

A checkpoint is a folder ``OUTPUT_DIR/checkpoints/step-NNNNNNN`` holding

- the adapter in mlx-lm's format (``adapters.safetensors``, ``adapter_config.json``,
  written by :func:`dtrain.lora.write_adapter`), loadable on its own by
  ``mlx_lm.generate --adapter-path``;
- ``optimizer.safetensors``: the AdamW state (moments, step, learning rate);
- ``state.json``: the :class:`RunState`;
- ``config.yaml``: the resolved config;
- ``manifest.json``: sha256 and size of every file, written last.

It is written with :func:`dtrain.files.atomic_folder`, so a crash leaves the
previous checkpoint or the new one, never a half-written folder that looks
valid. A folder is valid only when its manifest exists, every checksum
matches and its ``state.json`` fields have their types (a hand edit may match
a rewritten manifest).

One run owns its output folder for its whole life (``dtrain.run.output``), so a
checkpoint of another run is never replaced.

:func:`resume` is the one way a run continues: rank 0 finds and validates the
checkpoint, checks every field of its :class:`RunState` against this run, and
sends the step, weights and optimizer state to every rank (other ranks never
read the checkpoint, so they need no copy of it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import shutil
import socket
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
import yaml
from mlx.utils import tree_flatten, tree_unflatten

from ..distributed import AfterRank0Error
from ..errors import TOO_DEEP, UserError
from ..identity import BEFORE_KEY, FOLLOWS, REFUSED_WHEN, as_run, beta_as_run
from ..files import OutputDir, atomic_folder, clear_set_aside, home_path, sha256_file, storage, storage_reason
from ..lora import ADAPTER_WEIGHTS, save_weights, write_adapter
from .lambda_control import LambdaState

STATE = "state.json"
OPTIMIZER = "optimizer.safetensors"
BEST = "best.safetensors"  # train.keep_best: the LoRA weights of the best evaluated step so far
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
PREFIX = "step-"
RESUME_HINT = ("These decide what is trained or what its eval/ metrics measure; set them back, or train into a new "
               "train.output_dir (README: Checkpoints and resume)")


@dataclass
class RunState:
    """What a checkpoint says about its run, besides the arrays (``state.json``).

    ``settings``, ``data``, ``model`` and ``lora_shapes`` must be equal for a
    run to continue from the checkpoint: ``settings`` holds every config key
    that decides what is trained (:func:`dtrain.identity.settings`), ``data``
    the data files' sha256 and the sha256 of the training and held-out pairs'
    token ids; an ``auto`` value is held as the device resolved it
    (``device.resolve_auto``). ``schedule_steps`` is the ``train.steps`` the learning-rate
    schedule was planned for when the run started; a resume keeps it.
    ``tensorboard_run`` is relative to the output folder, so a copied or
    moved folder logs into its own ``tb/``.
    """

    step: int
    skipped_steps: int
    run_id: str  # made when a run starts fresh, kept across resumes
    settings: dict  # identity.settings(resolved config)
    schedule_steps: int
    world_size: int  # informational: a resume may use another world size
    data: dict
    model: str  # LoadedModel.identity
    lora_shapes: dict  # parameter name -> shape
    position: dict = field(default_factory=dict)  # sampler.Sampler.position(step)
    tensorboard_run: Optional[str] = None  # relative to the output folder
    evals: dict = field(default_factory=dict)  # "step" -> eval metrics of the whole run
    lambda_control: dict = field(default_factory=dict)  # lambda_control.LambdaState (adaptive λ), {} when static
    best_step: Optional[int] = None  # train.keep_best: the step of best.safetensors
    skipped_in_row: int = 0  # non-finite steps in a row up to ``step`` (train.max_skipped_steps)
    last_metrics: dict = field(default_factory=dict)  # the training metrics of ``step``, for the hparams record
    init_adapter: Optional[str] = None  # sha256 of train.init_adapter's weights file, None without one
    # the run's end record (HPARAMS, keep_best's text) was written before this save: a resume at its step is done;
    # None: a dtrain before this field, whose checkpoint at train.steps counts as closed
    closed: Optional[bool] = None

    def must_match(self) -> dict:
        """``{name shown to the user: value}`` of every field a resume may not change, settings first.
        (A checkpoint of a dtrain that compared ``train.init_adapter`` by its text has it in ``settings``.)"""
        by_content = {} if "train.init_adapter" in self.settings else {"train.init_adapter": self.init_adapter}
        return {**self.settings, **self.data, "model.path": self.model, **by_content, "lora shapes": self.lora_shapes}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, where: str) -> "RunState":
        """Parse ``state.json``.

        Raises:
            UserError: naming the fields an older or foreign ``state.json`` lacks.
        """
        raw = json.loads(text)
        if (problem := state_problem(raw)) is not None:  # validate() refuses these first; a caller may not have
            raise UserError(f"resume: {where}: {problem}")
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in raw]
        if missing:
            raise UserError(f"resume: {where} lacks {', '.join(missing)} (written by an older dtrain?); "
                            f"it cannot be resumed by this version")
        return cls(**{k: v for k, v in raw.items() if k in names})


_AT_LEAST = {"schedule_steps": 1, "world_size": 1, "best_step": 1}  # other whole numbers (step: a stop before step 1): 0
_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text", dict: "a mapping", list: "a list"}


def _fields_problem(cls, raw: dict, prefix: str = "") -> Optional[str]:
    """The first field of dataclass ``cls`` in ``raw`` of another type (JSON's true is only a bool, an int is a
    float) or below its range, named ``prefix`` + its name; None when all fit."""
    hints = typing.get_type_hints(cls)
    for name in (f.name for f in dataclasses.fields(cls) if f.name in raw):
        value, kinds = raw[name], typing.get_args(hints[name]) or (hints[name],)
        if (isinstance(value, bool) and bool not in kinds
                or not isinstance(value, kinds + ((int,) if float in kinds else ()))):
            return (f"{prefix}{name} is {value!r:.40}, not {_KINDS[kinds[0]]}"
                    + (" or null" if type(None) in kinds else ""))
        if isinstance(value, int) and value < _AT_LEAST.get(name, 0):
            return f"{prefix}{name} is {value}, below {_AT_LEAST.get(name, 0)}"
    return None


def state_problem(raw) -> Optional[str]:
    """What is wrong with the fields ``state.json`` holds (their types and ranges), or None; a missing field is
    :meth:`RunState.from_json`'s to name. Its manifest may match a hand edit, so its content is checked too."""
    if not isinstance(raw, dict):
        return f"{str(raw)[:40]} is not a JSON object"
    if (problem := _fields_problem(RunState, raw)) is not None:
        return problem
    for key, metrics in raw.get("evals", {}).items():  # "step" -> that evaluation's metrics
        if not (key.isascii() and key.isdigit()):
            return f"evals has the key {key!r:.40}, not a step"
        if not isinstance(metrics, dict):
            return f"evals[{key!r}] is {metrics!r:.40}, not a mapping"
    control = raw.get("lambda_control", {})  # {} for a static run; LambdaState.from_dict reads the rest
    known = {f.name for f in dataclasses.fields(LambdaState)}
    if odd := next((k for k in control if k not in known), None):
        return f"lambda_control has the key {odd!r:.40}, not one of the λ controller's"
    if control and "lam" not in control:
        return "lambda_control lacks lam"
    return _fields_problem(LambdaState, control, "lambda_control.")


def pairs_sha256(pairs: list) -> str:
    """sha256 hex of the pairs' token ids (prompt, chosen, rejected, and a rejected prompt where one is set).

    A pair without ``rejected_prompt`` hashes as before that part was added, so older checkpoints still match.
    """
    digest = hashlib.sha256()
    for p in pairs:
        for ids in (p.prompt, p.chosen, p.rejected):
            digest.update(np.asarray(ids, np.int64).tobytes() + b"|")
        if p.rejected_prompt is not None:
            digest.update(b"rejected prompt|" + np.asarray(p.rejected_prompt, np.int64).tobytes() + b"|")
    return digest.hexdigest()


def data_identity(fingerprint: str, train_pairs: list, valid_pairs: list, by_prompt: bool = False) -> dict:
    """The ``data`` field of :class:`RunState`: what the data is, not where it lies.

    Args:
        fingerprint: ``Dataset.fingerprint`` (sha256 of the data files' content).
        train_pairs: the tokenized training pairs, in order.
        valid_pairs: the held-out pairs evaluated, in order.
        by_prompt: ``Dataset.by_prompt``: recorded as the ``held-out split``, which a checkpoint of an earlier
            dtrain (its rows split one by one) lacks (:data:`dtrain.identity.BEFORE_KEY`).
    """
    split = {"held-out split": "by prompt"} if by_prompt else {}  # first: the reason the pairs below differ
    return {**split, "data content sha256 (data.train, data.valid)": fingerprint, "training pairs": len(train_pairs),
            "training pairs sha256": pairs_sha256(train_pairs), "held-out pairs sha256": pairs_sha256(valid_pairs)}


def new_run_id() -> str:
    """A fresh run's id: time, host and 64 random bits (two runs in one process and second differ)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{socket.gethostname()}-{secrets.token_hex(8)}"


@dataclass
class Checkpoint:
    """A loaded checkpoint: its folder, state and arrays."""

    path: Path
    state: RunState
    adapter: dict  # name -> array
    optimizer: dict  # flattened optimizer state
    best: Optional[dict] = None  # name -> array of best.safetensors (rank 0 only), when the run keeps one


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:07d}"


def save_checkpoint(root: Path, state: RunState, model, optimizer, lora_cfg, resolved: dict,
                    base_model: Optional[dict] = None, chat_template: Optional[str] = None,
                    best: Optional[dict] = None) -> Path:
    """Write checkpoint ``state.step`` under ``root`` atomically and return its folder.

    A folder of the same step is replaced only when it is not a valid
    checkpoint of another run (a re-save of this run's own step, or debris).

    Args:
        root: ``OUTPUT_DIR/checkpoints``.
        state: the run state after ``state.step``.
        model: the model with LoRA layers; its trainable parameters are saved.
        optimizer: an initialised ``mlx.optimizers`` optimizer.
        lora_cfg: the LoRA config (for ``adapter_config.json``).
        resolved: the resolved config as plain data.
        base_model: the base model reference for ``adapter_config.json``.
        chat_template: the training template for ``adapter_config.json``.
        best: LoRA weights of the best step (``train.keep_best``), written as ``best.safetensors``.
    Raises:
        UserError: the folder could not be written (disk full, permissions;
            the previous checkpoints are left untouched), or ``step-N`` is a
            valid checkpoint of another run.
    """
    final = checkpoint_dir(root, state.step)
    owner = run_id_of(final)
    if owner is not None and owner != state.run_id:
        raise UserError(f"{final} is a checkpoint of another run (run id {owner}; this run is {state.run_id}); "
                        f"not replacing it")
    with storage(f"write checkpoint {final}", "; the previous checkpoints are intact"), atomic_folder(final) as tmp:
        write_adapter(tmp, model, lora_cfg, base_model, chat_template)
        save_weights(tmp / OPTIMIZER, dict(tree_flatten(optimizer.state)))
        if best is not None:
            save_weights(tmp / BEST, best)
        (tmp / STATE).write_text(state.to_json())
        (tmp / CONFIG).write_text(yaml.safe_dump(resolved, sort_keys=False))
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps({"step": state.step, "files": files}, indent=2))
    return final


def validate(path: Path) -> Optional[str]:
    """Why ``path`` is not a valid checkpoint, or None when it is."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (not a checkpoint, or its write was interrupted)"
    try:  # a damaged manifest may still parse: an entry without its keys, a list for a dict
        listed = json.loads(manifest.read_text())["files"]
        files = {name: (meta["bytes"], meta["sha256"]) for name, meta in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
        return f"unreadable manifest ({err})"
    except RecursionError:
        return f"unreadable manifest ({TOO_DEEP})"
    for name, (size, digest) in files.items():
        p = path / name
        if not p.is_file():
            return f"missing {name}"
        try:
            if p.stat().st_size != size or sha256_file(p) != digest:
                return f"checksum mismatch in {name}"
        except OSError as err:
            return f"unreadable {name} ({storage_reason(err)})"
    try:
        raw = json.loads((path / STATE).read_text())
        problem = state_problem(raw)
        if problem is None and step_of(path) >= 0 and raw.get("step", step_of(path)) != step_of(path):
            # a copy or link under another step's name: resumed, it would continue an older step and prune newer ones
            problem = f"step is {raw['step']}, not the folder's {step_of(path)}"
    except (ValueError, OSError) as err:  # a manifest that does not list it leaves it unchecked
        return f"unreadable {STATE} ({storage_reason(err) if isinstance(err, OSError) else err})"
    except RecursionError:
        return f"unreadable {STATE} ({TOO_DEEP})"
    return None if problem is None else f"{STATE}: {problem}"


def run_id_of(path: Path) -> Optional[str]:
    """The run id of a valid checkpoint folder (``""`` for an older one without), None when not valid."""
    if not path.is_dir() or validate(path) is not None:
        return None
    return _written_run_id(path)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` (valid or not), oldest step first: ``step-`` and digits only, so a
    copy (``step-0000010 copy``, ``step-10.bak``) is neither resumed from nor pruned."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) >= 0), key=step_of)


def find_latest(root: Path, report=print) -> Optional[Path]:
    """The newest valid checkpoint under ``root``; invalid ones are reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        problem = validate(path)
        if problem is None:
            return path
        report(f"skipping checkpoint {path}: {problem}")
    return None


def recorded_setting(spec: Optional[str], root: Path, key: str) -> Optional[str]:
    """The text ``key`` holds in the settings of the checkpoint ``spec`` (``train.resume``) names: ``auto``, the
    newest valid one under ``root``. None where there is none, it is not valid or it recorded none of ``key``
    (:func:`resume` says why a checkpoint cannot be continued)."""
    if spec is None:
        return None
    try:
        path = find_latest(root, report=lambda _: None) if spec == "auto" else home_path(spec, "train.resume")
        if path is None or not path.is_dir() or validate(path) is not None:
            return None
        value = json.loads((path / STATE).read_text()).get("settings", {}).get(key)
    except (UserError, OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint folder.

    Raises:
        UserError: the folder is missing, not a valid checkpoint, or its
            ``state.json`` lacks fields.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():  # e.g. its adapters.safetensors named instead of the folder
        raise UserError(f"resume: {path} is a file; name a checkpoint folder (OUTPUT_DIR/checkpoints/step-N) or auto")
    if not path.is_dir():
        raise UserError(f"resume: checkpoint folder {path} does not exist; train.resume takes null (a new run), "
                        "auto (the newest valid checkpoint in train.output_dir) or a checkpoint folder")
    problem = validate(path)
    if problem is not None:
        raise UserError(f"resume: {path} {_checkpoints_within(path) or f'is not a valid checkpoint: {problem}'}")
    with storage(f"read checkpoint {path}"):
        state = RunState.from_json((path / STATE).read_text(), str(path / STATE))
        listed = json.loads((path / MANIFEST).read_text())["files"]  # a file it does not list is no part of it
        best = mx.load(str(path / BEST)) if BEST in listed else None
        return Checkpoint(path, state, mx.load(str(path / ADAPTER_WEIGHTS)), mx.load(str(path / OPTIMIZER)), best)


def _checkpoints_within(path: Path) -> Optional[str]:
    """What to name instead when ``path`` is a run's output folder or its checkpoints folder, or None."""
    for root, what in ((OutputDir(path).checkpoints, "is a run's output folder, not a checkpoint; name one of its"),
                       (path, "holds checkpoints, it is not one; name one of them")):
        try:
            newest = find_latest(root, report=lambda _: None)
        except OSError:  # a folder this user may not list: no hint, the plain refusal stands
            continue
        if newest is not None:
            out = path if root != path else path.parent  # auto reads OUTPUT_DIR/checkpoints only
            auto = f", or train.resume auto with train.output_dir {out}" if OutputDir(out).checkpoints == root else ""
            return f"{what}{' checkpoints' if root != path else ''} (the newest valid one: {newest}){auto}"
    return None


def world_size_notice(saved: RunState, world_size: int, dropout: float) -> Optional[str]:
    """What a resume at another world size than ``saved``'s changes with LoRA dropout on (None: nothing): each
    rank draws its masks from a key of its own (``step.dropout_key``), so the adapter differs from the
    uninterrupted run's, as a changed ``train.micro_batch_pairs`` would make it (refused, identity.REFUSED_WHEN)."""
    if dropout <= 0 or saved.world_size == world_size:
        return None
    return (f"resumed at world size {world_size} from step {saved.step}, trained at world size {saved.world_size}: "
            f"with lora.dropout {dropout:g} each rank draws its own dropout masks, so from step {saved.step + 1} the "
            f"adapter differs from an uninterrupted run at world size {saved.world_size} (the same pairs are trained)")


def _differs(name: str, saved, now) -> str:
    if isinstance(saved, dict) and isinstance(now, dict):  # name the first entry that differs
        key = next(k for k in sorted(set(saved) | set(now), key=str) if saved.get(k) != now.get(k))
        return f"{name} ({key}: {saved.get(key)!r} in the checkpoint, {now.get(key)!r} now)"
    return f"{name}: {saved!r} in the checkpoint, {now!r} now"


def _why(key: str, chose: set) -> str:
    notes = ["auto on this device"] * (key in chose) + ([REFUSED_WHEN[key][0]] if key in REFUSED_WHEN else [])
    return f" ({'; '.join(notes)})" if notes else ""


def check_resumable(saved: RunState, current: RunState, next_pairs: list, path: Path,
                    model_aliases: tuple = (), spelled: Optional[dict] = None) -> None:
    """Refuse to continue ``saved`` when a field that decides what is trained changed.

    Args:
        current: this run's state (its ``step`` and bookkeeping are ignored).
        next_pairs: the pair indices this run's sampler gives step ``saved.step + 1``.
        model_aliases: other identities of this run's model (``LoadedModel.aliases``:
            what an earlier dtrain version recorded for it), accepted as ``current.model``.
        spelled: ``current.settings`` as this run's config writes them, ``auto`` unresolved
            (``identity.settings`` of the config before ``device.resolve_auto``); None: as ``current``'s.
    Raises:
        UserError: naming every changed key with both values.
    """
    was = {**{k: v for k, v in BEFORE_KEY.items() if k in current.must_match()},
           **{k: as_run(k, v) for k, v in saved.must_match().items()}}
    now = json.loads(json.dumps(current.must_match()))  # as state.json would hold it (lists, not tuples)
    was, now = beta_as_run(was, now)
    if saved.model in model_aliases:
        now["model.path"] = saved.model
    chose = {k for k, v in (spelled or {}).items() if v != current.settings.get(k)}  # this device's `auto` choices
    # a checkpoint that recorded the word (dtrain before 2026-12-07) chose on a device unknown here: compared as written
    now.update({k: spelled[k] for k in chose if was.get(k) == "auto"})
    keys = [k for k in now if k in was or k not in REFUSED_WHEN] + [k for k in was if k not in now]
    changed = [k for k in keys if was.get(k) != now.get(k)]
    diffs = [_differs(k, was.get(k), now.get(k)) + _why(k, chose) for k in changed
             if k in current.settings and not (k in chose and FOLLOWS.get(k) in changed)]
    if not diffs:  # what the settings decide (pairs, shapes) differs only when they do, or the content does
        diffs = [_differs(k, was.get(k), now.get(k)) for k in changed]
    if not diffs and saved.position.get("next_pairs") != next_pairs:
        diffs.append(f"the sampler's pairs for step {saved.step + 1}: {saved.position.get('next_pairs')} in the "
                     f"checkpoint, {next_pairs} now (a dtrain version with another sampler?)")
    if diffs:
        raise UserError(f"resume: {path} was made with different settings: {'; '.join(diffs)}. {RESUME_HINT}")


def restore(model, optimizer, adapter: dict, optimizer_state: dict) -> None:
    """Put LoRA weights and a flattened optimizer state into ``model``/``optimizer``."""
    model.load_weights(list(adapter.items()), strict=False)
    optimizer.state = tree_unflatten(list(optimizer_state.items()))
    mx.eval(model.trainable_parameters(), optimizer.state)


def _spec(arrays: dict) -> dict:
    return {k: [list(v.shape), str(v.dtype).rsplit(".", 1)[-1]] for k, v in arrays.items()}


def _arrays_problem(found: Checkpoint, adapter: dict, optimizer: dict) -> Optional[str]:
    """The first array of ``found`` whose name, shape or dtype differs from this run's ``adapter``/``optimizer``."""
    for name, held, want in ((ADAPTER_WEIGHTS, _spec(found.adapter), _spec(adapter)),
                             (OPTIMIZER, _spec(found.optimizer), _spec(optimizer))):
        for key in sorted(set(held) | set(want)):
            if key not in held:
                return f"{name} has no {key} (this run: {' '.join(map(str, want[key][::-1]))})"
            if held[key] != want.get(key):
                run = ' '.join(map(str, want[key][::-1])) if key in want else "none"
                return f"{name} has {key} as {' '.join(map(str, held[key][::-1]))} (this run: {run})"
    return None


def _zeros(spec: dict) -> dict:
    return {k: mx.zeros(shape, dtype=getattr(mx, dtype)) for k, (shape, dtype) in spec.items()}


def resume(spec: Optional[str], root: Path, current: RunState, next_pairs: Callable[[int], list], group,
           report: Callable[[str], None] = print, model_aliases: tuple = (),
           spelled: Optional[dict] = None, like: Optional[tuple] = None) -> Optional[Checkpoint]:
    """Continue a run: find, validate and check a checkpoint, and give it to every rank.

    Rank 0 alone reads checkpoints: it finds the one ``spec`` names (``auto``:
    the newest valid one under ``root``, invalid ones reported and skipped;
    else a folder path), checks it with :func:`check_resumable` and checks that
    ``root`` holds no valid checkpoint of another run. Its decision and the
    :class:`RunState` go to every rank as text, then the LoRA weights and
    optimizer state as arrays (:meth:`dtrain.distributed.Group.broadcast_arrays`,
    bit for bit), which the caller puts into its model and optimizer with :func:`restore`.

    Args:
        spec: ``train.resume``: None, ``auto`` or a checkpoint folder.
        root: ``OUTPUT_DIR/checkpoints`` (rank 0's).
        current: this run's state, for :func:`check_resumable`.
        next_pairs: step -> pair indices of this run's sampler.
        group: the process group.
        report: where rank 0 reports skipped checkpoints.
        model_aliases: see :func:`check_resumable`; the continued state keeps the identity it holds.
        spelled: see :func:`check_resumable`.
        like: ``(LoRA weights, optimizer state)`` of this run, flat name -> array: a checkpoint whose arrays
            differ in names, shapes or dtypes (a file swapped in, its manifest rewritten) is refused; None: unchecked.
    Returns:
        The checkpoint continued (``adapter``/``optimizer`` on every rank; ``best`` on rank 0 only), or
        None to start at step 1 (no ``spec``, or ``auto`` found none).
    Raises:
        UserError: on every rank: rank 0 with its reason, the others pointing to its message.
    """
    if spec is None:
        return None
    decision: dict = {"path": None}
    found = None
    if group.is_main:
        try:
            path = find_latest(root, report) if spec == "auto" else home_path(spec, "train.resume")
            if path is None:  # a mistyped train.output_dir would otherwise start over without a word
                report(f"train.resume auto: no checkpoint in {root}; this run starts at step 1")
            else:
                found = load_checkpoint(path)
                check_resumable(found.state, current, next_pairs(found.state.step + 1), path, model_aliases, spelled)
                if like is not None and (problem := _arrays_problem(found, *like)) is not None:
                    raise UserError(f"resume: {path} is not a valid checkpoint: {problem}; continue from an earlier "
                                    f"one (train.resume {path.parent / f'{PREFIX}N'})")
                others = [p.name for p in list_checkpoints(root) if run_id_of(p) not in (None, found.state.run_id)]
                if others:
                    raise UserError(f"{root} also holds checkpoints of another run ({', '.join(others)}); resuming "
                                    f"{path} there would mix two runs: train into a new train.output_dir")
                left = [p.name for p in list_checkpoints(root)
                        if run_id_of(p) == found.state.run_id and step_of(p) > found.state.step]
                if left:  # prune removes them at the first save: said now, while they are still there
                    report(f"resuming {path.name}: this run's later checkpoint(s) {', '.join(left)} belong to the "
                           f"steps it leaves and are removed at its first save or its end (copy them elsewhere to keep them)")
                decision = {"path": str(path), "state": dataclasses.asdict(found.state),
                            "adapter": _spec(found.adapter), "optimizer": _spec(found.optimizer)}
        except UserError as err:
            decision = {"error": str(err)}
    decision = json.loads(group.broadcast_text(json.dumps(decision), None, "resume decision of rank 0"))
    if "error" in decision:
        # rank 0 prints the reason; the others point to it, so the job shows it once (as the output-folder check)
        if not group.is_main:
            raise AfterRank0Error("rank 0 could not resume the run; see its message")
        raise UserError(decision["error"])
    if decision["path"] is None:
        return None
    adapter = group.broadcast_arrays(found.adapter if found else _zeros(decision["adapter"]), None,
                                     "broadcast of the checkpoint's LoRA weights")
    opt = group.broadcast_arrays(found.optimizer if found else _zeros(decision["optimizer"]), None,
                                 "broadcast of the checkpoint's optimizer state")
    return Checkpoint(Path(decision["path"]), RunState(**decision["state"]), adapter, opt, found.best if found else None)


def step_of(path: Path) -> int:
    """The step a checkpoint folder's name gives (``step-0000040`` -> 40); -1 for another name."""
    digits = path.name[len(PREFIX):] if path.name.startswith(PREFIX) else ""
    return int(digits) if digits.isascii() and digits.isdigit() else -1


def drop_left(root: Path, run_id: str, step: int) -> None:
    """Delete run ``run_id``'s checkpoints past ``step`` (damaged ones too): of the steps it left when it was
    continued from an older checkpoint (``train.resume`` naming one). Called before ``step`` is saved, so
    that ``resume: auto`` continues this branch, not the one left, whenever the run is killed, and at the
    run's end (one continued at its end saves nothing)."""
    for p in list_checkpoints(root):
        if step_of(p) > step and _written_run_id(p) == run_id:
            shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int, run_id: str) -> None:
    """Delete all but the newest ``keep_last`` valid checkpoints of run ``run_id`` (its damaged ones older than
    those kept go too), and stale temporaries. The steps a continued run left go first, by :func:`drop_left`."""
    if root.is_dir():
        clear_set_aside(root, f"{PREFIX}*")
    mine = [p for p in list_checkpoints(root) if _written_run_id(p) == run_id]  # damaged ones included
    kept = [p for p in mine if validate(p) is None][-keep_last:]
    # a damaged one (never resumed from) goes where a valid one would: older than those kept
    old = [p for p in mine if kept and step_of(p) < step_of(kept[0])]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)


def _written_run_id(path: Path) -> Optional[str]:
    """The run id ``state.json`` names, the manifest unchecked (a damaged checkpoint's too); None when unreadable."""
    try:
        return str(json.loads((path / STATE).read_text()).get("run_id", ""))
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
