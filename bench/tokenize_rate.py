"""Tokenization rate of a large preference file: read, tokenize (cache miss), cache hit.

    python bench/tokenize_rate.py                        # 100k generated rows, demo tokenizer
    python bench/tokenize_rate.py --rows 5000 --format conversational

Writes ``--rows`` generated rows (seeded; prompts of 20-60 words, responses of
10-80, a system string on every fourth row) as JSONL, or as Parquet with
``--parquet``, into a temporary folder, then times with the demo model's
tokenizer (SmolLM2, ChatML template) and the default data config:

- read: ``sources.read_rows`` (stream, parse, normalise),
- key: ``cache.cache_key`` (hash of rows, config, tokenizer, code),
- miss: ``cache.tokenize_cached`` into an empty cache (key + tokenize + write),
  what a first run pays,
- hit: the same call again (key + read the entry), what a resume or a second
  run pays,

with peak RSS after each. Prints a markdown table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import platform
import random
import resource
import tempfile
import time
from pathlib import Path

from common import machine, write_results  # before MLX: preloads OpenBLAS

from dtrain.config import DataConfig  # noqa: E402
from dtrain.data import cache_key, read_rows, resolve, tokenize_cached  # noqa: E402

WORDS = ("the of and to in is was for on are with as by at from this that which or an be it not "
         "model data train value answer question number result because when where how many more "
         "first second third step sum total each every other same small large part whole").split()


def generate(n: int, fmt: str, seed: int) -> list:
    """``n`` preference rows in TRL ``standard`` or ``conversational`` layout."""
    rnd = random.Random(seed)
    words = lambda lo, hi: " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(lo, hi)))  # noqa: E731
    rows = []
    for i in range(n):
        prompt, chosen, rejected = words(20, 60) + "?", words(10, 80) + ".", words(10, 80) + "."
        system = words(5, 15) if i % 4 == 0 else None
        if fmt == "standard":
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "system": system})
        else:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def write(rows: list, folder: Path, parquet: bool) -> Path:
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "pairs.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        import json

        path = folder / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def rss_gb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return (peak if platform.system() == "Darwin" else peak * 1024) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--format", choices=("standard", "conversational"), default="standard")
    ap.add_argument("--parquet", action="store_true", help="write the rows as Parquet instead of JSONL")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from dtrain.models import load_model

    tokenizer = load_model("demo").tokenizer
    cfg = DataConfig()
    with tempfile.TemporaryDirectory(prefix="tokenize-rate-") as tmp:
        path = write(generate(args.rows, args.format, args.seed), Path(tmp), args.parquet)
        size_mb = path.stat().st_size / 1e6
        base_rss = rss_gb()
        times, rss = {}, {}
        t = time.perf_counter()
        rows, report = read_rows(resolve(str(path), cfg), cfg)
        times["read"], rss["read"] = time.perf_counter() - t, rss_gb()
        t = time.perf_counter()
        cache_key(rows, tokenizer, cfg)
        times["key"], rss["key"] = time.perf_counter() - t, rss_gb()
        cache = Path(tmp) / "data_cache"
        t = time.perf_counter()
        pairs, tok_report = tokenize_cached(rows, tokenizer, cfg, cache, progress=True, desc="bench")
        times["miss"], rss["miss"] = time.perf_counter() - t, rss_gb()
        t = time.perf_counter()
        again, _ = tokenize_cached(rows, tokenizer, cfg, cache)
        times["hit"], rss["hit"] = time.perf_counter() - t, rss_gb()
        assert again == pairs, "the cache hit differs from the tokenized pairs"
        entry_mb = sum(f.stat().st_size for f in cache.iterdir()) / 1e6
    tokens = sum(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs)
    n = len(rows)
    print(f"{args.rows} rows ({args.format}, {'Parquet' if args.parquet else 'JSONL'}, {size_mb:.1f} MB), "
          f"{n} parsed, {len(pairs)} pairs, {tokens / max(len(pairs), 1):.0f} tokens per pair "
          f"(prompt + chosen + rejected), {tok_report.truncated} truncated; cache entry {entry_mb:.1f} MB; "
          f"RSS before reading {base_rss:.2f} GB")
    print("\n| stage | s | pairs/s | peak RSS GB |\n|---|---|---|---|")
    for stage, label in (("read", "read + parse"), ("key", "cache key"), ("miss", "tokenize, cache miss (first run)"),
                         ("hit", "cache hit (resume, second run)")):
        print(f"| {label} | {times[stage]:.2f} | {n / times[stage]:,.0f} | {rss[stage]:.2f} |")
    info = machine()
    print(f"\nmachine: {info['cpu']}, {info['cores']} cores, {info['blas']}")  # Blas.line(): 'BLAS: ...'
    out = write_results("tokenize-rate", {"rows": args.rows, "format": args.format, "parquet": args.parquet,
                                          "file_mb": size_mb, "pairs": len(pairs), "tokens": tokens,
                                          "truncated": tok_report.truncated, "seconds": times, "peak_rss_gb": rss,
                                          "cache_entry_mb": entry_mb, "rss_before_gb": base_rss})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
