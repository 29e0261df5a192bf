"""DPO's reference log-probabilities: the model at step 0, computed once per pair per run.

Before the first step (and before a resume loads its weights) the trainer runs
the model as it is at step 0 — the base, plus the initial adapter when one is
given; a new LoRA's ``lora_b`` is zero, so it adds nothing — in evaluation mode
through an engine built like the training one (the same plan and memory bounds)
with :class:`ReferenceLogps` as its objective. Micro-batches are cut from the
whole pair list and dealt to ranks in turn, so every pair is computed in the
same micro-batch whatever the world size; an all-sum in which each pair has one
non-zero contribution gathers them bit for bit. The values go into
``OUT/data_cache/reference-<key>-train.npz`` and ``-valid.npz`` next to the tokenized pairs (zips,
whose CRC catches a damaged file, as the tokenized pairs' entries are); ``key`` covers the model,
the initial adapter (its weights and the LoRA layers they run in), every pair's token ids, ``train.micro_batch_pairs`` and the engine
settings as resolved on this device (the padding of a micro-batch and the plan change the rounding), so a resume or
a restart with the same ones reads them instead of recomputing.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..engine.dpo import REF_KEYS
from ..engine.layout import batch_totals
from ..engine.loss import upcast
from ..engine.objective import PairLogps, Totals
from ..errors import UserError
from ..files import home_path, new_temp_file, sha256_file
from ..lora import ADAPTER_WEIGHTS
from ..sampler import micro_batches
from ..types import TokenizedPair

CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ReferenceLogps:
    """The engine objective of the reference pass: per-pair summed response log-probabilities.

    ``loss`` returns a zero loss and ``ref_chosen``/``ref_rejected`` ``(B,)`` sums (nats).
    """

    nll_scope = "response"
    metric_keys = REF_KEYS

    def hyper(self) -> dict:
        return {}

    def loss(self, logps: PairLogps, totals: Totals, hyper: dict):
        c, r = upcast(logps.chosen), upcast(logps.rejected)
        return mx.zeros((), c.dtype), dict(zip(REF_KEYS, (c, r)))


def cache_key(model_identity: str, init_adapter: Optional[str], pairs: list[TokenizedPair]) -> str:
    """sha256 hex of what the reference values depend on: the model, the initial adapter
    (``sha256`` of its weights file, or None) and every pair's token ids, in order."""
    digest = hashlib.sha256(f"v{CACHE_VERSION}|{model_identity}|{init_adapter}|".encode())
    for p in pairs:
        for ids in (p.prompt, p.chosen, p.rejected, p.rejected_prompt or []):
            digest.update(np.asarray(ids, np.int64).tobytes() + b"|")
    return digest.hexdigest()


def compute(engine, pairs: list[TokenizedPair], micro: int, group, progress: bool = False,
            desc: str = "") -> np.ndarray:
    """``(N, 2)`` float32 summed log-probabilities (chosen, rejected) of ``pairs`` under ``engine``'s model.

    Micro-batches of ``micro`` pairs over the whole list; rank ``r`` runs batches
    ``r, r + size, ...``; ``group.all_sum_tree`` gathers the values (every rank joins).
    ``progress``: a tqdm bar on stderr (``DPO reference log-probs <desc>``, shown after one second)
    over the list's pairs, as tokenization's (rank 0's passes the micro-batches other ranks run).
    """
    from tqdm import tqdm

    out = np.zeros((len(pairs), 2), np.float32)
    start = 0
    with tqdm(total=len(pairs), desc=f"DPO reference log-probs {desc}".strip(), unit="pair", disable=not progress,
              delay=1.0, file=sys.stderr, leave=False) as bar:
        for i, chunk in enumerate(micro_batches(pairs, micro)):  # as sampler.dealt_batches deals them
            if i % group.size == group.rank:
                result = engine.evaluate(chunk, batch_totals(chunk, engine.objective.nll_scope))
                mx.eval(result.sums["ref_chosen"], result.sums["ref_rejected"])
                out[start:start + len(chunk), 0] = np.array(result.sums["ref_chosen"], np.float32)
                out[start:start + len(chunk), 1] = np.array(result.sums["ref_rejected"], np.float32)
            start += len(chunk)
            bar.update(len(chunk))
    if group.size > 1:
        out = np.array(group.all_sum_tree({"ref": mx.array(out)}, None, "all_sum of reference log-probs")["ref"])
    return out


def with_reference(pairs: list[TokenizedPair], values: np.ndarray) -> list[TokenizedPair]:
    """``pairs`` with ``extra`` :data:`~dtrain.engine.dpo.REF_KEYS` set from ``(N, 2)`` ``values``."""
    return [dataclasses.replace(p, extra={**(p.extra or {}), **dict(zip(REF_KEYS, map(float, v)))})
            for p, v in zip(pairs, values.tolist())]


def load(path: Path, n: int) -> Optional[np.ndarray]:
    """The cached ``(n, 2)`` values, or None when absent, damaged (the zip's CRC) or of another size."""
    try:
        with np.load(path, allow_pickle=False) as entry:
            values = entry["values"]
    # a damaged file raises OSError, ValueError, EOFError, KeyError, zipfile's BadZipFile, or numpy's header
    # parser's SyntaxError, TokenError
    except Exception:  # noqa: BLE001
        return None
    return values if values.shape == (n, 2) and values.dtype == np.float32 else None


def save(path: Path, values: np.ndarray) -> None:
    """Write ``values`` to ``path`` atomically (a temporary file, then ``os.replace``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(path.parent, ".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, values=values)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def reference_pairs(engine, pairs: list[TokenizedPair], micro: int, group, cache_dir: Optional[Path],
                    key: str, progress: bool = False, desc: str = "") -> tuple[list[TokenizedPair], int]:
    """``(pairs with reference extras, number of pairs computed now)``: read from ``cache_dir`` when
    cached under ``key``, else computed (:func:`compute`, every rank joins) and written by rank 0
    (not when the disk refuses: a cache).

    The caller runs it on the step-0 model in evaluation mode. Every rank decides
    from its own cache folder; a rank that finds no file computes, so all ranks
    must see the same folder state (the trainer agrees it through ``group``).
    """
    path = None if cache_dir is None else Path(cache_dir) / f"reference-{key}.npz"
    cached = None if path is None else load(path, len(pairs))
    found = group.all_sum_scalars({"found": float(cached is not None)}, None, "reference cache check")["found"]
    if cached is not None and found == group.size:
        return with_reference(pairs, cached), 0
    values = compute(engine, pairs, micro, group, progress, desc)
    if path is not None and group.is_main:
        try:
            save(path, values)
        except OSError:
            pass  # a read-only or full disk costs only the next run's reference pass (as data.cache's entries)
    return with_reference(pairs, values), len(pairs)


def reference_pass(cfg, model, dataset, model_identity: str, group, engine, cache_dir: Path, notice=None, *,
                   init_adapter: Optional[str], settings: str):
    """``dataset`` with DPO's reference log-probabilities on every train and valid pair (its
    ``extra``): the step-0 ``model`` in evaluation mode through ``engine`` (built like the
    training one, with :class:`ReferenceLogps`); read from ``cache_dir`` when cached.
    ``notice`` (rank 0's, or None) is told whether they were computed or read; ``init_adapter``:
    :func:`init_adapter_identity` of ``cfg``, which the run's state holds too (hashed once);
    ``settings``: :func:`engine_settings` of ``engine``."""
    train, valid = list(dataset.train), list(dataset.valid)
    dtype = compute_dtype(model)  # decides the values too, as do the micro-batches' padding and the engine's plan
    # and the LoRA layers an initial adapter's weights run in: its adapter_config.json's scale (not in the
    # weights' sha256), the product's dtype; dropout is off in evaluation mode. A new LoRA adds nothing (lora_b 0)
    lora = {k: v for k, v in sorted(dataclasses.asdict(cfg.lora).items())
            if k not in ("dropout", "plus_ratio")} if init_adapter else None
    how = f"{dtype}|micro {cfg.train.micro_batch_pairs}|{settings}|{lora}"
    key = cache_key(f"{model_identity}|{how}", init_adapter, train + valid)
    model.eval()
    try:  # valid cut from its own start, as evaluation cuts it: step 0's held-out rewards are exactly 0
        bar = cfg.train.progress and group.is_main
        train, computed = reference_pairs(engine, train, cfg.train.micro_batch_pairs, group, cache_dir, key + "-train",
                                          bar, "train")
        valid, more = reference_pairs(engine, valid, cfg.train.micro_batch_pairs, group, cache_dir, key + "-valid",
                                      bar, "valid")
    finally:
        model.train()
    for name, pairs in (("train", train), ("valid", valid)):
        refuse_non_finite(pairs, name)
    if notice is not None:
        notice(f"DPO reference log-probs of {len(train)} train + {len(valid)} valid pairs (the model at step 0): "
               + ("computed" if computed + more else "read from the data cache"))
    dataset = copy.copy(dataset)  # the caller's dataset stays as it was
    dataset.train, dataset.valid = train, valid
    return dataset


def refuse_non_finite(pairs: list[TokenizedPair], name: str) -> None:
    """Refuse ``pairs`` (``name``: train or valid) whose reference log-probs are NaN or inf: each step that drew
    one would have a non-finite loss and be skipped, its other pairs with it.

    Raises:
        UserError: naming the first few such pairs.
    """
    bad = [p.source or "?" for p in pairs if not all(np.isfinite([p.extra[k] for k in REF_KEYS]))]
    if bad:
        raise UserError(f"DPO reference log-probs (the model at step 0) are NaN or inf for {len(bad)} {name} pair(s): "
                        f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}; every step that drew one would be "
                        f"skipped as non-finite: check model.dtype (float16 overflows) or remove these pairs")


def engine_settings(engine, kernels: str, batches: list = ()) -> str:
    """What of ``engine`` (as ``engine.make_engine`` built it, every ``auto`` but the plan's resolved)
    changes the rounding of its values: the reference engine has no settings; the segmented one its plan,
    padding, attention calls, compilation and ``kernels`` (the run's resolved ``engine.kernels``). The
    config as written would say ``auto`` for what differs between devices, and differ where two spellings
    build the same engine. An ``auto`` plan counts by what it chose for each of ``batches`` (the pass's
    micro-batches), not by its memory budget, which decides nothing else and moves between runs (Metal's
    with the memory in use, every device's with the ranks on the machine)."""
    if engine.name == "reference":
        return "reference"
    plan = engine.plan
    chosen = None
    if plan.auto:  # (layer ranges, head chunk) per micro-batch, hashed: a long run has many
        chosen = [(rs.ranges, chunk) for rs, chunk in (engine.plan_of(engine.layout(b)) for b in batches)]
        chosen = hashlib.sha256(str(chosen).encode()).hexdigest()
    return str(dict(segment_layers="auto" if plan.auto else plan.size, head_chunk_tokens=plan.head_chunk_tokens,
                    plans=chosen, prefix_sharing=engine.prefix_sharing,
                    length_bucket=engine.length_bucket, pack=engine.pack, attention_groups=engine.attention_groups,
                    compile=engine.compile, kernels=kernels))


def compute_dtype(model) -> str:
    """The float type of ``model``'s parameters: a quantized model's first parameter is its packed
    uint32 weights, the same whether its scales (and activations) are bfloat16 or float16."""
    return str(next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                    None))


def init_adapter_identity(cfg):
    """sha256 of ``train.init_adapter``'s weights file, or None without one."""
    folder = cfg.train.init_adapter
    return sha256_file(home_path(folder, "train.init_adapter") / ADAPTER_WEIGHTS) if folder else None
