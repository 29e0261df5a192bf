"""One Arrow or Parquet file (or a hub dataset's Arrow batches) → raw items, read with pyarrow a record
batch at a time: ``file:row N`` sources, rows made JSON-able where a column's type is not (timestamps,
binary), JSON text of Arrow's ``arrow.json`` type and maps read as the values they hold, bytes that are not
UTF-8 a bad row. :mod:`.sources` picks the container; :mod:`.jsonfile` reads JSON.
"""

from __future__ import annotations

import json
import re
from typing import Iterator, Optional

from ..errors import BadRow, DataError
from .formats import undecodable
from .jsonfile import ARROW_FILE, FEATHER_V1, first_repeat, json_value

BATCH_ROWS = 1024  # Arrow/Parquet record batch size, and rows parsed at a time


def file_items(kind: str, files: tuple, label: str) -> Iterator[tuple]:
    """``(source, obj_or_BadRow)`` of Parquet (``kind`` "parquet") or Arrow files in row order, a record batch
    at a time; Arrow files (a saved dataset's) number their rows across the files, as ``ds[n]``.

    Raises:
        DataError: a file pyarrow cannot read, or a column name given twice (:func:`table_items`).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 0
    for f in files:
        try:
            if kind == "parquet":
                with pq.ParquetFile(f) as pf:
                    yield from table_items(pf.iter_batches(batch_size=BATCH_ROWS), str(f))
            else:
                with pa.memory_map(str(f)) as mm:
                    n = yield from table_items(arrow_batches(mm), label, n)
        except (pa.ArrowException, OSError) as err:
            what = "Parquet" if kind == "parquet" else "Arrow"
            raise DataError(f"{f}: not a readable {what} file: {err}") from None


def arrow_batches(mm):
    """Record batches of an Arrow IPC stream, of an Arrow IPC file (``ARROW1``: Feather v2), or of a Feather v1 file."""
    import warnings

    import pyarrow as pa
    import pyarrow.feather as feather

    head = mm.read(6)
    if head[:4] == FEATHER_V1:
        with warnings.catch_warnings():  # pyarrow 25 deprecated V1; while it reads it, the data is the user's to keep
            warnings.simplefilter("ignore", DeprecationWarning)
            return feather.read_table(mm).to_batches(BATCH_ROWS)
    if head != ARROW_FILE:
        mm.seek(0)
        return pa.ipc.open_stream(mm)
    reader = pa.ipc.open_file(mm)
    return (reader.get_batch(i) for i in range(reader.num_record_batches))


def table_items(batches, label: str, start: int = 0):
    """Items of Arrow record batches (or tables); returns the next row number.

    Raises:
        DataError: a column name given twice, or a field name twice in a struct column.
    """
    n = start
    for batch in batches:
        names = batch.schema.names
        twice = first_repeat(names)
        if twice is not None:  # a row dict would keep the last column's value
            raise DataError(f"{label}: column {twice!r} appears twice (columns: {', '.join(names)}); "
                            "rename or drop one")
        for name, t in zip(names, batch.schema.types):
            if (found := _field_twice(name, t)) is not None:  # a row dict holds one (pyarrow 26: a ValueError)
                column, field, fields = found
                raise DataError(f"{label}: column {column!r} holds field {field!r} twice (fields: "
                                f"{', '.join(fields)}); rename or drop one")
        texts = [(name, t) for name, t in zip(names, batch.schema.types) if _json_text(t)]
        plain = not all(_json_type(t) for t in batch.schema.types)
        try:  # a map column (Spark writes messages as map<string, string>) as objects, not (key, value) pairs
            objs = batch.to_pylist(maps_as_pydicts="strict")
        except (UnicodeDecodeError, KeyError):  # bytes that are not UTF-8 (unchecked on write); a map's key twice
            objs = [_row_or_bad(batch.slice(i, 1)) for i in range(batch.num_rows)]
        for obj in objs:
            if texts and not isinstance(obj, BadRow):
                obj = _json_read(obj, texts)
            if plain and not isinstance(obj, BadRow):  # e.g. timestamp or binary columns: make the row JSON-able
                obj = {k: _plain(v) for k, v in obj.items()}
                obj = undecodable(json.dumps(obj, ensure_ascii=False)) or obj
            yield f"{label}:row {n}", obj
            n += 1
    return n


def _field_twice(column: str, t) -> Optional[tuple]:
    """``(column, field, fields)`` of the first struct in Arrow type ``t`` (lists looked into) that names a
    field twice; ``column`` is the dotted path to it, e.g. ``input.messages``."""
    import pyarrow.types as pt

    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _field_twice(column, t.value_type)
    if not pt.is_struct(t):
        return None
    fields = [t.field(i).name for i in range(t.num_fields)]
    if (twice := first_repeat(fields)) is not None:
        return column, twice, fields
    for i, name in enumerate(fields):
        found = _field_twice(f"{column}.{name}", t.field(i).type)
        if found is not None:
            return found
    return None


def _row_or_bad(row):
    """The one row of ``row`` (a record batch or table), or a bad row naming its first byte that is not UTF-8 or
    the key a map gives twice."""
    try:
        return row.to_pylist(maps_as_pydicts="strict")[0]
    except UnicodeDecodeError as err:
        return undecodable(err.object.decode("utf-8", errors="surrogateescape"))
    except KeyError as err:  # pyarrow: '... (duplicate key was 'role').'
        key = re.search(r"duplicate key was (.*)\)", str(err.args[0]))
        return BadRow(f"a map gives a key twice ({key.group(1) if key else err.args[0]})")


def _json_type(t) -> bool:
    """True when Arrow type ``t`` converts to JSON-able Python values (str, numbers, lists, dicts)."""
    import pyarrow.types as pt

    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _json_type(t.value_type)
    if pt.is_struct(t):
        return all(_json_type(t.field(i).type) for i in range(t.num_fields))
    return (pt.is_string(t) or pt.is_large_string(t) or pt.is_integer(t) or pt.is_floating(t)
            or pt.is_boolean(t) or pt.is_null(t) or _is_json_text(t))


def _is_json_text(t) -> bool:
    """Arrow type ``t`` is the ``arrow.json`` extension: JSON text, as ``datasets`` >= 5 stores its ``Json`` feature
    (a column whose objects do not share their keys: a message with a ``name``, another with a ``weight``)."""
    return getattr(t, "extension_name", None) == "arrow.json"


def _json_text(t) -> bool:
    """Arrow type ``t`` is or holds (in lists and structs) :func:`_is_json_text` values."""
    import pyarrow.types as pt

    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _json_text(t.value_type)
    if pt.is_struct(t):
        return any(_json_text(t.field(i).type) for i in range(t.num_fields))
    return _is_json_text(t)


def _json_read(obj: dict, columns: list):
    """``obj`` with the JSON text in its ``columns`` (``[(name, Arrow type)]``) read as the values it holds, or a
    bad row naming the column whose text is not JSON."""
    for name, t in columns:
        try:
            obj = {**obj, name: _parsed(obj[name], t)}
        except BadRow as err:
            return BadRow(f"{name!r} (JSON text): {err}")
    return obj


def _parsed(value, t):
    """``value`` of Arrow type ``t`` with each :func:`_is_json_text` value in it read (raises BadRow: not JSON)."""
    import pyarrow.types as pt

    if value is None:
        return None
    if _is_json_text(t):
        return json_value(value)
    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return [_parsed(v, t.value_type) for v in value]
    if pt.is_struct(t):
        return {k: _parsed(v, t.field(k).type) for k, v in value.items()}
    return value


def _plain(value):
    """JSON-able copy: bytes decoded (bad UTF-8 kept as surrogates, reported per row), others ``str``."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
