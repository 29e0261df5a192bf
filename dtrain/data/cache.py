"""Tokenized pairs cached by content, so a resume or a second run does not tokenize again.

An entry's name is the sha256 of everything its pairs depend on: the rows (every
field, sources included; an SFT run reads a preference row without its rejected side,
``formats.parse_rows(pairwise=False)``, so it never shares a pairwise run's entry), every
``data`` config key that decides how a row is tokenized (a ``chat_template`` file by its
text; ``template_date`` only where the template calls ``strftime_now``; not :data:`ROW_KEYS`),
the tokenizer (its full ``tokenizer.json`` serialisation, chat template and special tokens), the
source of the data package and types.py, and the versions
of the libraries that render and tokenize (jinja2, transformers, tokenizers, mlx-lm). Entries
are ``.npz`` files (no pickle) written atomically, each naming its key inside; a damaged entry (arrays
of another dtype or that do not add up too), or one under another entry's name, counts as absent and is
written again. A tokenizer that cannot be serialised is never cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Optional

from ..files import new_temp_file
from ..types import BadRowReport, TokenizedPair
from .render import tokenize_rows
from .templates import run_reads_clock, template_source

CACHE_VERSION = 1  # bump when the entry layout changes
CHUNK_ROWS = 512  # rows tokenized between progress-bar updates
# data keys that decide which rows are read, not how a row is tokenized: the rows (hashed) carry their effect
ROW_KEYS = ("train", "valid", "split", "valid_split", "valid_fraction", "format", "fields", "on_bad_row",
            "demo_pairs", "demo_seed")


def tokenizer_identity(tokenizer) -> Optional[str]:
    """sha256 hex of what decides a tokenizer's output, or None when it cannot be serialised.

    Covers the Hugging Face fast tokenizer's ``backend_tokenizer.to_str()``
    (vocabulary, merges, normaliser, pre-tokenizer, post-processor, added
    tokens; add-BOS/EOS flags live in its post-processor), the chat template,
    the special tokens, ``split_special_tokens`` and the Python renderer mlx-lm's ``TokenizerWrapper``
    renders with instead of the template where the tokenizer names one
    (``chat_template_type``); works through the wrapper, which forwards
    attributes to the HF tokenizer.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    renderer = getattr(tokenizer, "_chat_template", None)  # the wrapper's own (its apply_chat_template calls it)
    facts = {"backend": backend.to_str(), "chat_template": getattr(tokenizer, "chat_template", None),
             "renderer": renderer and f"{renderer.__module__}.{renderer.__qualname__}"}
    # split_special_tokens (tokenizer_config.json) reads control-token text as text, outside tokenizer.json
    for name in ("bos_token", "eos_token", "pad_token", "bos_token_id", "eos_token_id", "all_special_tokens",
                 "split_special_tokens"):
        facts[name] = getattr(tokenizer, name, None)
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _code_identity() -> str:
    import jinja2  # renders every chat template (transformers' apply_chat_template)
    import mlx_lm
    import tokenizers
    import transformers

    here = Path(__file__).resolve().parent
    parts = [f"v{CACHE_VERSION}", tokenizers.__version__, transformers.__version__, mlx_lm.__version__,
             jinja2.__version__]
    # every module of the data package (render.py, templates.py, ...) and the pair type
    parts += [hashlib.sha256(p.read_bytes()).hexdigest() for p in [*sorted(here.glob("*.py")), here.parent / "types.py"]]
    return " ".join(parts)


def cache_key(rows: list, tokenizer, cfg) -> Optional[str]:
    """sha256 hex naming the tokenized result of ``rows`` (see the module docstring), or None."""
    tok = tokenizer_identity(tokenizer)
    if tok is None:
        return None
    h = hashlib.sha256(f"{_code_identity()}\n{tok}\n".encode())
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ROW_KEYS}
    if not run_reads_clock(tokenizer, cfg):
        settings.pop("template_date", None)  # only a template that calls strftime_now is given the day
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    if cfg.chat_template is not None:  # a Jinja file's text, not only its path
        h.update(template_source(cfg.chat_template).encode())
    for row in rows:
        h.update(repr(row).encode("utf-8", errors="surrogatepass"))
    return h.hexdigest()


def tokenize_cached(rows: list, tokenizer, cfg, cache_dir: Optional[Path], progress: bool = False,
                    desc: str = "", pending: Optional[list] = None, noun: str = "pair") -> tuple:
    """:func:`render.tokenize_rows` with a content-addressed cache in ``cache_dir``.

    Returns ``(list[TokenizedPair], BadRowReport)``, equal to ``tokenize_rows``'
    result. ``cache_dir=None`` turns the cache off. A miss tokenizes in chunks
    with a tqdm bar on stderr (``progress``; shown after one second) counting
    ``noun`` (sft's ``row``: :func:`dtrain.types.example_noun`) and writes
    the entry, or appends ``(path, pairs, report)`` to ``pending`` for
    :func:`write_entries` (a run writes once it owns its output folder).

    Raises:
        DataError: as ``render.RowTokenizer`` raises it.
    """
    key = cache_key(rows, tokenizer, cfg) if cache_dir is not None and rows else None
    path = Path(cache_dir) / f"{key}.npz" if key else None
    if path is not None and path.is_file():
        loaded = _load(path)
        if loaded is not None:
            return loaded
    pairs, report = _tokenize(rows, tokenizer, cfg, progress, desc, noun)
    if path is not None:
        entry = (path, pairs, report)
        pending.append(entry) if pending is not None else write_entries([entry])
    return pairs, report


def entries_bytes(entries: list) -> int:
    """About the bytes :func:`write_entries` writes for ``entries`` (:func:`_save`'s layout, uncompressed: int32
    token ids, four int64 lengths and a source name in the JSON metadata, which numpy keeps as UTF-32, per pair;
    2 KiB per entry for the zip's and arrays' headers and the bad-row report)."""
    return sum(sum(4 * (len(p.prompt) + len(p.chosen) + len(p.rejected) + len(p.rejected_prompt or []))
                   + 32 + 4 * (len(p.source or "") + 4) for p in pairs) + 2048 for _, pairs, _ in entries)


def write_entries(entries: list) -> None:
    """Write ``(path, pairs, report)`` cache entries; one that cannot be written is skipped."""
    for path, pairs, report in entries:
        try:
            _save(path, pairs, report)
        except OSError:
            pass  # a read-only or full disk costs only the next run's tokenization


def _tokenize(rows: list, tokenizer, cfg, progress: bool, desc: str, noun: str) -> tuple:
    from tqdm import tqdm

    pairs, report = [], BadRowReport()
    label = f"tokenizing {desc}".strip()
    with tqdm(total=len(rows), desc=label, unit=noun, disable=not progress, delay=1.0, file=sys.stderr) as bar:
        for i in range(0, len(rows), CHUNK_ROWS):
            part, part_report = tokenize_rows(rows[i:i + CHUNK_ROWS], tokenizer, cfg)
            pairs += part
            report = _add(report, part_report)
            bar.update(min(CHUNK_ROWS, len(rows) - i))
    return pairs, report


def _add(report: BadRowReport, other: BadRowReport) -> BadRowReport:
    """``report`` with ``other``'s counts added and entries appended, in place."""
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        if isinstance(value, list):
            value.extend(getattr(other, f.name))
        else:
            setattr(report, f.name, value + getattr(other, f.name))
    return report


def _save(path: Path, pairs: list, report: BadRowReport) -> None:
    """One ``.npz``: all token ids (int32), per-pair lengths (-1: no rejected prompt), JSON metadata."""
    import numpy as np  # here, not at import: numpy maps a BLAS, and `import dtrain` must load none (blas.py)

    lengths = np.array([[len(p.prompt), len(p.chosen), len(p.rejected),
                         -1 if p.rejected_prompt is None else len(p.rejected_prompt)] for p in pairs],
                       dtype=np.int64).reshape(-1, 4)
    tokens = np.fromiter((t for p in pairs for part in (p.prompt, p.chosen, p.rejected, p.rejected_prompt or [])
                          for t in part), dtype=np.int32)
    meta = {"key": path.stem, "sources": [p.source for p in pairs], "report": dataclasses.asdict(report)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(path.parent, ".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, tokens=tokens, lengths=lengths, meta=np.array(json.dumps(meta)))
        os.replace(tmp, path)  # atomic: ranks writing the same entry at once leave one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> Optional[tuple]:
    """The entry's ``(pairs, report)``, or None when it cannot be read (damaged: it is then written again)."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, lengths, meta = z["tokens"], z["lengths"], json.loads(str(z["meta"]))
        # an entry renamed or copied over another (a hand edit) holds that other key's pairs; arrays of another
        # dtype or that do not add up (_save's layout) would decode as float, wrapped or cut-short ids
        whole = (meta["key"] == path.stem and tokens.dtype == np.int32 and tokens.ndim == 1
                 and lengths.dtype == np.int64 and lengths.ndim == 2 and lengths.shape[1] == 4
                 and len(meta["sources"]) == len(lengths) and (tokens.size == 0 or tokens.min() >= 0)
                 and (lengths[:, :3] >= 0).all() and (lengths[:, 3] >= -1).all()
                 and int(lengths.clip(min=0).sum()) == tokens.size)
        return _decode(tokens.tolist(), lengths.tolist(), meta) if whole else None
    # A damaged entry raises from zipfile (BadZipFile; NotImplementedError for an unknown method or
    # version; RuntimeError "encrypted"), numpy's header parser (SyntaxError, tokenize.TokenError,
    # ValueError) or json; flipped data fails the zip's CRC. Any of these: the entry is absent.
    except Exception:  # noqa: BLE001
        return None


def _decode(tokens: list, lengths: list, meta: dict) -> tuple:
    pairs, pos = [], 0
    for (p, c, r, rp), source in zip(lengths, meta["sources"]):
        parts = []
        for n in (p, c, r, max(rp, 0)):
            parts.append(tokens[pos:pos + n])
            pos += n
        pairs.append(TokenizedPair(prompt=parts[0], chosen=parts[1], rejected=parts[2], source=source,
                                   rejected_prompt=parts[3] if rp >= 0 else None))
    # JSON turned the (source, reason) tuples of the report's lists into lists
    report = {k: [tuple(e) for e in v] if isinstance(v, list) else v for k, v in meta["report"].items()}
    return pairs, BadRowReport(**report)
