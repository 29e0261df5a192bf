"""The ``dtrain data check FILE`` report: bad rows and token-length statistics."""

from __future__ import annotations

import dataclasses
import math

from .render import encode_rows, limit_pairs
from .sources import read_rows, resolve


def _stats(values: list) -> str:
    """``min / median / p95 / max`` of a list of ints (nearest-rank percentiles)."""
    if not values:
        return "-"
    v = sorted(values)
    median, p95 = (v[max(0, math.ceil(q * len(v)) - 1)] for q in (0.5, 0.95))
    return f"{v[0]} / {median} / {p95} / {v[-1]}"


def check_file(path: str, cfg, tokenizer) -> tuple[str, int]:
    """A text report on one data source (as ``data.train`` reads it), and its bad-row count.

    Lists the bad rows (``file:line: reason``), then, for the rows that parse,
    the untruncated token lengths of prompt, chosen and rejected (count, min,
    median, p95, max) and how many pairs ``max_prompt_length`` / ``max_length``
    would truncate or drop.

    Raises:
        DataError: the data cannot be read (missing, a folder of no known
            layout, empty, unknown format, invalid JSON array).
    """
    rows, report = read_rows(resolve(path, cfg), cfg)
    encoded, enc_report = encode_rows(rows, tokenizer, cfg)
    _, limited = limit_pairs(encoded, cfg, getattr(tokenizer, "bos_token_id", None))
    report = report.merge(dataclasses.replace(enc_report, rows_read=0))
    lengths = {"prompt": [len(p.prompt) for p in encoded], "chosen": [len(p.chosen) for p in encoded],
               "rejected": [len(p.rejected) for p in encoded]}
    lines = [f"{path}: {report.rows_read} rows, {len(encoded)} usable, {len(report.bad)} bad"]
    if report.bad:
        lines.append(report.summary(limit=20))
    lines.append(f"token lengths (untruncated, {len(encoded)} pairs): min / median / p95 / max")
    lines += [f"  {key:<9}{_stats(vals)}" for key, vals in lengths.items()]
    lines.append(f"limits: max_prompt_length={cfg.max_prompt_length}, max_length={cfg.max_length}: "
                 f"{limited.truncated} pairs truncated, {len(limited.dropped)} dropped (no response tokens fit)")
    return "\n".join(lines), len(report.bad)
