"""JSON and JSONL files as ``(source, object)`` items, plain or compressed.

A JSONL file is streamed line by line (``file:line``), a JSON array read whole
(``file:line[index]``); gzip, bzip2, xz and zstd files, told by their first
bytes whatever their name, are decompressed as they stream, line numbers
counting lines of the decompressed text; other archives and compressions, and
compressed Parquet or Arrow files, are refused by name. :mod:`.sources` picks the container; this module reads one file.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import re
import sys
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Optional

from ..errors import BadRow, DataError
from .formats import json_kind, rows_under, undecodable

# A JSONL line (or JSON array item) longer than this is reported instead of tokenized:
# ~500k tokens, far past any max_length, and slow to tokenize.
MAX_LINE_CHARS = 2_000_000
# Compressions read as a stream: name -> (magic bytes, opener of a binary file object).
_STREAMED = {
    "gzip": (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f)),
    "bzip2": (b"BZh", lambda f: bz2.BZ2File(f)),
    "xz": (b"\xfd7zXZ\x00", lambda f: lzma.LZMAFile(f)),
    "zstd": (b"\x28\xb5\x2f\xfd", lambda f: _zstd_reader(f)),
}
# Archives and compressions that are not read, by first bytes or by file suffix.
_REFUSED_MAGIC = {
    b"PK\x03\x04": "a zip archive", b"PK\x05\x06": "a zip archive", b"7z\xbc\xaf\x27\x1c": "a 7z archive",
    b"\x04\x22\x4d\x18": "lz4-compressed", b"Rar!\x1a\x07": "a RAR archive", b"\xff\x06\x00\x00sNaPpY": "snappy-compressed",
    b"\x89LZO": "lzop-compressed", b"\x1f\x9d": "compress (.Z)-compressed", b"LZIP": "lzip-compressed",
}
_REFUSED_SUFFIX = {
    ".zip": "a zip archive", ".7z": "a 7z archive", ".lz4": "lz4-compressed", ".rar": "a RAR archive",
    ".br": "brotli-compressed", ".sz": "snappy-compressed", ".snappy": "snappy-compressed", ".lzo": "lzop-compressed",
    ".lzma": "lzma-compressed", ".z": "compress (.Z)-compressed", ".lz": "lzip-compressed", ".tar": "a tar archive",
    ".tgz": "a tar archive",
}
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
# First bytes of the table files that sources.py reads as they are: Parquet, an Arrow IPC stream (continuation
# marker) and file, Feather v1 (older pandas to_feather), which is no IPC file
PARQUET_MAGIC, ARROW_STREAM, ARROW_FILE, FEATHER_V1 = b"PAR1", b"\xff\xff\xff\xff", b"ARROW1", b"FEA1"
_TABLE_MAGIC = {PARQUET_MAGIC: "Parquet", ARROW_STREAM: "Arrow", ARROW_FILE: "Arrow", FEATHER_V1: "Arrow"}
# Text that is not UTF-8: byte order marks (UTF-32's first), and the NUL bytes of its first four bytes.
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"),
              (b"\xfe\xff", "UTF-16BE"))
_WIDE_NULS = {"000x": "UTF-32BE", "x000": "UTF-32LE", "0x0x": "UTF-16BE", "x0x0": "UTF-16LE"}
# Values nested deeper than this are refused when read, so that no later step (the UTF-8 check's
# json.dumps, row parsing) runs out of Python's recursion limit on them; real rows nest a few levels.
MAX_DEPTH = 100
TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"
# JSON's whitespace; a string (its brackets are text) or a bracket; a number (of an item json cannot read)
_WS = re.compile(r"[ \t\n\r]*")
_VALUE_PARTS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


class _DuplicateKey(ValueError):
    """A JSON object names a key more than once (RFC 8259 section 4: which value is meant is undefined)."""


def first_repeat(names: Iterable) -> Optional[str]:
    """The first of ``names`` that an earlier one repeats, or None (JSON keys, table columns, struct fields)."""
    seen: set = set()
    return next((name for name in names if name in seen or seen.add(name)), None)


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey(first_repeat(k for k, _ in pairs))
    return obj


# Python's json keeps a repeated key's last value silently; a row with one is reported instead.
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def why_unread(err: Exception) -> str:
    """Why JSON text is not read, for an error other than a syntax error."""
    if isinstance(err, RecursionError):
        return TOO_DEEP
    if isinstance(err, _DuplicateKey):
        return f"key {err.args[0]!r} given twice in one object"
    return f"an integer of more than {sys.get_int_max_str_digits()} digits"  # int()'s limit (ValueError)


def json_value(text: str):
    """``text`` read as one JSON value, as a JSONL line is (a key given twice, nesting past :data:`MAX_DEPTH` and
    an integer too long for Python refused).

    Raises:
        BadRow: ``text`` is not JSON, or is JSON that is not read.
    """
    try:
        value = _DECODER.decode(text)
        _check_depth(value)
    except json.JSONDecodeError as err:
        raise BadRow(f"invalid JSON: {err.msg} (column {err.colno})") from None
    except (RecursionError, ValueError) as err:
        raise BadRow(f"invalid JSON: {why_unread(err)}") from None
    return value


def compression(path: str) -> Optional[str]:
    """How a JSON/JSONL file is compressed: ``gzip``, ``bzip2``, ``xz``, ``zstd``, or None for plain text.

    Told by the file's first bytes, so a misnamed file is still read right; a
    tar inside a compressed stream is told by the decompressed first block.

    Raises:
        DataError: an archive or a compression that is not read (zip, 7z, lz4,
            tar, RAR, brotli, ...), named, with what is read instead; a compressed
            Parquet or Arrow file.
    """
    with open(path, "rb") as f:
        head = f.read(512)
    name = Path(path).name.lower()
    kind = next((kind for kind, (magic, _) in _STREAMED.items() if head.startswith(magic)), None)
    inner = _decompressed_head(path, kind) if kind is not None else b""
    table = next((t for magic, t in _TABLE_MAGIC.items() if inner.startswith(magic)), None)
    if table is not None:  # its bytes would read as lines of binary text, none of them JSON
        raise DataError(f"{path}: a {kind}-compressed {table} file, which dtrain does not read; Parquet and Arrow "
                        "files are read as they are (their columns are compressed inside them): decompress it first")
    what = next((w for magic, w in _REFUSED_MAGIC.items() if head.startswith(magic)), None)
    if (_is_tar(head) or _is_tar(inner)
            or name.endswith(tuple(f".tar{s}" for s in COMPRESSED_SUFFIXES))):
        what = "a tar archive"
    what = what or _REFUSED_SUFFIX.get(Path(path).suffix.lower())
    if what is not None:
        raise DataError(f"{path}: {what}, which dtrain does not read; JSON and JSONL files are read plain or "
                        "compressed with gzip, bzip2, xz or zstd (.gz, .bz2, .xz, .zst): extract the file or "
                        "recompress it with one of these")
    return kind


def _is_tar(block: bytes) -> bool:
    """A POSIX/GNU tar header: ``ustar`` at byte 257 of the first 512-byte block."""
    return block[257:262] == b"ustar"


def _decompressed_head(path: str, kind: str) -> bytes:
    """The first 512 bytes of the decompressed stream (b"" when it breaks off: :func:`json_items` reports that)."""
    try:
        with _open_data(path, kind) as f:
            return f.read(512)
    except _stream_errors():
        return b""


class _ZstdRaw(io.RawIOBase):
    """zstd frames one after another, as ``zstd -d`` reads them; a frame cut short raises EOFError.

    (``zstandard``'s own ``stream_reader`` ends quietly at a cut frame.)
    """

    def __init__(self, f):
        import zstandard

        self._f, self._new = f, zstandard.ZstdDecompressor().decompressobj
        self._d, self._fed, self._out = self._new(), False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._out:
            chunk = self._f.read(1 << 16)
            if not chunk:
                if self._fed and not self._d.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while chunk:
                if self._d.eof:  # the next frame
                    self._d, self._fed = self._new(), False
                self._fed = True
                self._out += self._d.decompress(chunk)
                chunk = self._d.unused_data if self._d.eof else b""
        n = min(len(buf), len(self._out))
        buf[:n], self._out = self._out[:n], self._out[n:]
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _zstd_reader(f):
    return io.BufferedReader(_ZstdRaw(f))


def _open_data(path: str, kind: Optional[str]):
    """A binary file object over the (decompressed) bytes of ``path``; ``kind`` from :func:`compression`."""
    f = open(path, "rb")
    return f if kind is None else _STREAMED[kind][1](f)


def _stream_errors() -> tuple:
    """What a corrupt or truncated compressed stream raises while it is read."""
    import zstandard

    return (OSError, EOFError, lzma.LZMAError, zlib.error, zstandard.ZstdError)


def json_items(path: str) -> Iterator[tuple]:
    """JSONL streamed line by line (lines split at ``\\n`` only), or a whole JSON array (a file opening
    ``[`` whose first line is a whole JSON value, with more lines after it, is JSONL).

    Compressed files (:func:`compression`) are decompressed as they stream; a
    line (or array item) that is not valid JSON, nests more than :data:`MAX_DEPTH`
    levels, holds an integer too long for Python or gives a key twice in one object is a
    :class:`BadRow`; blank lines are skipped.

    Raises:
        DataError: an archive or compression that is not read; an empty file; UTF-16 or UTF-32 text;
            an invalid JSON array (one whose unreadable item's brackets do not match too); one JSON
            object spread over several lines;
            no line that is JSON at all (raised at the end of the file, after
            its lines were yielded); a compressed stream that is corrupt or cut
            short (naming the line where reading stopped).
    """
    kind = compression(path)
    where = [0]  # the line being read, for a stream that breaks off
    try:
        yield from _json_stream(path, kind, where)
    except _stream_errors() as err:
        if kind is None:
            raise DataError(f"{path}: cannot be read: {err}") from None
        raise DataError(f"{path}: the {kind} stream is corrupt or cut short after line {where[0]} "
                        f"({str(err) or type(err).__name__})") from None


def _json_stream(path: str, kind: Optional[str], where: list) -> Iterator[tuple]:
    first_bad, lines, any_json = None, 0, False
    _refuse_utf16(path, kind)
    with _open_data(path, kind) as f:
        # surrogateescape keeps undecodable bytes as lone surrogates; rows holding
        # them are reported one by one instead of failing the whole file.
        first = _first_char(f)
    if not first:
        raise DataError(f"{path}: file is empty" + (f" (after {kind} decompression)" if kind else ""))
    if first == "[":
        with _open_data(path, kind) as f:
            items = _json_array(path, _read_counting(f, where))
        if items is not None:
            yield from items
            return
    with _open_data(path, kind) as f:
        for n, raw in enumerate(f, start=1):
            where[0] = n
            # a BOM opens the file, or a line of files saved with one and joined (cat a.jsonl b.jsonl)
            line = raw.decode("utf-8", errors="surrogateescape").removesuffix("\n").removesuffix("\r")
            line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            lines += 1
            if len(line) > MAX_LINE_CHARS:
                any_json = True  # not judged: too long to parse
                yield f"{path}:{n}", BadRow(f"line has {len(line):,} characters; lines over {MAX_LINE_CHARS:,} are "
                                            f"not read{_cr_hint(line)}")
                continue
            try:
                obj = _DECODER.decode(line)
                _check_depth(obj)
            except json.JSONDecodeError as err:
                if n == 1:
                    _reject_single_object(path, kind)
                why = f"invalid JSON: {err.msg} (column {err.colno}){_cr_hint(line)}"
                first_bad = first_bad or (n, why)
                yield f"{path}:{n}", BadRow(why)
                continue
            except (RecursionError, ValueError) as err:
                any_json = True  # JSON, not read
                yield f"{path}:{n}", BadRow(f"invalid JSON: {why_unread(err)}")
                continue
            any_json = True
            yield f"{path}:{n}", undecodable(line) or obj
    if not any_json:
        raise DataError(f"{path}: not a JSONL file or a JSON array: none of its {lines} non-blank lines is JSON "
                        f"({first_bad[0]}: {first_bad[1]})")


def _cr_hint(line: str) -> str:
    """A hint for a line holding CRs (old Mac line endings): JSON escapes a CR inside a string, so a raw one
    is most likely a line break that the reader, which splits at LF only, did not split at."""
    return "; the line holds CR (\\r) line breaks, and JSONL lines end at \\n: convert them, e.g. tr '\\r' '\\n'" \
        if "\r" in line else ""


def _refuse_utf16(path: str, kind: Optional[str]) -> None:
    """Raises DataError for UTF-16 or UTF-32 text, told by a byte order mark or by the NUL bytes beside
    JSON's first ASCII character (RFC 4627 section 3); it would read as invalid JSON on every line."""
    with _open_data(path, kind) as f:
        head = f.read(4)
    nul = "".join("0" if b == 0 else "x" for b in head)
    encoding = next((enc for bom, enc in _WIDE_BOMS if head.startswith(bom)), None) or _WIDE_NULS.get(nul)
    if encoding is not None:
        after = f" (after {kind} decompression)" if kind else ""
        raise DataError(f"{path}: {encoding} text{after}; JSON and JSONL files are read as UTF-8: convert it, "
                        f"e.g. iconv -f {encoding} -t UTF-8 (or save it as UTF-8)")


def _check_depth(value, depth: int = 0) -> None:
    """Raises RecursionError when ``value`` nests lists or objects more than :data:`MAX_DEPTH` deep."""
    if depth > MAX_DEPTH:
        raise RecursionError(TOO_DEEP)
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        if isinstance(child, (dict, list)):
            _check_depth(child, depth + 1)


def _first_char(f) -> str:
    """The first character that is not whitespace or a BOM ('' for none); read a buffer at a time (``read1``), so
    a cut stream breaks off on the lines that follow, which name it, not here."""
    while chunk := f.read1(1 << 16):
        text = chunk.decode("utf-8", errors="surrogateescape").lstrip("\ufeff \t\r\n")
        if text:
            return text[0]
    return ""


def _read_counting(f, where: list) -> bytes:
    """All of ``f``, ``where[0]`` counting its whole lines as they come (a stream that breaks off names the last)."""
    chunks = []
    while chunk := f.read1(1 << 20):
        chunks.append(chunk)
        where[0] += chunk.count(b"\n")
    return b"".join(chunks)


def _json_array(path: str, data: bytes) -> Optional[list]:
    """The ``(source, item)`` items of the JSON array ``data`` (a file's bytes), or None for JSONL whose first line
    is a list (one line of JSON, more JSON on the next lines)."""
    text = data.decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    try:
        items = _array_items(text)
    except json.JSONDecodeError as err:
        value = text[:err.pos].rstrip()
        if err.msg == "Extra data" and "\n" not in value.strip() and "\n" in text[len(value):err.pos]:
            return None
        raise DataError(f"{path}:{err.lineno}: invalid JSON array: {err.msg} (column {err.colno})") from None
    except (RecursionError, ValueError) as err:  # an unreadable item whose brackets do not match
        raise DataError(f"{path}: invalid JSON array: {why_unread(err)}") from None
    return [(f"{path}:{line}[{i}]", item) for i, (line, item) in enumerate(items)]


def _reject_single_object(path: str, kind: Optional[str]) -> None:
    with _open_data(path, kind) as f:
        text = f.read().decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return
    held = rows_under(obj, path)
    raise DataError(f"{path}: {held}" if held else f"{path}: one JSON {json_kind(obj)} spread over several lines; "
                    "expected JSONL (one object per line) or a JSON array of objects")


def _value_end(text: str, pos: int) -> Optional[int]:
    """Where the JSON value at ``pos`` ends, told by its brackets alone (brackets in strings are text), for a value
    Python's json cannot read (nested too deep, an integer too long); None when its brackets do not match."""
    if text[pos] not in "[{":
        number = _NUMBER.match(text, pos)
        return number.end() if number else None
    closers = []
    for part in _VALUE_PARTS.finditer(text, pos):
        if part.group() in ("[", "{"):
            closers.append("]" if part.group() == "[" else "}")
        elif part.group() in ("]", "}"):
            if closers.pop() != part.group():
                return None
            if not closers:
                return part.end()
    return None


def _array_items(text: str) -> list:
    """``(line, item)`` of each top-level item of JSON array ``text``: the 1-based line where it starts, and the
    item, or a :class:`BadRow` where a JSONL line of it would be one: longer than :data:`MAX_LINE_CHARS`, nested
    too deep or holding an integer too long for Python (:func:`why_unread`), a key given twice, not UTF-8.

    Raises:
        json.JSONDecodeError: ``text`` is no JSON array (``Extra data`` after it: JSONL opening with a list).
        RecursionError, ValueError: an unreadable item whose end its brackets do not tell.
    """
    items, pos = [], _WS.match(text, text.index("[") + 1).end()
    line, counted = 1, 0  # newlines are counted once each, from the previous item on
    more = not text.startswith("]", pos)  # [] holds none
    while more:
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            item, end = _DECODER.raw_decode(text, pos)
            _check_depth(item)
        except json.JSONDecodeError:
            raise
        except (RecursionError, ValueError) as err:  # JSON that Python does not read: this item is bad, not the file
            end = _value_end(text, pos)
            if end is None:
                raise
            item = BadRow(f"invalid JSON: {why_unread(err)}")
        if end - pos > MAX_LINE_CHARS:  # judged first, as a JSONL line is
            item = BadRow(f"item has {end - pos:,} characters; items over {MAX_LINE_CHARS:,} are not read")
        items.append((line, item if isinstance(item, BadRow) else undecodable(text, pos, end) or item))
        pos = _WS.match(text, end).end()
        more = text.startswith(",", pos)
        if more:
            pos = _WS.match(text, pos + 1).end()
    if not text.startswith("]", pos):
        raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
    rest = _WS.match(text, pos + 1).end()
    if rest < len(text):
        raise json.JSONDecodeError("Extra data", text, rest)
    return items
