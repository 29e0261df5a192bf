"""Where preference rows come from: files, folders, saved datasets, the hub.

``data.train`` and ``data.valid`` each name one of (tried in this order):

- a Parquet file (told by its first bytes, ``PAR1``, or a ``.parquet``/``.pq`` name), read
  in record batches with pyarrow; a row's source is ``file.parquet:row N``
  (N 0-based, the row index as in ``ds[N]``);
- an Arrow file (told by its first bytes): an IPC stream, as ``datasets`` writes its
  ``*.arrow`` files, an IPC file (``ARROW1``, Feather v2) or a Feather v1 file (``FEA1``);
  sources ``file:row N``;
- any other file: JSONL, streamed line by line (``file:line``), or a JSON array,
  read whole (``file:line[index]``); gzip, bzip2, xz and zstd files (told by
  their first bytes, whatever their name) are decompressed as they stream, line
  numbers counting lines of the decompressed text; other archives and
  compressions (zip, 7z, lz4, tar, ...) are refused by name (``jsonfile``
  reads such a file);
- a ``datasets.save_to_disk`` folder: a Dataset (``state.json`` naming its
  ``data-0000i-of-0000N.arrow`` stream files) or a DatasetDict
  (``dataset_dict.json`` and one such folder per split). Read with pyarrow, so
  ``datasets`` is not needed; sources ``folder:row N`` / ``folder[split]:row N``;
- an mlx-lm data folder: ``train.jsonl`` for train, ``valid.jsonl`` for valid
  (``test.jsonl`` is never read);
- a folder of Parquet files, as ``hf download --repo-type dataset`` leaves it:
  the files whose name or folder is the split (``data/train-00000-of-00002.parquet``,
  ``train.parquet``, ``default/train/0000.parquet``), hidden ones (``._0000.parquet``) skipped;
  a folder holding files of the split in another type too (``train.jsonl``) is refused;
- a hub dataset id ``owner/name`` that is no local path, loaded with
  ``datasets.load_dataset(id, split=...)`` (optional extra ``dtrain[hf]``);
  one not in the ``datasets`` cache is first asked of the hub once, so an
  unreachable hub fails at once instead of after ``load_dataset``'s retries.

The split of a DatasetDict, Parquet folder or hub dataset is ``data.split`` for
the training rows and ``data.valid_split`` for the held-out rows. Every
container yields ``(source, object)`` items for :func:`formats.parse_rows`, so
every row format and ``data.fields`` mapping reads the same from each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..errors import DataError
from ..files import HUB_ID, sha256_file, unusable_path
from ..types import BadRowReport
from .formats import DETECT_ROWS, detect_items_format, json_kind, parse_rows
from .jsonfile import (ARROW_FILE, ARROW_STREAM, COMPRESSED_SUFFIXES, FEATHER_V1, PARQUET_MAGIC, json_items,
                       why_unread)
from .tables import BATCH_ROWS, file_items, table_items

PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather")
HUB_PROBE_TIMEOUT_S = 10.0  # one request asking the hub whether a dataset id exists
_ROLE_KEYS = {"train": ("data.train", "split", "data.split"), "valid": ("data.valid", "valid_split", "data.valid_split")}


@dataclass(frozen=True)
class Source:
    """One resolved container of rows.

    ``kind``: ``json`` (one JSONL/JSON file), ``parquet`` (Parquet files),
    ``arrow`` (Arrow files: a saved dataset's stream files, or one Arrow file) or ``hub`` (a loaded
    ``datasets.Dataset`` in ``dataset``). ``files``: what is read, in order (for
    ``hub``, the dataset's Arrow cache files). ``label``: prefix of row sources
    and messages. ``split``: the split read, if the container has splits.
    """

    kind: str
    files: tuple
    label: str
    split: Optional[str] = None
    dataset: Any = None


def resolve(spec: str, cfg, role: str = "train") -> Source:
    """The container named by ``spec`` (``data.train`` or ``data.valid``), for ``role``.

    Raises:
        DataError: the path does not exist and is no hub id; a folder of no known
            layout; a split that the container does not have, or none chosen for
            ``valid``; a hub dataset that cannot be loaded (one line saying how to
            download it when offline).
    """
    key, split_attr, split_key = _ROLE_KEYS[role]
    split = getattr(cfg, split_attr)
    try:
        p = Path(spec).expanduser()  # ~ as model.path and data.chat_template read it (YAML expands nothing)
        is_file, is_dir = p.is_file(), p.is_dir()
    except RuntimeError:  # ~user of no user here
        raise DataError(f"{spec}: data file not found ({key}): no home folder for {spec.split('/')[0]}") from None
    except OSError as err:  # a name too long for the file system
        raise DataError(f"{unusable_path(spec, err)} ({key})") from None
    if is_file:
        return _file_source(p, spec)
    if is_dir:
        return _folder(p, spec, role, split, key, split_key)
    if is_hub_id(spec):
        return _hub(spec, split, key, split_key)
    if p.exists():  # a pipe (<(zcat ...)), a socket or a device
        raise DataError(f"{spec}: not a regular file ({key}); data is read more than once (its format, its "
                        f"fingerprint), so write it to a file first (compressed files are read as they are)")
    placeholder = "; it is the config's placeholder: pass the data with --" + key if spec.startswith("PATH/TO/") else ""
    raise DataError(f"{spec}: data file not found ({key}){placeholder}")


def is_hub_id(spec: str) -> bool:
    """``spec`` names no local file or folder and reads as a hub dataset id ``owner/name``.

    A data-file suffix (``.jsonl``, ``.JSON``, ``.parquet``, ``.arrow``, ``.gz`` ..., any case) marks a missing file,
    not an id.
    """
    p = Path(spec)
    try:
        exists = p.exists()
    except OSError:  # a name too long for the file system, and for a hub id
        return False
    return (not exists and bool(HUB_ID.fullmatch(spec))
            and p.suffix.lower() not in (".json", ".jsonl", *PARQUET_SUFFIXES, *ARROW_SUFFIXES, *COMPRESSED_SUFFIXES))


def resolve_pair(cfg) -> tuple:
    """``(train, valid_or_None)`` sources of a DataConfig with ``train`` set.

    Without ``data.valid`` the held-out rows come from ``data.train``'s own
    container when it has them: ``data.valid_split`` of a split container, or
    ``valid.jsonl`` of an mlx-lm folder. None means: split by ``valid_fraction``.

    Raises:
        DataError: as :func:`resolve`; ``data.valid_split`` set while
            ``data.train`` is a single file or saved Dataset.
    """
    train = resolve(cfg.train, cfg, "train")
    if cfg.valid is not None:
        return train, resolve(cfg.valid, cfg, "valid")
    if cfg.valid_split is not None:
        if train.split is None:
            raise DataError(f"data.valid_split ({cfg.valid_split}) needs data.train to have splits "
                            f"(a DatasetDict folder, a Parquet folder or a hub id); {cfg.train} has none")
        return train, resolve(cfg.train, cfg, "valid")
    if mlx_valid(cfg.train) is not None:
        return train, resolve(cfg.train, cfg, "valid")
    return train, None


def mlx_valid(spec: str) -> Optional[Path]:
    """``valid.jsonl`` of ``spec`` when it names an mlx-lm data folder that has one (its held-out rows), else None."""
    folder = Path(spec).expanduser()
    saved = any((folder / name).is_file() for name in ("dataset_dict.json", "state.json"))  # read first by resolve
    return folder / "valid.jsonl" if folder.is_dir() and not saved and (folder / "valid.jsonl").is_file() else None


def _folder(p: Path, spec: str, role: str, split: Optional[str], key: str, split_key: str) -> Source:
    if (p / "dataset_dict.json").is_file():
        splits = _json_file(p / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):  # text: "rain" in "train"
            raise DataError(f"{p / 'dataset_dict.json'}: unreadable ('splits' must be a list of split names)")
        if split is None or split not in splits:
            what = f"has no split {split!r}" if split is not None else "is a DatasetDict"
            raise DataError(f"{spec}: {what} (splits: {', '.join(splits)}); set {split_key}")
        return Source("arrow", _arrow_files(p / split), f"{spec}[{split}]", split)
    if (p / "state.json").is_file():
        return Source("arrow", _arrow_files(p), spec)
    mlx = {"train": "train.jsonl", "valid": "valid.jsonl"}
    if any((p / name).is_file() for name in mlx.values()):
        f = p / mlx[role]
        if not f.is_file():
            raise DataError(f"{spec}: mlx-lm data folder without {mlx[role]} ({key})")
        return _file_source(f, str(f))
    # hidden names are no data: a Mac's AppleDouble files (._0000.parquet), .Trash, .ipynb_checkpoints
    files = sorted(q for q in p.rglob("*") if q.is_file()
                   and not any(part.startswith(".") for part in q.relative_to(p).parts))
    parquet = [q for q in files if q.suffix == ".parquet"]
    if parquet:
        if split is None:
            raise DataError(f"{spec}: a folder of Parquet files; set {split_key} to choose the files")
        chosen = tuple(q for q in parquet if _names_split(q.relative_to(p), split))
        if not chosen:
            shown = ", ".join(str(q.relative_to(p)) for q in parquet[:5]) + (", ..." if len(parquet) > 5 else "")
            raise DataError(f"{spec}: no Parquet file of split {split!r} ({shown}); set {split_key}")
        folders = sorted({str(q.parent.relative_to(p)) for q in chosen})
        if len(folders) > 1:  # a hub dataset's configs (main/train-*.parquet, socratic/train-*.parquet)
            raise DataError(f"{spec}: Parquet files of split {split!r} in {len(folders)} folders "
                            f"({', '.join(folders)}), one per dataset config as the hub lays them out; set {key} "
                            "to one of them")
        others = [str(q.relative_to(p)) for q in files if _other_data(q.relative_to(p), split)]
        if others:  # the split's rows in two file types: reading the Parquet ones alone would drop the rest unsaid
            raise DataError(f"{spec}: Parquet files of split {split!r} beside other data files of it "
                            f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}), and only the Parquet "
                            f"files would be read; move the others out of the folder, or set {key} to one file")
        return Source("parquet", chosen, f"{spec}[{split}]", split)
    raise DataError(f"{spec}: is a directory but no data folder ({key}); expected a JSONL/JSON/Parquet file, or a "
                    "folder holding train.jsonl/valid.jsonl (mlx-lm), a datasets.save_to_disk folder (state.json "
                    "or dataset_dict.json) or Parquet files")


def _file_source(path: Path, label: str) -> Source:
    """One file: Parquet when it starts with Parquet's magic ``PAR1`` or is named ``.parquet``/``.pq`` (any case),
    Arrow when it starts as an Arrow IPC stream (``datasets``' ``*.arrow`` files) or file (``ARROW1``, Feather v2)
    or as Feather v1 (``FEA1``), else JSON/JSONL.

    Raises:
        DataError: the file cannot be read; one named ``.arrow``/``.feather`` (any case) that does not start as one.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as err:  # no read permission, a file on a disconnected share
        raise DataError(f"{label}: cannot be read: {err.strerror or err}") from None
    if head[:4] == PARQUET_MAGIC or path.suffix.lower() in PARQUET_SUFFIXES:
        return Source("parquet", (path,), label)
    if head[:4] in (ARROW_STREAM, FEATHER_V1) or head == ARROW_FILE:
        return Source("arrow", (path,), label)
    if head and path.suffix.lower() in ARROW_SUFFIXES:  # else read as JSONL and called 'not a JSONL file'
        raise DataError(f"{label}: not a readable Arrow file: it does not start as one (an Arrow IPC stream or file, "
                        "or Feather)")
    return Source("json", (path,), label)


def _names_split(rel: Path, split: str) -> bool:
    """``train.parquet``, ``train-00000-of-00002.parquet`` or ``train/...`` (hub layouts)."""
    return split in rel.parts[:-1] or rel.stem == split or rel.stem.startswith(split + "-")


def _other_data(rel: Path, split: str) -> bool:
    """``rel`` names a data file of ``split`` that a Parquet folder does not read: JSON/JSONL (compressed too), Arrow,
    CSV, or Parquet compressed or not named ``.parquet``."""
    name = rel.name.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    data = Path(name).suffix in (".jsonl", ".json", ".arrow", ".feather", ".csv", ".tsv", *PARQUET_SUFFIXES)
    return rel.suffix != ".parquet" and data and _names_split(rel.with_name(rel.name.split(".")[0]), split)


def _json_file(path: Path) -> dict:
    """A saved dataset's ``state.json`` or ``dataset_dict.json``.

    Raises:
        DataError: the file cannot be read, is not JSON, or holds no JSON object.
    """
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: unreadable ({err})") from None
    except (RecursionError, ValueError) as err:  # too deep for json, or a number too long for int()
        raise DataError(f"{path}: unreadable ({why_unread(err)})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: unreadable (expected a JSON object, got {json_kind(obj)})")
    return obj


def _arrow_files(folder: Path) -> tuple:
    """The Arrow stream files of one saved Dataset, in row order (``state.json``)."""
    if not (folder / "state.json").is_file():
        raise DataError(f"{folder}: no state.json (not a datasets.save_to_disk folder)")
    entries = _json_file(folder / "state.json").get("_data_files", [])
    if not isinstance(entries, list) or not all(isinstance(f, dict) and isinstance(f.get("filename"), str)
                                                for f in entries):
        raise DataError(f"{folder / 'state.json'}: unreadable ('_data_files' must be a list of objects with a "
                        f"'filename' string)")
    files = tuple(folder / f["filename"] for f in entries if f["filename"])
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise DataError(f"{folder}: state.json names {'missing files ' + ', '.join(missing) if missing else 'no data files'}")
    return files


def _hub(spec: str, split: Optional[str], key: str, split_key: str) -> Source:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{spec}: no such file or folder; to read it as a Hugging Face hub dataset install "
                        "the datasets library: pip install 'dtrain[hf]'") from None
    if split is None:
        raise DataError(f"{spec}: a hub dataset; set {split_key} ({key})")
    offline = DataError(f"{spec}: no such file or folder, and as a hub dataset it is not in the local cache and the "
                        f"hub cannot be reached (offline?); download it where there is network: hf download "
                        f"--repo-type dataset {spec} --local-dir DIR, then set {key}: DIR")
    # load_dataset retries an unreachable hub for ~25 s, logging each try; one request says it first
    if not _in_datasets_cache(spec) and _hub_unreachable(spec):
        raise offline
    try:
        ds = datasets.load_dataset(spec, split=split)
    except ConnectionError:
        raise offline from None
    except Exception as err:  # the library's own message names the missing dataset, split or file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"{spec}: hub dataset, split {split!r}: {first}") from None
    return dataset_source(ds, f"{spec}[{split}]", split)


def _in_datasets_cache(spec: str) -> bool:
    """``datasets`` has loaded hub dataset ``spec`` before: its cache holds ``owner___name/CONFIG/VERSION/HASH``
    (the folders ``datasets.load``'s ``CachedDatasetModuleFactory`` reads when the hub cannot be reached)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    owner, name = spec.split("/")
    root = Path(datasets.config.HF_DATASETS_CACHE).expanduser() / f"{owner}___{camelcase_to_snakecase(name)}"
    return any(p.is_dir() for p in root.glob("*/*/*"))


def _hub_unreachable(spec: str) -> bool:
    """True when one request for ``spec``'s info (no retries, :data:`HUB_PROBE_TIMEOUT_S`) cannot reach the hub.

    Any answer (found, not found, gated) is reachable: ``load_dataset`` then says what it found.
    """
    from huggingface_hub import HfApi

    try:  # the HTTP client huggingface_hub uses, as datasets catches it; requests' errors (older hubs) are OSErrors
        from huggingface_hub.utils import httpx

        transport = (httpx.TransportError,)
    except ImportError:
        transport = ()
    try:
        HfApi().dataset_info(spec, timeout=HUB_PROBE_TIMEOUT_S)
    except (OSError, *transport):  # OfflineModeIsEnabled (HF_HUB_OFFLINE=1) is a ConnectionError
        return True
    except Exception:  # noqa: BLE001 -- an HTTP error is an answer
        return False
    return False


def dataset_source(ds, label: str, split: Optional[str] = None) -> Source:
    """A :class:`Source` over a ``datasets.Dataset`` (as ``load_dataset`` returns it).

    Raises:
        DataError: a dataset held only in memory (no Arrow cache files, so no
            content to fingerprint).
    """
    if not ds.cache_files:
        raise DataError(f"{label}: the dataset has no Arrow cache files (held in memory); save it with save_to_disk")
    return Source("hub", tuple(Path(f["filename"]) for f in ds.cache_files), label, split, ds)


def read_items(src: Source) -> Iterator[tuple]:
    """Yield ``(source, obj_or_BadRow)`` in row order, one record batch or line at a time.

    Raises:
        DataError: an empty or unreadable file (as a whole); a table with a column name given twice.
    """
    if src.kind == "json":
        yield from json_items(str(src.files[0]))
        return
    if src.kind == "hub":
        yield from table_items(src.dataset.with_format("arrow").iter(batch_size=BATCH_ROWS), src.label)
        return
    yield from file_items(src.kind, src.files, src.label)


def read_rows(src: Source, cfg, pairwise: bool = True) -> tuple:
    """Read and normalise a source's rows: ``(list[Row], BadRowReport)``; ``pairwise`` False
    (``objective.kind: sft``) reads preference rows as their chosen side (:func:`formats.parse_rows`).

    Items are parsed :data:`BATCH_ROWS` at a time, so only one batch of raw
    objects is alive besides the rows; ``format: auto`` is decided once, from the
    first :data:`formats.DETECT_ROWS` objects of the source (as
    :func:`formats.parse_rows` decides it for a list).

    Raises:
        DataError: a source without rows, and as :func:`read_items` and
            :func:`formats.parse_rows`.
    """
    items = read_items(src)
    head, objects = [], 0  # items up to the DETECT_ROWS-th object, which decide the format
    for item in items:
        head.append(item)
        objects += isinstance(item[1], dict)
        if objects == DETECT_ROWS:
            break
    if not head:
        raise DataError(f"{src.label}: no rows")
    chunk_cfg = cfg
    if cfg.format == "auto":
        chunk_cfg = dataclasses.replace(cfg, format=detect_items_format(head, cfg.fields or None, src.label))
    rows, report = [], BadRowReport()
    stream = itertools.chain(head, items)
    while chunk := list(itertools.islice(stream, BATCH_ROWS)):
        part, part_report = parse_rows(chunk, chunk_cfg, src.label, pairwise)
        rows += part
        report.rows_read += part_report.rows_read
        report.bad += part_report.bad
        report.dropped += part_report.dropped
    return rows, report


def fingerprint(sources: list) -> str:
    """sha256 hex of the data content, as ``Dataset.fingerprint``.

    One JSON file: ``sha256sum`` of its bytes. Other containers: sha256 of
    ``kind``, split and each file's sha256, in read order (paths do not count,
    so a moved folder keeps its fingerprint). Several sources: sha256 of their
    digests joined by spaces.
    """
    digests = []
    for src in sources:
        if src.kind == "json":
            digests.append(sha256_file(src.files[0]))
        else:
            parts = [src.kind, src.split or ""] + [sha256_file(f) for f in src.files]
            digests.append(hashlib.sha256("\n".join(parts).encode()).hexdigest())
    return digests[0] if len(digests) == 1 else hashlib.sha256(" ".join(digests).encode()).hexdigest()
