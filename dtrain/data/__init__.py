"""Preference data: files or generated demo pairs -> tokenized pairs.

``load_dataset`` is the trainer's entry point; ``load_rows`` and
``tokenize_rows`` are its two stages (read + normalise, render + tokenize +
truncate); ``check_file`` backs ``dtrain data check FILE``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..errors import DataError
from ..types import BadRowReport, Row
from .check import check_file
from .demo import demo_pairs
from .cache import cache_key, entries_bytes, tokenize_cached, write_entries
from .formats import parse_rows
from .render import end_of_turn, tokenize_rows, transcript_messages
from .sources import fingerprint as data_fingerprint, mlx_valid, read_rows, resolve, resolve_pair
from .templates import date_notice, template_date

__all__ = ["BadRowReport", "Dataset", "Row", "cache_key", "check_file", "demo_pairs", "end_of_turn", "entries_bytes",
           "load_dataset", "load_rows", "prompt_groups", "read_rows", "resolve", "split_rows", "tokenize_cached",
           "tokenize_rows", "write_entries"]

DEMO_VERSION = 1  # bump when demo.py changes its output, so fingerprints change too


def load_rows(path: str, cfg, role: str = "train", pairwise: bool = True) -> tuple:
    """Read the rows of ``path`` (any container of :mod:`.sources`) as ``role``: ``(list[Row], BadRowReport)``.

    Bad rows (invalid JSON, missing or wrongly typed fields, empty responses,
    invalid UTF-8) are listed in the report, never raised; pairs whose chosen
    and rejected are the same text are listed as dropped (``same text``).
    Pairs without preference signal after rendering are dropped later, by
    :func:`tokenize_rows`. ``pairwise`` False (``objective.kind: sft``): preference
    rows are read as their chosen side, and neither rule applies to them
    (:func:`.formats.parse_rows`).

    Raises:
        DataError: missing file, a folder of no known layout, empty file,
            invalid JSON array, unknown row format, bad ``data.fields``.
    """
    return read_rows(resolve(path, cfg, role), cfg, pairwise)


def prompt_groups(rows: list) -> list:
    """The indices of ``rows`` (:class:`Row`) grouped by prompt (its text, messages or transcript turns, and system
    message; each text without the whitespace around it), in order of first appearance; a row without a prompt (a
    text row, an empty one) is a group of its own."""
    groups: dict = {}
    for i, row in enumerate(rows):
        groups.setdefault(_prompt_key(row) if row.prompt else i, []).append(i)
    return list(groups.values())


def _prompt_key(row: Row) -> str:
    # the prompt as the chat template gets it (render.row_messages): a text prompt is a user turn, a transcript its
    # turns, the row's system text a system message where none of the prompt's says it; each text stripped, since
    # a question copied with a trailing newline is the same question: held out, its copy must not be trained on
    prompt = row.prompt
    if isinstance(prompt, str):
        prompt = transcript_messages(prompt) if row.transcript else [{"role": "user", "content": prompt}]
    turns = [(m["role"], m["content"].strip()) for m in prompt]
    if row.system is not None and ("system", row.system.strip()) not in turns:
        turns.insert(0, ("system", row.system.strip()))
    return repr(turns)


def split_rows(rows: list, valid_fraction: float, seed: int, by_prompt: bool = True) -> tuple:
    """Deterministic ``(train, valid)`` split by prompt (``by_prompt`` False: by row); both keep file order.

    Rows that share a prompt (:func:`prompt_groups`: several pairs per prompt, as UltraFeedback's) stay on one
    side, so no held-out prompt is trained on. ``round(G * valid_fraction)`` of the G prompts (at least 1 when the
    fraction is > 0 and there are 2+, never all of them) go to valid, picked by ``random.Random(seed)`` over the
    prompts in order of first appearance (with no prompt repeated: the rows, one by one), so the same rows,
    fraction and seed give the same split on every run.
    """
    groups = prompt_groups(rows) if by_prompt else [[i] for i in range(len(rows))]
    n_valid = min(round(len(groups) * valid_fraction), max(len(groups) - 1, 0))  # a prompt is left to train on
    if valid_fraction > 0 and len(groups) >= 2:
        n_valid = max(n_valid, 1)
    picked = {i for g in random.Random(seed).sample(range(len(groups)), n_valid) for i in groups[g]}
    train = [r for i, r in enumerate(rows) if i not in picked]
    return train, [r for i, r in enumerate(rows) if i in picked]


def no_usable_split(cfg, rows: list, held: BadRowReport, noun: str) -> str:
    """Why a run stops when none of the ``rows`` that ``cfg.valid_fraction`` held out is usable (``held``: their
    tokenizing report, its dropped rows; ``noun``: pair, or sft's row)."""
    why = f": {held.dropped_kinds()}" if held.dropped else ""
    return (f"no usable held-out {noun}s among the {len(rows)} row(s) data.valid_fraction {cfg.valid_fraction} held "
            f"out, {name_rows(rows)} ({len(held.bad)} bad rows, {len(held.dropped)} dropped{why}): set data.valid, or "
            f"fix those rows (dtrain data check lists them)")


def name_rows(rows: list, most: int = 3) -> str:
    """``rows``' sources (``file:line``), the first ``most`` of them and how many more."""
    named = ", ".join(r.source for r in rows[:most])
    return named + (f" and {len(rows) - most} more" if len(rows) > most else "")


def _stop_on_bad_rows(report: BadRowReport, cfg) -> None:
    """Raises DataError naming the first bad row and listing them, under ``data.on_bad_row: error``."""
    if report.bad and cfg.on_bad_row == "error":
        first, why = report.bad[0]
        # indented: ./launch shows an error every rank meets once, with its indented lines
        listed = textwrap.indent(BadRowReport(report.rows_read, report.bad).summary(bad="bad"), "  ")
        raise DataError(f"{first}: {why} ({len(report.bad)} bad row(s); data.on_bad_row is 'error')\n{listed}")


@dataclass
class Dataset:
    """Tokenized train and held-out pairs.

    ``fingerprint``: :func:`.sources.fingerprint` of the train (and valid) source:
    for one JSON file its ``sha256sum``; for demo data, sha256 of the demo
    parameters. It changes whenever the input data changes.
    ``cache_entries``: tokenized pairs not yet in the cache, for
    :func:`write_entries` once the run owns its output folder.
    ``messages``: most training prompts are message rows, not plain text (which
    template rendered them: :func:`.templates.trained_template`).
    ``by_prompt``: the rows were split by ``valid_fraction`` and some share a prompt, so whole prompts were
    held out (:func:`split_rows`), not the rows an earlier dtrain held out one by one.
    """

    train: list
    valid: list
    report: BadRowReport = field(default_factory=BadRowReport)
    fingerprint: str = ""
    cache_entries: list = field(default_factory=list, repr=False, compare=False)
    messages: bool = False
    by_prompt: bool = False


def held_out_source(cfg, train: str) -> Optional[str]:
    """Where the held-out rows of ``train`` come from when they have a source of their own (``cfg``: a
    DataConfig): ``data.valid``, ``data.valid_split S of TRAIN``, an mlx-lm folder's ``valid.jsonl``; None:
    split off by ``data.valid_fraction`` (:func:`.sources.resolve_pair`'s order)."""
    if cfg.valid is not None:
        return cfg.valid
    if cfg.valid_split is not None:
        return f"data.valid_split {cfg.valid_split} of {train}"
    mlx = mlx_valid(train)
    return None if mlx is None else str(mlx)


def load_dataset(cfg, tokenizer, seed: int = 0, log: Optional[Callable[[str], None]] = print,
                 cache_dir: Optional[Path] = None, pairwise: bool = True, progress: bool = True) -> Dataset:
    """Load, split and tokenize the data described by ``cfg`` (a DataConfig).

    Sources, in order: ``cfg.demo_pairs > 0`` (generated by
    :func:`demo_pairs` with ``cfg.demo_seed``), else ``cfg.train`` plus
    ``cfg.valid`` (or the held-out split of ``cfg.train``'s container, see
    :func:`.sources.resolve_pair`), or ``cfg.train`` split by ``cfg.valid_fraction``
    with ``seed`` (by prompt, :func:`split_rows`; the generated demo pairs by row). With
    ``cache_dir``, tokenized pairs are cached there by content (:mod:`.cache`; misses go to
    ``Dataset.cache_entries``, nothing is written here); a progress bar shows on stderr when ``log`` is set
    and ``progress`` (``train.progress``).
    With ``on_bad_row: skip`` the count and first few bad rows go to ``log``
    (None: silent); dropped pairs (no preference signal or no room, see
    :mod:`dtrain.data.render`; under sft KTO rows labelled false) are always only logged.
    ``pairwise``: the objective trains both sides (every ``objective.kind`` but ``sft``); False reads
    preference rows as their chosen side (:func:`load_rows`), so the cache entries of the two differ by their rows.
    Every row is rendered with one day: ``cfg.template_date``, today's where it is null
    (:func:`.templates.template_date`); where a template writes it, ``log`` gets a line naming it.

    Raises:
        DataError: file-level problems (see :func:`load_rows`); any bad row with
            ``on_bad_row: error``; no training pairs left; held-out rows given
            (``data.valid``, ``data.valid_split``, an mlx-lm folder's ``valid.jsonl``) and none usable.
    """
    cfg = dataclasses.replace(cfg, template_date=template_date(cfg))  # one day for every row, train and held out
    if cfg.demo_pairs > 0:
        demo_cfg = dataclasses.replace(cfg, format="standard", fields=None)
        items = [(f"demo:{i + 1}", obj) for i, obj in enumerate(demo_pairs(cfg.demo_pairs, cfg.demo_seed))]
        rows, report = parse_rows(items, demo_cfg, "demo", pairwise)
        # generated pairs, a prompt drawn again now and then: split by row, as the demo's adapter was trained
        train_rows, valid_rows = split_rows(rows, cfg.valid_fraction, seed, by_prompt=False)
        valid_src, by_prompt = None, False
        fingerprint = hashlib.sha256(f"demo:v{DEMO_VERSION}:{cfg.demo_pairs}:{cfg.demo_seed}".encode()).hexdigest()
    else:
        if cfg.train is None:
            raise DataError("data.train is not set (or set data.demo_pairs > 0 for generated pairs)")
        train_src, valid_src = resolve_pair(cfg)
        rows, report = read_rows(train_src, cfg, pairwise)
        by_prompt = False
        if valid_src is not None:
            train_rows = rows
            valid_rows, held_report = read_rows(valid_src, cfg, pairwise)
            report = report.merge(held_report)
        else:
            train_rows, valid_rows = split_rows(rows, cfg.valid_fraction, seed)
            # an earlier dtrain's checkpoint, split by row, is refused by name only where that split was another
            by_prompt = valid_rows != split_rows(rows, cfg.valid_fraction, seed, by_prompt=False)[1]
        fingerprint = data_fingerprint([s for s in (train_src, valid_src) if s is not None])
    _stop_on_bad_rows(report, cfg)  # rows that cannot be read stop the run before any row is tokenized
    progress, pending = progress and log is not None, []
    noun = "pair" if pairwise else "row"  # sft's examples (types.example_noun)
    train, train_report = tokenize_cached(train_rows, tokenizer, cfg, cache_dir, progress, "train", pending, noun)
    valid, valid_report = tokenize_cached(valid_rows, tokenizer, cfg, cache_dir, progress, "valid", pending, noun)
    # rows_read was counted at load time; tokenize reports add only their entries.
    report = report.merge(dataclasses.replace(train_report.merge(valid_report), rows_read=0))
    _stop_on_bad_rows(report, cfg)
    summary = report.summary(noun=noun)
    if summary and log is not None:
        log(summary)
    if not train:
        why = f": {report.dropped_kinds()}" if report.dropped else ""
        raise DataError(f"no usable training {noun}s in {cfg.train or 'demo data'} ({len(report.bad)} bad rows, "
                        f"{len(report.dropped)} dropped{why})")
    if valid_src is not None and not valid:  # held-out rows given, none usable: not a run without evaluation
        held = held_report.merge(valid_report)
        why = f": {held.dropped_kinds()}" if held.dropped else ""
        raise DataError(f"no usable held-out {noun}s in {held_out_source(cfg, cfg.train)} ({len(held.bad)} bad rows, "
                        f"{len(held.dropped)} "
                        f"dropped{why}): fix its rows (dtrain data check lists them), or give other held-out {noun}s")
    if valid_src is None and valid_rows and not valid:  # held out, none usable: not a run without evaluation
        raise DataError(no_usable_split(cfg, valid_rows, valid_report, noun))
    if log is not None and (dated := date_notice(tokenizer, cfg)):
        log(dated)
    prompts = [isinstance(r.prompt, list) for r in train_rows if r.prompt is not None]  # SFT text rows have none
    return Dataset(train=train, valid=valid, report=report, fingerprint=fingerprint, cache_entries=pending,
                   messages=2 * sum(prompts) > len(prompts), by_prompt=by_prompt)
