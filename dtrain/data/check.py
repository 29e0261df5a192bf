"""The ``dtrain data check FILE`` report: bad and dropped rows, token lengths, pairs as trained."""

from __future__ import annotations

import dataclasses
import json
import math

from ..errors import DataError
from ..types import BadRowReport, example_noun
from .render import tokenize_rows
from .sources import read_rows, resolve_pair
from .templates import RAW_TEXT, date_notice, renderers, template_date


def _stats(values: list) -> str:
    """``min / median / p95 / max`` of a list of ints (nearest-rank percentiles)."""
    if not values:
        return "-"
    v = sorted(values)
    median, p95 = (v[max(0, math.ceil(q * len(v)) - 1)] for q in (0.5, 0.95))
    return f"{v[0]} / {median} / {p95} / {v[-1]}"


def show_pair(pair, tokenizer, number: int, noun: str = "pair") -> list:
    """Lines showing one pair (``noun``: sft says row) as trained: each part decoded (control tokens visible) and
    its ids.

    The prompt and each response are decoded separately, so the line break
    between ``prompt`` and ``chosen`` is the prompt/response boundary.
    """
    def text(ids):
        return json.dumps(tokenizer.decode(ids, skip_special_tokens=False), ensure_ascii=False)

    parts = [("prompt", pair.prompt), ("chosen", pair.chosen)]
    if pair.rejected_prompt is not None:
        parts.append(("rejected prompt", pair.rejected_prompt))
    if pair.rejected:  # an SFT row has none
        parts.append(("rejected", pair.rejected))
    lines = [f"{noun} {number}: {pair.source}  (prompt ends after token {len(pair.prompt)}; responses follow it)"]
    for name, ids in parts:
        lines.append(f"  {name:<9} {len(ids):>4} tokens  {text(ids)}")
        lines.append(f"  {'':<9} ids {ids}")
    return lines


def glued_rows(rows: list, tokenizer, cfg) -> list:
    """Sources of rows whose raw-text prompt runs into a response with no whitespace between them.

    Only plain-text prompts rendered as raw text (``prompt_template: raw``, or no
    chat template) are joined this way: ``"Say hi"`` + ``"hi"`` trains ``"Say hihi"``.
    """
    if renderers(tokenizer, cfg)[1].template is not RAW_TEXT:
        return []
    glued = []
    for row in rows:
        if isinstance(row.prompt, str) and row.prompt and not row.prompt[-1].isspace() and any(
                isinstance(r, str) and r and not r[0].isspace() for r in (row.chosen, row.rejected)):
            glued.append(row.source)
    return glued


def check_file(path: str, cfg, tokenizer, show: int = 0, objective: str = "orpo", seed: int = 0) -> tuple:
    """A text report on one data source (read as ``data.train`` reads it), its bad-row count and
    the usable pairs that training would train on and hold out: ``(str, int, (list, list))``.

    Lists the bad rows and the dropped pairs (``file:line: reason``), the
    untruncated token lengths of prompt, chosen and rejected for the rows that
    render (count, min, median, p95, max), what ``max_prompt_length`` /
    ``max_length`` truncate, a warning counting raw prompts glued to their
    response (:func:`glued_rows`), and with ``show > 0`` the first ``show`` usable
    pairs exactly as they are trained (see :func:`show_pair`). Rows go through
    the same :func:`tokenize_rows` as training, in its order (the rows it trains on, then those it holds out), so
    both name the same first row that cannot be rendered. ``objective``: ``objective.kind``
    (``sft`` reads preference rows as their chosen side); rows with one completion are returned for the
    caller to refuse under a pairwise one, in training's order (after bad rows and no usable pair). Without held-out data of its
    own (``data.valid``, ...) training holds out ``data.valid_fraction`` of the prompts, split with ``seed``
    (``train.seed``; where prompts repeat the report counts the prompts and rows held out): the pairs returned are
    the rest and those (None where none of those is usable); with it, all of them and the pairs of
    that source, whose counts and bad and dropped rows follow the report's as ``held out: SOURCE: ...``. Rows are
    rendered with ``cfg.template_date`` (today's where it is null), named where a template writes it.

    Raises:
        DataError: the data or its held-out source cannot be read (missing, a folder of no known
            layout, empty, not JSON, unknown format, invalid JSON array), or the data config or
            tokenizer cannot render its rows; but where rows that cannot be read stop training first
            (``on_bad_row: error``), the report lists them and names the error, and no pair is returned.
    """
    cfg = dataclasses.replace(cfg, template_date=template_date(cfg))  # one day for every row, as training's
    train, valid = resolve_pair(dataclasses.replace(cfg, train=path))
    pairwise = objective != "sft"  # SFT reads preference rows' chosen side
    read = read_rows(train, cfg, pairwise)
    held_read = read_rows(valid, cfg, pairwise) if valid is not None else ([], BadRowReport())  # as training: first
    try:
        return _report(path, cfg, tokenizer, show, objective, seed, read, valid, held_read)
    except DataError as err:  # the template or tokenizer cannot render the rows
        report, held_report, noun = read[1], held_read[1], example_noun(objective)
        n_bad = len(report.bad) + len(held_report.bad)
        if not (n_bad and cfg.on_bad_row == "error"):
            raise
        # training stops on the rows it cannot read before it tokenizes any (load_dataset): they are its reason
        lines = [f"{path}: {report.rows_read} rows, {len(report.bad)} bad, {len(report.dropped)} dropped (not "
                 f"tokenized: {err})", report.summary(limit=20, noun=noun)]
        if valid is not None:
            lines += [f"held out: {valid.label}: {held_report.rows_read} rows, {len(held_report.bad)} bad, "
                      f"{len(held_report.dropped)} dropped", held_report.summary(limit=20, noun=noun)]
        return "\n".join(line for line in lines if line), n_bad, ([], [])


def _report(path: str, cfg, tokenizer, show: int, objective: str, seed: int, read: tuple, valid,
            held_read: tuple) -> tuple:
    """:func:`check_file`'s report of the rows ``read`` (and ``held_read`` of the source ``valid``) as
    ``read_rows`` gave them, tokenized."""
    from . import name_rows, prompt_groups, split_rows  # the package imports this module

    (rows, report), (held_rows, held_report) = read, held_read
    noun = example_noun(objective)
    results: list = []
    # training's order: the rows it trains on, then the valid_fraction it holds out, so the first row that cannot
    # be rendered and the bad rows listed are training's
    train_rows, split_out = (rows, []) if valid is not None else split_rows(rows, cfg.valid_fraction, seed)
    train, tok_report = tokenize_rows(train_rows, tokenizer, cfg, results)
    split_held, split_report = tokenize_rows(split_out, tokenizer, cfg, results)
    usable = {p.source: p for p in train + split_held}
    pairs = [usable[r.source] for r in rows if r.source in usable]  # shown in the file's order
    report = report.merge(dataclasses.replace(tok_report.merge(split_report), rows_read=0))
    rendered = [r for r in results if r.lengths != (0, 0, 0)]
    lines = [f"{path}: {report.rows_read} rows, {len(pairs)} usable, {len(report.bad)} bad, "
             f"{len(report.dropped)} dropped"]
    summary = report.summary(limit=20, noun=noun)
    if summary:
        lines.append(summary)
    lines.append(f"token lengths (untruncated, {len(rendered)} {noun}{'s' * (len(rendered) != 1)}): min / median / p95 / "
                 "max")
    sides = ("prompt", "chosen", "rejected") if objective != "sft" and any(r.lengths[2] for r in rendered) \
        else ("prompt", "chosen")
    for i, key in enumerate(sides):  # SFT rows have no rejected side
        lines.append(f"  {key:<9}{_stats([r.lengths[i] for r in rendered])}")
    lines.append(f"limits: max_prompt_length={cfg.max_prompt_length}, max_length={cfg.max_length}: "
                 f"{report.truncated} {noun}{'s' * (report.truncated != 1)} truncated, {report.prompt_cut_fits} of them "
                 "only because of max_prompt_length")
    # whole prompts held out: another share of rows, none where they all share one (it is kept to train on)
    if valid is None and cfg.valid_fraction > 0 and len(groups := prompt_groups(rows)) < len(rows):
        held = len(prompt_groups(split_out))
        end = ")" if held else f", one prompt kept to train on): no held-out {noun}s"
        lines.append(f"held out by data.valid_fraction {cfg.valid_fraction}: {held} of {len(groups)} prompts "
                     f"({len(split_out)} of {len(rows)} rows; rows that share a prompt stay on one side{end}")
    if split_out and not split_held:
        lines.append(f"held out by data.valid_fraction {cfg.valid_fraction}: {name_rows(split_out)}; none is usable")
    if dated := date_notice(tokenizer, cfg):
        lines.append(dated)
    glued = glued_rows(rows, tokenizer, cfg)
    if glued:
        lines.append(f"warning: {len(glued)} of {len(rows)} rows glue a raw prompt to its response with no "
                     f"whitespace between them (\"Say hi\" + \"hi\" trains \"Say hihi\"), first {glued[0]}; end "
                     "the prompts with a space or newline, or set data.prompt_template: chat")
    for n, pair in enumerate(pairs[:show], start=1):
        lines += show_pair(pair, tokenizer, n, noun)
    if valid is not None:  # held out in a source of its own (data.valid, valid.jsonl, a split): training reads it too
        held, held_tok = tokenize_rows(held_rows, tokenizer, cfg)
        held_report = held_report.merge(dataclasses.replace(held_tok, rows_read=0))
        lines.append(f"held out: {valid.label}: {held_report.rows_read} rows, {len(held)} usable, "
                     f"{len(held_report.bad)} bad, {len(held_report.dropped)} dropped")
        summary = held_report.summary(limit=20, noun=noun)
        if summary:
            lines.append(summary)
        return "\n".join(lines), len(report.bad) + len(held_report.bad), (train, held)
    # None: the rows held out gave no usable pair, which stops training (data.no_usable_split)
    return "\n".join(lines), len(report.bad), (train, None if split_out and not split_held else split_held)
