"""Checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is a folder ``OUTPUT_DIR/checkpoints/step-NNNNNNN`` holding

- the adapter in mlx-lm's format (``adapters.safetensors``, ``adapter_config.json``),
  loadable on its own by ``mlx_lm.generate --adapter-path``;
- ``optimizer.safetensors``: the AdamW state (moments, step, learning rate);
- ``state.json``: step, skipped steps, the RNG state, the data position
  (epoch, cursor in the global pair stream, seed), the TensorBoard run
  folder, world size and global batch, and the identities the run must keep
  (model, data fingerprint, LoRA shapes);
- ``config.yaml``: the resolved config;
- ``manifest.json``: sha256 and size of every file, written last.

It is written into a hidden temporary folder, every file fsynced, then renamed
into place, so a crash leaves the previous checkpoint or the new one, never a
half-written folder that looks valid. A folder is valid only when its manifest
exists and every checksum matches.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import yaml
from mlx.utils import tree_flatten, tree_unflatten

from .errors import UserError
from .files import fsync_path, sha256_file
from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config

STATE = "state.json"
OPTIMIZER = "optimizer.safetensors"
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
PREFIX = "step-"


@dataclass
class Checkpoint:
    """A loaded checkpoint: its folder, ``state.json`` contents and arrays."""

    path: Path
    state: dict
    adapter: dict  # name -> array
    optimizer: dict  # flattened optimizer state


def save_checkpoint(root: Path, step: int, model, optimizer, lora_cfg, state: dict, resolved: dict) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically and return its folder.

    Args:
        root: ``OUTPUT_DIR/checkpoints``.
        model: the model with LoRA layers; its trainable parameters are saved.
        optimizer: an initialised ``mlx.optimizers`` optimizer.
        lora_cfg: the LoRA config (for ``adapter_config.json``).
        state: JSON-able trainer state (see module docstring); ``step`` is added.
        resolved: the resolved config as plain data.
    Raises:
        UserError: the folder could not be written (disk full, permissions);
            the previous checkpoints are left untouched.
    """
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        mx.save_safetensors(str(tmp / ADAPTER_WEIGHTS), dict(tree_flatten(model.trainable_parameters())))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora_cfg, model), indent=2))
        mx.save_safetensors(str(tmp / OPTIMIZER), dict(tree_flatten(optimizer.state)))
        (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=2))
        (tmp / CONFIG).write_text(yaml.safe_dump(resolved, sort_keys=False))
        files = sorted(p for p in tmp.iterdir())
        for p in files:
            fsync_path(p)
        manifest = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        if final.exists():  # a re-save of the same step (e.g. after resume)
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_path(root)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"could not write checkpoint {final}: {err.strerror or err}; "
                        f"the previous checkpoints are intact") from None
    return final


def validate(path: Path) -> Optional[str]:
    """Why ``path`` is not a valid checkpoint, or None when it is."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (not a checkpoint, or its write was interrupted)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, OSError) as err:
        return f"unreadable manifest ({err})"
    for name, meta in files.items():
        p = path / name
        if not p.is_file():
            return f"missing {name}"
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            return f"checksum mismatch in {name}"
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root`` (valid or not), oldest step first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def find_latest(root: Path, report=print) -> Optional[Path]:
    """The newest valid checkpoint under ``root``; invalid ones are reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        problem = validate(path)
        if problem is None:
            return path
        report(f"skipping checkpoint {path}: {problem}")
    return None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint folder.

    Raises:
        UserError: the folder is missing or not a valid checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"resume: checkpoint folder {path} does not exist")
    problem = validate(path)
    if problem is not None:
        raise UserError(f"resume: {path} is not a valid checkpoint: {problem}")
    state = json.loads((path / STATE).read_text())
    return Checkpoint(path, state, mx.load(str(path / ADAPTER_WEIGHTS)), mx.load(str(path / OPTIMIZER)))


def restore(ckpt: Checkpoint, model, optimizer) -> None:
    """Put the checkpoint's LoRA weights and optimizer state into ``model``/``optimizer``."""
    model.load_weights(list(ckpt.adapter.items()), strict=False)
    optimizer.state = tree_unflatten(list(ckpt.optimizer.items()))
    mx.eval(model.trainable_parameters(), optimizer.state)


def check_compatible(ckpt: Checkpoint, facts: dict, global_batch_pairs: int) -> None:
    """Refuse to resume into a different model, data, LoRA shape or global batch.

    Args:
        facts: ``{"model": ..., "data": ..., "lora shapes": ...}`` of this run.
    Raises:
        UserError: naming every fact that differs.
    """
    saved = ckpt.state.get("identity", {})
    diffs = [name for name, value in facts.items() if json.dumps(saved.get(name), sort_keys=True) != json.dumps(value, sort_keys=True)]
    if ckpt.state.get("global_batch_pairs") != global_batch_pairs:
        diffs.append(f"global batch ({ckpt.state.get('global_batch_pairs')} in the checkpoint, {global_batch_pairs} now)")
    if diffs:
        raise UserError(f"resume: {ckpt.path} was made with a different {', '.join(diffs)}; refusing to continue")


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` valid checkpoints, and stale temporaries."""
    for tmp in root.glob(f".{PREFIX}*.tmp-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)
    done = [p for p in list_checkpoints(root) if validate(p) is None]
    for p in done[: max(len(done) - keep_last, 0)]:
        shutil.rmtree(p, ignore_errors=True)


def estimate_bytes(model) -> int:
    """Bytes one checkpoint needs: adapter + two AdamW moments, plus 1 MiB of metadata."""
    n = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    return 3 * n + (1 << 20)


def check_output_dir(out: Path, need_bytes: int) -> None:
    """Stop early when ``out`` is not writable or lacks room for a checkpoint.

    Raises:
        UserError: naming the folder and the bytes needed/free.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise UserError(f"output folder {out} is not writable: {err.strerror or err}") from None
    free = shutil.disk_usage(out).free
    if free < 2 * need_bytes:
        raise UserError(f"output folder {out} has {free / 1e6:.1f} MB free; a checkpoint needs about "
                        f"{need_bytes / 1e6:.1f} MB (twice that while one is replaced)")
