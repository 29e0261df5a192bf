"""The ``dtrain data check FILE`` report: bad rows and token-length statistics."""

from __future__ import annotations

import math

from .formats import BadRow, BadRowReport, parse_rows, read_objects
from .render import encode_row, end_of_turn, truncate_pair


def _stats(values: list) -> str:
    """``min / median / p95 / max`` of a list of ints (nearest-rank percentiles)."""
    if not values:
        return "-"
    v = sorted(values)
    median, p95 = (v[max(0, math.ceil(q * len(v)) - 1)] for q in (0.5, 0.95))
    return f"{v[0]} / {median} / {p95} / {v[-1]}"


def check_file(path: str, cfg, tokenizer) -> str:
    """A text report on one data file under the current data config.

    Lists the bad rows (``file:line: reason``), then, for the rows that parse,
    the untruncated token lengths of prompt, chosen and rejected (count, min,
    median, p95, max) and how many pairs ``max_prompt_length`` / ``max_length``
    would truncate or drop.

    Raises:
        DataError: the file cannot be read (missing, a directory, empty, unknown
            format, invalid JSON array).
    """
    rows, report = parse_rows(read_objects(path), cfg, path)
    eot = end_of_turn(tokenizer) if cfg.append_eos else ("", [])
    bos_id = getattr(tokenizer, "bos_token_id", None)
    lengths = {"prompt": [], "chosen": [], "rejected": []}
    tok_report = BadRowReport()
    for row in rows:
        try:
            p, c, r, rp = encode_row(row, tokenizer, cfg, eot)
        except BadRow as err:
            tok_report.bad.append((row.source, str(err)))
            continue
        for key, ids in (("prompt", p), ("chosen", c), ("rejected", r)):
            lengths[key].append(len(ids))
        _, c2, r2, _, truncated = truncate_pair(p, c, r, rp, cfg, bos_id)
        if not c2 or not r2:
            tok_report.dropped.append((row.source, "no response tokens fit"))
        else:
            tok_report.truncated += int(truncated)
    report = report.merge(tok_report)
    n_good = len(rows) - len(tok_report.bad)
    lines = [f"{path}: {report.rows_read} rows, {n_good} usable, {len(report.bad)} bad"]
    if report.bad:
        lines.append(BadRowReport(report.rows_read, report.bad).summary(limit=20))
    lines.append(f"token lengths (untruncated, {n_good} pairs): min / median / p95 / max")
    lines += [f"  {key:<9}{_stats(vals)}" for key, vals in lengths.items()]
    lines.append(f"limits: max_prompt_length={cfg.max_prompt_length}, max_length={cfg.max_length}: "
                 f"{tok_report.truncated} pairs truncated, {len(tok_report.dropped)} dropped (no response tokens fit)")
    return "\n".join(lines)
