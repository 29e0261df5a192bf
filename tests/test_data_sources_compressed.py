"""Compressed JSON/JSONL data files (dtrain/data/sources.py): gzip, bzip2, xz, zstd, and what is refused.

A compressed file must give exactly the rows, bad-row reasons and ``file:line``
sources of the same file uncompressed (line numbers count decompressed lines).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import random
import tarfile
import zipfile
import zlib

import pytest
import zstandard
from test_data_sources import FORMATS, cfg_for, gen_objs, plain, write_jsonl

from dtrain.cli import main
from dtrain.config import DataConfig
from dtrain.data import load_rows
from dtrain.data.jsonfile import compression
from dtrain.data.sources import is_hub_id, read_items, resolve
from dtrain.errors import DataError

COMPRESS = {
    ".gz": gzip.compress,
    ".bz2": lambda b: bz2.compress(b, 1),  # 100 kB blocks: a cut file still holds whole blocks
    ".xz": lzma.compress,
    ".zst": lambda b: zstandard.ZstdCompressor().compress(b),
}
KIND = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}


def relabel(report_bad, old: str, new: str) -> list:
    return [(src.replace(old, new, 1), why) for src, why in report_bad]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_compressed_jsonl_gives_the_rows_and_lines_of_the_plain_file(tmp_path, fmt, suffix):
    objs = gen_objs(fmt, 300, seed=7 + FORMATS.index(fmt))
    cfg = cfg_for(fmt)
    plain_path = write_jsonl(tmp_path / "d.jsonl", objs)
    packed = tmp_path / f"d.jsonl{suffix}"
    packed.write_bytes(COMPRESS[suffix]((tmp_path / "d.jsonl").read_bytes()))
    ref_rows, ref = load_rows(plain_path, cfg)
    rows, report = load_rows(str(packed), cfg)
    assert len(ref.bad) > 20 and compression(str(packed)) == KIND[suffix]
    assert plain(rows) == plain(ref_rows)
    assert [r.source for r in rows] == [r.source.replace(plain_path, str(packed)) for r in ref_rows]
    assert report.bad == relabel(ref.bad, plain_path, str(packed)) and report.rows_read == 300


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_compressed_json_array_and_bad_lines(tmp_path, suffix):
    objs = [{"prompt": f"Q{i}", "chosen": "a", "rejected": "b"} for i in range(3)]
    text = "[\n" + ",\n".join(json.dumps(o) for o in objs) + "\n]\n"
    path = tmp_path / f"a.json{suffix}"
    path.write_bytes(COMPRESS[suffix](text.encode()))
    rows, _ = load_rows(str(path), DataConfig())
    assert [r.source for r in rows] == [f"{path}:2[0]", f"{path}:3[1]", f"{path}:4[2]"]
    lines = tmp_path / f"b.jsonl{suffix}"
    lines.write_bytes(COMPRESS[suffix](b'{"prompt": "Q", "chosen": "a", "rejected": "b"}\n{oops\n'))
    rows, report = load_rows(str(lines), DataConfig())
    assert [r.source for r in rows] == [f"{lines}:1"]
    assert report.bad == [(f"{lines}:2", "invalid JSON: Expecting property name enclosed in double quotes (column 2)")]


def test_compression_is_told_by_content_and_streams_of_several_members(tmp_path):
    row = b'{"prompt": "Q", "chosen": "a", "rejected": "b"}\n'
    misnamed = tmp_path / "pairs.jsonl"  # gzip data without .gz
    misnamed.write_bytes(gzip.compress(row) + gzip.compress(row))  # two gzip members, as `cat a.gz b.gz`
    assert [r.source for r in load_rows(str(misnamed), DataConfig())[0]] == [f"{misnamed}:1", f"{misnamed}:2"]
    frames = tmp_path / "frames.jsonl.zst"  # two zstd frames, as `zstd -c a >> f; zstd -c b >> f`
    z = zstandard.ZstdCompressor()
    frames.write_bytes(z.compress(row) + z.compress(row * 2))
    assert len(load_rows(str(frames), DataConfig())[0]) == 3


def _zip(path):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pairs.jsonl", "{}\n")


def _tar(path, mode="w"):
    with tarfile.open(path, mode) as tf:
        data = b"{}\n"
        info = tarfile.TarInfo("pairs.jsonl")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))


REFUSED = {  # file name: (writer, what the message calls it)
    "p.zip": (_zip, "a zip archive"),
    "p.jsonl.zip": (_zip, "a zip archive"),
    "p.7z": (lambda p: p.write_bytes(b"7z\xbc\xaf\x27\x1c\x00\x04" + bytes(24)), "a 7z archive"),
    "p.jsonl.lz4": (lambda p: p.write_bytes(b"\x04\x22\x4d\x18\x64\x40\xa7" + bytes(8)), "lz4-compressed"),
    "p.rar": (lambda p: p.write_bytes(b"Rar!\x1a\x07\x01\x00" + bytes(8)), "a RAR archive"),
    "p.jsonl.br": (lambda p: p.write_bytes(b"\x1b\x03\x00\xf8\xa5"), "brotli-compressed"),
    "p.tar": (_tar, "a tar archive"),
    "p.tar.gz": (lambda p: _tar(p, "w:gz"), "a tar archive"),
    "p.tgz": (lambda p: _tar(p, "w:gz"), "a tar archive"),
    "p.jsonl": (_tar, "a tar archive"),  # told by content: ustar at byte 257
    "q.jsonl": (_zip, "a zip archive"),
    # a compressed tar is told by the decompressed stream's first block, whatever its name
    "archive.jsonl.gz": (lambda p: _tar(p, "w:gz"), "a tar archive"),
    "archive.jsonl": (lambda p: _tar(p, "w:bz2"), "a tar archive"),
    "archive.json.xz": (lambda p: _tar(p, "w:xz"), "a tar archive"),
    "archive.jsonl.zst": (lambda p: p.write_bytes(COMPRESS[".zst"](_tar_bytes())), "a tar archive"),
}


def _tar_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("pairs.jsonl")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"{}\n"))
    return buf.getvalue()


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_archives_and_compressions_are_refused_by_name(tmp_path, name):
    write, what = REFUSED[name]
    path = tmp_path / name
    write(path)
    message = (f"{path}: {what}, which dtrain does not read; JSON and JSONL files are read plain or compressed "
               "with gzip, bzip2, xz or zstd (.gz, .bz2, .xz, .zst): extract the file or recompress it with one of these")
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value) == message


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_a_cut_stream_names_the_last_line_read_and_keeps_the_rows_before(tmp_path, suffix):
    rnd = random.Random(0)  # text that does not compress away, so half the file holds many lines
    text = "".join(json.dumps({"prompt": f"{rnd.getrandbits(800):x}", "chosen": "a", "rejected": "b"}) + "\n"
                   for i in range(2000)).encode()
    data = COMPRESS[suffix](text)
    path = tmp_path / f"cut.jsonl{suffix}"
    path.write_bytes(data[: len(data) // 2])
    got = []
    with pytest.raises(DataError) as err:
        for item in read_items(resolve(str(path), DataConfig())):
            got.append(item)
    assert 0 < len(got) < 2000
    assert [src for src, _ in got] == [f"{path}:{n}" for n in range(1, len(got) + 1)]
    assert str(err.value).startswith(f"{path}: the {KIND[suffix]} stream is corrupt or cut short after line "
                                     f"{len(got)} (")


def _readable(data: bytes, suffix: str) -> bytes:
    """What a cut compressed stream still gives, decompressed in one go."""
    if suffix == ".zst":
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return {".gz": lambda: zlib.decompressobj(31), ".bz2": bz2.BZ2Decompressor,
            ".xz": lzma.LZMADecompressor}[suffix]().decompress(data)


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_a_cut_stream_of_a_json_array_or_a_small_file_names_the_last_line_read(tmp_path, suffix):
    """A cut stream was 'cut short after line 0' whenever the file was a JSON array (read whole), or its text under
    64 KiB (the first read, looking for its first character, hit the cut): a file of 300 rows cut at two thirds.
    Generated files (seeded), JSONL and arrays, cut anywhere: the line named is the last whole line the stream
    gives."""
    rnd = random.Random(3)
    for case in range(12):
        objs = [{"prompt": f"{rnd.getrandbits(rnd.choice([8, 64, 800])):x}", "chosen": "a", "rejected": "b"}
                for _ in range(rnd.randint(20, 400))]
        array = rnd.random() < 0.5
        text = (json.dumps(objs, indent=rnd.choice([None, 1])) if array else
                "".join(json.dumps(o) + "\n" for o in objs)).encode()
        data = COMPRESS[suffix](text)
        cut = data[: rnd.randint(len(data) // 4, len(data) - 1)]
        path = tmp_path / f"cut{case}.json{'' if array else 'l'}{suffix}"
        path.write_bytes(cut)
        lines = _readable(cut, suffix).count(b"\n")
        with pytest.raises(DataError) as err:
            load_rows(str(path), DataConfig())
        assert str(err.value).startswith(f"{path}: the {KIND[suffix]} stream is corrupt or cut short after line "
                                         f"{lines} ("), (case, array, len(text))


@pytest.mark.parametrize("suffix", list(COMPRESS))
def test_empty_compressed_file_and_missing_compressed_path(tmp_path, suffix):
    path = tmp_path / f"e.jsonl{suffix}"
    path.write_bytes(COMPRESS[suffix](b"\n \n"))
    with pytest.raises(DataError, match=f"^{path}: file is empty \\(after {KIND[suffix]} decompression\\)$"):
        load_rows(str(path), DataConfig())
    assert not is_hub_id(f"owner/pairs.jsonl{suffix}")
    with pytest.raises(DataError, match=f"^owner/pairs.jsonl{suffix}: data file not found \\(data.train\\)$"):
        resolve(f"owner/pairs.jsonl{suffix}", DataConfig())


@pytest.mark.parametrize("name", ["pairs.PARQUET", "pairs.pq", "pairs.jsonl"])
def test_parquet_is_told_by_its_magic_whatever_the_suffix(tmp_path, name):
    import pyarrow as pa
    import pyarrow.parquet as pq

    objs = [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}, {"prompt": "Q", "chosen": "a"}]
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(objs), path)
    assert resolve(str(path), DataConfig()).kind == "parquet"
    rows, report = load_rows(str(path), DataConfig())
    assert [r.chosen for r in rows] == ["4"] and report.bad == [(f"{path}:row 1", "field 'rejected' is null")]
    junk = tmp_path / "junk.PQ"  # named Parquet, but is not: the Parquet reader's message
    junk.write_text(json.dumps(objs[0]) + "\n")
    with pytest.raises(DataError, match=f"^{junk}: not a readable Parquet file"):
        load_rows(str(junk), DataConfig())


@pytest.mark.parametrize("suffix", list(COMPRESS))
@pytest.mark.parametrize("name", ["pairs.parquet", "pairs.feather", "data-00000-of-00001.arrow", "pairs.jsonl"])
def test_a_compressed_parquet_or_arrow_file_is_refused_as_one(tmp_path, suffix, name):
    """``pairs.parquet.gz`` was read as JSONL: 'not a JSONL file or a JSON array: none of its 13 non-blank lines is
    JSON (...; the line holds CR (\\r) line breaks ...)'."""
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    table, plain_path = pa.Table.from_pylist([{"prompt": "Q", "chosen": "a", "rejected": "b"}]), tmp_path / name
    if name == "pairs.parquet":
        pq.write_table(table, plain_path)
        what = "Parquet"
    elif name == "pairs.feather":
        feather.write_feather(table, str(plain_path))
        what = "Arrow"
    else:  # a datasets Arrow stream file, or one misnamed
        with pa.OSFile(str(plain_path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        what = "Arrow"
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(COMPRESS[suffix](plain_path.read_bytes()))
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value) == (f"{path}: a {KIND[suffix]}-compressed {what} file, which dtrain does not read; Parquet "
                              "and Arrow files are read as they are (their columns are compressed inside them): "
                              "decompress it first")


def test_data_check_reads_a_gzip_file(tmp_path, capsys):
    from fixtures_launch import make_model_folder

    model = make_model_folder(tmp_path / "model")
    objs = [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}, {"prompt": "Q", "chosen": "a", "rejected": "a"}]
    path = tmp_path / "pairs.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(o) + "\n" for o in objs).encode()))
    assert main(["data", "check", str(path), "--model.path", str(model), "--train.global_batch_pairs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 2 rows, 1 usable, 0 bad, 1 dropped"
    assert f"  {path}:2: same text: chosen and rejected are identical" in out
