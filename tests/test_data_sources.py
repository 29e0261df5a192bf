"""Data containers (dtrain/data/sources.py) and the tokenization cache (dtrain/data/cache.py).

Every container must give the rows a JSONL file of the same objects gives, in
every row format; fixtures are written here (Parquet with pyarrow; save_to_disk
folders with pyarrow in the layout `datasets` writes, checked against the real
library when it is installed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dtrain.config import DataConfig
from dtrain.data import check_file, load_dataset, load_rows, tokenize_rows
from dtrain.data.cache import cache_key, tokenize_cached, write_entries
from dtrain.data.sources import dataset_source, fingerprint, is_hub_id, read_rows, resolve, resolve_pair
from dtrain.errors import DataError

FIELDS = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
WORDS = ["alpha", "beta", "gamma", "ünïcode", "日本語", "line\nbreak", "sep\u2028arator", "tab\there", "\"quoted\""]


def _text(rnd: random.Random) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, 6)))


def gen_objs(fmt: str, n: int, seed: int) -> list:
    """``n`` rows of one format; about one in five is bad (identical sides or an empty response)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        q, a, b = _text(rnd), _text(rnd), _text(rnd)
        kind = rnd.random()
        if kind < 0.1:
            b = a
        elif kind < 0.2:
            b = "  "
        system = _text(rnd) if rnd.random() < 0.5 else None
        msg = lambda role, content: {"role": role, "content": content}  # noqa: E731
        out.append({
            "standard": lambda: {"prompt": q, "chosen": a, "rejected": b, "system": system},
            "conversational": lambda: {"prompt": [msg("user", q)], "chosen": [msg("assistant", a)],
                                       "rejected": [msg("assistant", b)]},
            "transcript": lambda: {"chosen": f"\n\nHuman: {q}\n\nAssistant: {a}", "rejected": f"\n\nHuman: {q}\n\nAssistant: {b}"},
            "openai": lambda: {"input": {"messages": [msg("user", q)]}, "preferred_output": [msg("assistant", a)],
                               "non_preferred_output": [msg("assistant", b)]},
            "sharegpt": lambda: {"conversations": [{"from": "human", "value": q}], "chosen": {"from": "gpt", "value": a},
                                 "rejected": {"from": "gpt", "value": b}},
            "mapped": lambda: {"question": q, "response_j": a, "response_k": b, "score": rnd.random()},
        }[fmt]())
    return out


def write_jsonl(path, objs) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs), encoding="utf-8")
    return str(path)


def write_parquet(path, objs, row_group_size=None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(objs), path, row_group_size=row_group_size)
    return str(path)


def write_feather(path, objs) -> str:
    import pyarrow.feather as feather

    feather.write_feather(pa.Table.from_pylist(objs), str(path), chunksize=1000)
    return str(path)


def save_to_disk_like(folder, objs, shards: int = 1) -> str:
    """A Dataset folder as ``datasets.Dataset.save_to_disk(folder, num_shards=shards)`` writes it.

    Contiguous shards (the first ``len % shards`` get one more row), each an Arrow
    stream file ``data-0000i-of-0000N.arrow``, listed in ``state.json``.
    """
    folder.mkdir(parents=True)
    table, names, start = pa.Table.from_pylist(objs), [], 0
    for i in range(shards):
        size = len(objs) // shards + (i < len(objs) % shards)
        names.append(f"data-{i:05d}-of-{shards:05d}.arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(start, size))
        start += size
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return str(folder)


def save_dict_like(folder, splits: dict, shards=1) -> str:
    """A DatasetDict folder: ``dataset_dict.json`` and one Dataset folder per split.

    ``shards``: files per split, one number for all or ``{split: number}``.
    """
    for name, objs in splits.items():
        save_to_disk_like(folder / name, objs, shards[name] if isinstance(shards, dict) else shards)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return str(folder)


def cfg_for(fmt: str, **kw) -> DataConfig:
    return DataConfig(fields=FIELDS if fmt == "mapped" else None, **kw)


def plain(rows) -> list:
    return [dataclasses.replace(r, source="") for r in rows]


FORMATS = ["standard", "conversational", "transcript", "openai", "sharegpt", "mapped"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_container_reads_the_rows_of_the_jsonl(tmp_path, fmt):
    objs = gen_objs(fmt, 2600, seed=FORMATS.index(fmt))  # > 2 record batches of 1024
    cfg = cfg_for(fmt)
    ref_rows, ref = load_rows(write_jsonl(tmp_path / "d.jsonl", objs), cfg)
    assert len(ref_rows) + len(ref.bad) + len(ref.dropped) == 2600 and len(ref.bad) > 200
    line_of = {int(src.rsplit(":", 1)[1]) - 1 for src, _ in ref.bad}  # 0-based row numbers of bad rows
    write_jsonl(tmp_path / "mlx/train.jsonl", objs)
    write_jsonl(tmp_path / "mlx/test.jsonl", objs[:3])
    write_parquet(tmp_path / "hub/data/train-00000-of-00001.parquet", objs)
    write_parquet(tmp_path / "hub/data/test-00000-of-00001.parquet", objs[:3])
    containers = {  # name: (path, source pattern of row i)
        "parquet": (write_parquet(tmp_path / "d.parquet", objs, row_group_size=700), "{p}:row {i}"),
        "saved": (save_to_disk_like(tmp_path / "saved", objs, shards=3), "{p}:row {i}"),
        "dict": (save_dict_like(tmp_path / "dict", {"test": objs[:5], "train": objs}, shards=2), "{p}[train]:row {i}"),
        # one Arrow file: a saved dataset's (or datasets' cache) stream file, and an Arrow IPC file (Feather v2)
        "arrow": (str(Path(save_to_disk_like(tmp_path / "one", objs)) / "data-00000-of-00001.arrow"), "{p}:row {i}"),
        "feather": (write_feather(tmp_path / "d.feather", objs), "{p}:row {i}"),
        "mlx": (str(tmp_path / "mlx"), None),
        "pqdir": (str(tmp_path / "hub"), None),
    }
    for name, (path, pattern) in containers.items():
        rows, report = load_rows(path, cfg)
        assert plain(rows) == plain(ref_rows), name
        assert [why for _, why in report.bad] == [why for _, why in ref.bad] and report.rows_read == 2600, name
        assert [why for _, why in report.dropped] == [why for _, why in ref.dropped], name
        if pattern:
            assert {int(src.rsplit(" ", 1)[1]) for src, _ in report.bad} == line_of, name
            assert rows[0].source == pattern.format(p=path, i=int(ref_rows[0].source.rsplit(":", 1)[1]) - 1), name
    assert load_rows(containers["pqdir"][0], cfg)[0][-1].source == f"{tmp_path}/hub/data/train-00000-of-00001.parquet:row 2599"
    assert load_rows(containers["mlx"][0], cfg)[0][0].source.startswith(f"{tmp_path}/mlx/train.jsonl:")


def test_bad_rows_name_file_and_row(tmp_path):
    objs = [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"prompt": "Q", "chosen": None, "rejected": "b"},
            {"prompt": "Q", "chosen": "a", "rejected": "a"}]
    path = write_parquet(tmp_path / "x.parquet", objs)
    rows, report = load_rows(path, DataConfig())
    assert [r.source for r in rows] == [f"{path}:row 0"]
    assert report.bad == [(f"{path}:row 1", "field 'chosen' is null")]
    assert report.dropped == [(f"{path}:row 2", "same text: chosen and rejected are identical")]  # read, no signal
    folder = save_dict_like(tmp_path / "dd", {"train": objs})
    assert load_rows(folder, DataConfig())[1].bad[0] == (f"{folder}[train]:row 1", "field 'chosen' is null")


def test_a_table_s_null_cells_read_as_the_jsonl_s_absent_keys(tmp_path):
    # rows of two formats in one file, written as a table (pandas' to_parquet, datasets): every row has every
    # column, null where its JSONL line has no such key; the vote and each row's reading go by the keys given
    user, reply = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    mixed = [[{"messages": [user, reply]}] + [{"prompt": f"Q{i}", "completion": f"A{i}"} for i in range(3)],
             [{"messages": [user, reply]}] * 2 + [{"conversations": [{"from": "human", "value": "Q"},
                                                                   {"from": "gpt", "value": f"B{i}"}]} for i in range(2)]]
    for n, objs in enumerate(mixed):
        keys = list(dict.fromkeys(k for o in objs for k in o))
        table = pa.Table.from_pylist([{k: o.get(k) for k in keys} for o in objs])
        pq.write_table(table, tmp_path / f"{n}.parquet")
        cfg = DataConfig()
        ref_rows, ref = load_rows(write_jsonl(tmp_path / f"{n}.jsonl", objs), cfg, pairwise=False)
        rows, report = load_rows(str(tmp_path / f"{n}.parquet"), cfg, pairwise=False)
        assert plain(rows) == plain(ref_rows) and len(rows) == [3, 4][n]
        assert len(report.bad) == len(ref.bad) == [1, 0][n]


def test_non_json_column_types(tmp_path):
    table = pa.table({"prompt": pa.array([b"Q1", b"\xff"], pa.binary()), "chosen": ["a", "a"], "rejected": ["b", "b"],
                      "when": pa.array([0, 1], pa.timestamp("s"))})
    pq.write_table(table, tmp_path / "t.parquet")
    rows, report = load_rows(str(tmp_path / "t.parquet"), DataConfig())
    assert [(r.prompt, r.chosen) for r in rows] == [("Q1", "a")]
    assert report.bad == [(f"{tmp_path}/t.parquet:row 1", "text is not valid UTF-8 (undecodable byte 0xff)")]


def test_json_extension_columns_read_as_the_objects_they_hold(tmp_path):
    # datasets >= 5 stores a column whose objects do not share their keys (a message with a 'name', another
    # with a 'weight') as its Json feature: Arrow's arrow.json extension type, each object its JSON text
    def json_cells(rows):  # list<arrow.json> column of message lists
        texts = [json.dumps(m) for msgs in rows for m in msgs]
        offsets = pa.array([0, *itertools.accumulate(len(msgs) for msgs in rows)], pa.int32())
        return pa.ListArray.from_arrays(offsets, pa.ExtensionArray.from_storage(pa.json_(), pa.array(texts)))

    user, named = {"role": "user", "content": "Q"}, {"role": "user", "content": "Q2", "name": "ann"}
    objs = [{"prompt": [user], "chosen": [{"role": "assistant", "content": "A", "weight": 1}],
             "rejected": [{"role": "assistant", "content": "B"}]},
            {"prompt": [named], "chosen": [{"role": "assistant", "content": "C"}],
             "rejected": [{"role": "assistant", "content": "D"}]}]
    table = pa.table({key: json_cells([o[key] for o in objs]) for key in ("prompt", "chosen", "rejected")})
    bad = table.set_column(2, "rejected", pa.ListArray.from_arrays(
        pa.array([0, 1, 2], pa.int32()), pa.ExtensionArray.from_storage(pa.json_(), pa.array(['{"role": "a', "3"]))))
    for path in map(str, parquet_and_arrow(tmp_path, table)):
        rows, report = load_rows(path, DataConfig())
        assert report.bad == [] and plain(rows) == plain(load_rows(write_jsonl(tmp_path / "d.jsonl", objs),
                                                                   DataConfig())[0])
        assert rows[1].prompt == [{"role": "user", "content": "Q2"}] and rows[0].chosen == "A"
    (tmp_path / "bad").mkdir()
    for path in map(str, parquet_and_arrow(tmp_path / "bad", bad)):
        rows, report = load_rows(path, DataConfig())
        assert rows == [] and report.bad == [
            (f"{path}:row 0", "'rejected' (JSON text): invalid JSON: Unterminated string starting at (column 10)"),
            (f"{path}:row 1", "rejected[0] must be an object with string 'role' and 'content'")]


def test_map_columns_read_as_the_objects_they_hold(tmp_path):
    # Spark (and a pyarrow schema that says so) writes messages as map<string, string>, which pyarrow gives as
    # (key, value) pairs unless asked for dicts
    maps = pa.list_(pa.map_(pa.string(), pa.string()))
    prompts = [[[("role", "user"), ("content", "Q")]], [[("role", "user"), ("role", "system"), ("content", "Q2")]]]
    table = pa.table({"prompt": pa.array(prompts, maps), "chosen": ["a", "c"], "rejected": ["b", "d"]})
    for path in map(str, parquet_and_arrow(tmp_path, table)):
        rows, report = load_rows(path, DataConfig())
        assert [(r.prompt, r.chosen) for r in rows] == [([{"role": "user", "content": "Q"}], "a")]
        assert report.bad == [(f"{path}:row 1", "a map gives a key twice ('role')")]


def parquet_and_arrow(tmp_path, table) -> tuple:
    """``table`` written as ``t.parquet`` and as ``t.arrow`` (Feather v2): the paths of both."""
    import pyarrow.feather as feather

    pq.write_table(table, tmp_path / "t.parquet")
    feather.write_feather(table, tmp_path / "t.arrow")
    return tmp_path / "t.parquet", tmp_path / "t.arrow"


def test_a_feather_v1_file_reads_as_the_jsonl(tmp_path, recwarn):
    """A Feather V1 file (``FEA1``, older pandas' ``to_feather``) was read as JSONL: 'not a JSONL file or a JSON
    array: none of its N non-blank lines is JSON', though the README reads ``pairs.feather``."""
    import pyarrow.feather as feather

    objs = gen_objs("standard", 40, seed=6)  # V1 holds no nested types
    ref_rows, ref = load_rows(write_jsonl(tmp_path / "d.jsonl", objs), DataConfig())
    path = tmp_path / "v1.feather"
    with warnings.catch_warnings():  # pyarrow 25+ still writes and reads V1, deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        feather.write_feather(pa.Table.from_pylist(objs), str(path), version=1)
    recwarn.clear()
    rows, report = load_rows(str(path), DataConfig())
    assert plain(rows) == plain(ref_rows) and report.bad == [(f"{path}:row {int(src.rsplit(':', 1)[1]) - 1}", why)
                                                            for src, why in ref.bad]
    assert rows[0].source == f"{path}:row {int(ref_rows[0].source.rsplit(':', 1)[1]) - 1}"
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]  # read quietly
    path.write_bytes(path.read_bytes()[:200])  # cut short
    with pytest.raises(DataError, match=f"^{path}: not a readable Arrow file: "):
        load_rows(str(path), DataConfig())


@pytest.mark.parametrize("name", ["pairs.arrow", "pairs.FEATHER", "data-00000-of-00001.arrow"])
def test_a_file_named_arrow_that_is_no_arrow_file_is_named_as_one(tmp_path, name):
    """A ``.arrow`` or ``.feather`` file that does not start as one (a NumPy array saved under that name) was
    'not a JSONL file or a JSON array: none of its 3 non-blank lines is JSON', as a Parquet name is read as Parquet."""
    path = tmp_path / name
    path.write_bytes(b"\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False, 'shape': (100,), }\n" + bytes(80))
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value) == (f"{path}: not a readable Arrow file: it does not start as one (an Arrow IPC stream or "
                              "file, or Feather)")
    path.write_bytes(b"")
    with pytest.raises(DataError, match=f"^{path}: file is empty$"):
        load_rows(str(path), DataConfig())


def test_a_string_column_holding_bytes_that_are_not_utf8_makes_a_bad_row(tmp_path):
    """pyarrow does not check a string column's UTF-8 on write; reading one ended in UnicodeDecodeError's traceback."""
    bad = lambda *values: pa.array(values, pa.binary()).view(pa.string())  # noqa: E731 -- no check, as a writer may
    table = pa.table({"prompt": bad(b"Q1", b"\xff", b"Q3"), "chosen": ["a", "a", "a"], "rejected": ["b", "b", "b"]})
    for path in parquet_and_arrow(tmp_path, table):
        rows, report = load_rows(str(path), DataConfig())
        assert [(r.source, r.prompt) for r in rows] == [(f"{path}:row 0", "Q1"), (f"{path}:row 2", "Q3")]
        assert report.bad == [(f"{path}:row 1", "text is not valid UTF-8 (undecodable byte 0xff)")]


def test_a_column_name_given_twice_is_refused(tmp_path):
    """A Parquet or Arrow file with two ``chosen`` columns trained on the last one and said nothing."""
    table = pa.table([pa.array(["Q"]), pa.array(["a"]), pa.array(["b"]), pa.array(["c"])],
                     names=["prompt", "chosen", "rejected", "chosen"])
    for path in parquet_and_arrow(tmp_path, table):
        with pytest.raises(DataError) as err:
            load_rows(str(path), DataConfig())
        assert str(err.value) == (f"{path}: column 'chosen' appears twice (columns: prompt, chosen, rejected, "
                                  "chosen); rename or drop one")


def test_a_field_name_given_twice_inside_a_struct_column_is_refused(tmp_path):
    """A message struct with two ``content`` fields ended in pyarrow's ValueError traceback ("Converting to
    Python dictionary is not supported when duplicate field names are present"); refused as a repeated column is."""
    message = pa.StructArray.from_arrays([pa.array(["assistant"]), pa.array(["a"]), pa.array(["b"])],
                                         names=["role", "content", "content"])
    nested = pa.StructArray.from_arrays([pa.ListArray.from_arrays([0, 1], message)], names=["messages"])
    for column, value in [("chosen", pa.ListArray.from_arrays([0, 1], message)), ("chosen.messages", nested)]:
        table = pa.table({"prompt": ["Q"], "chosen": value, "rejected": ["b"]})
        for path in parquet_and_arrow(tmp_path, table):
            with pytest.raises(DataError) as err:
                load_rows(str(path), DataConfig())
            assert str(err.value) == (f"{path}: column {column!r} holds field 'content' twice (fields: role, "
                                      "content, content); rename or drop one")


@pytest.mark.parametrize("name", ["state.json", "dataset_dict.json"])
@pytest.mark.parametrize("text, why", [
    ('{"x": ' + "1" * 5000 + "}", "an integer of more than 4300 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested more than 100 levels deep"),
    ("[]", "expected a JSON object, got array"),
])
def test_a_saved_datasets_json_file_that_cannot_be_read_is_one_line(tmp_path, name, text, why):
    """A too-long integer, too-deep nesting or an array in state.json / dataset_dict.json ended in a traceback."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / name).write_text(text)
    with pytest.raises(DataError) as err:
        load_rows(str(tmp_path / "ds"), DataConfig(split="train"))
    assert str(err.value) == f"{tmp_path / 'ds' / name}: unreadable ({why})"


@pytest.mark.parametrize("files", [[1], "data.arrow", None, [{"filename": 3}], {"filename": "data.arrow"}])
def test_a_state_json_whose_data_files_are_not_objects_is_one_line(tmp_path, files):
    """'_data_files' of another shape than datasets writes ended in AttributeError's (or TypeError's) traceback."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": files}))
    with pytest.raises(DataError) as err:
        load_rows(str(tmp_path / "ds"), DataConfig())
    assert str(err.value) == (f"{tmp_path / 'ds' / 'state.json'}: unreadable ('_data_files' must be a list of "
                              f"objects with a 'filename' string)")


@pytest.mark.parametrize("splits", ["train", [1], {"train": 1}])
def test_a_dataset_dict_json_whose_splits_are_not_names_is_one_line(tmp_path, splits):
    """'splits' as text matched any part of it ("rain" read the train split); as numbers a traceback."""
    folder = save_dict_like(tmp_path / "dd", {"train": gen_objs("standard", 2, seed=1)})
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    with pytest.raises(DataError) as err:
        load_rows(folder, DataConfig(split="rain"))
    assert str(err.value) == (f"{tmp_path / 'dd' / 'dataset_dict.json'}: unreadable ('splits' must be a list of split "
                              "names)")


def test_jsonl_lines_split_at_newline_only(tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028 and \x1c raw; both are inside strings, not line ends
    obj = {"prompt": "a\u2028b\x1cc\rd", "chosen": "x", "rejected": "y"}
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps(obj, ensure_ascii=False) + "\r\n" + json.dumps(obj, ensure_ascii=False) + "\n",
                    encoding="utf-8", newline="")
    rows, report = load_rows(str(path), DataConfig())
    assert report.bad == [] and [r.prompt for r in rows] == [obj["prompt"]] * 2
    assert [r.source for r in rows] == [f"{path}:1", f"{path}:2"]


def test_datasetdict_splits_and_valid_split(tmp_path):
    objs = gen_objs("standard", 40, seed=1)
    folder = save_dict_like(tmp_path / "dd", {"train": objs[:30], "test": objs[30:]})
    train, valid = resolve_pair(DataConfig(train=folder, valid_split="test"))
    assert (train.label, valid.label) == (f"{folder}[train]", f"{folder}[test]")
    assert valid.files == (tmp_path / "dd/test/data-00000-of-00001.arrow",)
    assert resolve_pair(DataConfig(train=folder))[1] is None  # held-out by valid_fraction
    with pytest.raises(DataError) as err:
        resolve(folder, DataConfig(split="validation"))
    assert str(err.value) == f"{folder}: has no split 'validation' (splits: train, test); set data.split"
    with pytest.raises(DataError) as err:
        resolve(folder, DataConfig(), "valid")
    assert str(err.value) == f"{folder}: is a DatasetDict (splits: train, test); set data.valid_split"
    with pytest.raises(DataError, match=r"data.valid_split \(test\) needs data.train to have splits"):
        resolve_pair(DataConfig(train=write_jsonl(tmp_path / "f.jsonl", objs), valid_split="test"))


def test_mlx_folder_train_and_valid(tmp_path, tokenizer):
    objs = gen_objs("standard", 30, seed=2)
    write_jsonl(tmp_path / "m/train.jsonl", objs[:20])
    folder = str(tmp_path / "m")
    only_train = load_dataset(DataConfig(train=folder, valid_fraction=0.25), tokenizer, log=None)
    assert len(only_train.train) + len(only_train.valid) == len(load_rows(folder, DataConfig())[0])
    assert len(only_train.valid) > 0  # no valid.jsonl: split by valid_fraction
    write_jsonl(tmp_path / "m/valid.jsonl", objs[20:])
    write_jsonl(tmp_path / "m/test.jsonl", [{"broken": 1}])  # never read
    ds = load_dataset(DataConfig(train=folder), tokenizer, log=None)
    assert {p.source.rsplit(":", 1)[0] for p in ds.train} == {f"{folder}/train.jsonl"}
    assert {p.source.rsplit(":", 1)[0] for p in ds.valid} == {f"{folder}/valid.jsonl"}
    assert len(ds.train) == len(load_rows(folder, DataConfig())[0])
    assert len(ds.valid) == len(load_rows(folder, DataConfig(), "valid")[0])
    digest = lambda name: hashlib.sha256((tmp_path / "m" / name).read_bytes()).hexdigest()  # noqa: E731
    assert ds.fingerprint == hashlib.sha256(f"{digest('train.jsonl')} {digest('valid.jsonl')}".encode()).hexdigest()
    (tmp_path / "n").mkdir()
    write_jsonl(tmp_path / "n/valid.jsonl", objs)
    with pytest.raises(DataError) as err:
        resolve(str(tmp_path / "n"), DataConfig())
    assert str(err.value) == f"{tmp_path}/n: mlx-lm data folder without train.jsonl (data.train)"


def test_a_path_under_home_is_read_as_model_path_reads_it(tmp_path, monkeypatch, tokenizer):
    """``data.train: ~/pairs.jsonl`` in YAML (which expands nothing) was 'data file not found', while
    model.path and data.chat_template take ``~``; an mlx-lm folder under ``~`` keeps its valid.jsonl."""
    monkeypatch.setenv("HOME", str(tmp_path))
    objs = gen_objs("standard", 30, seed=2)
    write_jsonl(tmp_path / "pairs.jsonl", objs)
    rows, _ = load_rows("~/pairs.jsonl", DataConfig())
    assert [r.source for r in rows][:2] == [f"{tmp_path}/pairs.jsonl:1", f"{tmp_path}/pairs.jsonl:2"]
    write_jsonl(tmp_path / "m/train.jsonl", objs[:20])
    write_jsonl(tmp_path / "m/valid.jsonl", objs[20:])
    ds = load_dataset(DataConfig(train="~/m"), tokenizer, log=None)
    assert {p.source.rsplit(":", 1)[0] for p in ds.valid} == {f"{tmp_path}/m/valid.jsonl"}


def test_a_path_under_an_unknown_user_s_home_is_not_found():
    """``data.train: ~nosuchuser/pairs.jsonl`` (a config from another machine) ended in pathlib's
    RuntimeError traceback from expanding ``~``; before ``~`` was expanded it was 'data file not found'."""
    with pytest.raises(DataError) as err:
        resolve("~nosuchuser-dtrain/pairs.jsonl", DataConfig())
    assert str(err.value) == ("~nosuchuser-dtrain/pairs.jsonl: data file not found (data.train): "
                              "no home folder for ~nosuchuser-dtrain")


def test_parquet_folder_split_choice(tmp_path):
    objs = gen_objs("standard", 10, seed=3)
    for name in ("data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                 "data/train_prefs-00000-of-00001.parquet", "default/test/0000.parquet"):
        write_parquet(tmp_path / "hub" / name, objs)
    folder = str(tmp_path / "hub")
    src = resolve(folder, DataConfig())
    assert [f.name for f in src.files] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert [f.name for f in resolve(folder, DataConfig(split="train_prefs")).files] == ["train_prefs-00000-of-00001.parquet"]
    assert resolve(folder, DataConfig(valid_split="test"), "valid").files == (tmp_path / "hub/default/test/0000.parquet",)
    with pytest.raises(DataError) as err:
        resolve(folder, DataConfig(split="validation"))
    assert str(err.value) == (f"{folder}: no Parquet file of split 'validation' (data/train-00000-of-00002.parquet, "
                              "data/train-00001-of-00002.parquet, data/train_prefs-00000-of-00001.parquet, "
                              "default/test/0000.parquet); set data.split")


def test_parquet_folder_of_several_configs_is_refused(tmp_path):
    """``hf download`` of a dataset with configs leaves ``main/train-*.parquet`` and ``socratic/train-*.parquet``:
    both were read as the one split, two datasets trained as one."""
    objs = gen_objs("standard", 10, seed=3)
    for name in ("main/train-00000-of-00001.parquet", "socratic/train-00000-of-00001.parquet",
                 "main/test-00000-of-00001.parquet"):
        write_parquet(tmp_path / "hub" / name, objs)
    folder = str(tmp_path / "hub")
    with pytest.raises(DataError) as err:
        resolve(folder, DataConfig())
    assert str(err.value) == (f"{folder}: Parquet files of split 'train' in 2 folders (main, socratic), one per "
                              "dataset config as the hub lays them out; set data.train to one of them")
    assert resolve(f"{folder}/main", DataConfig()).files == (tmp_path / "hub/main/train-00000-of-00001.parquet",)


@pytest.mark.parametrize("other", ["data/train-00001-of-00002.jsonl", "data/train-00001-of-00002.json.gz",
                                   "train/0001.arrow", "train.csv"])
def test_a_parquet_folder_with_data_files_of_another_type_is_refused(tmp_path, other):
    """A split's rows in Parquet and in another file type (``train-00001-of-00002.jsonl`` beside
    ``train-00000-of-00002.parquet``): the Parquet rows were trained alone, the others dropped without a word."""
    objs = gen_objs("standard", 10, seed=3)
    write_parquet(tmp_path / "hub/data/train-00000-of-00002.parquet", objs)
    write_jsonl(tmp_path / "hub/data/test-00000-of-00001.jsonl", objs)  # of another split: not read, no matter
    (tmp_path / "hub/README.md").write_text("# card\n")
    folder = str(tmp_path / "hub")
    assert resolve(folder, DataConfig()).files == (tmp_path / "hub/data/train-00000-of-00002.parquet",)
    write_jsonl(tmp_path / "hub" / other, objs)
    with pytest.raises(DataError) as err:
        resolve(folder, DataConfig())
    assert str(err.value) == (f"{folder}: Parquet files of split 'train' beside other data files of it ({other}), "
                              "and only the Parquet files would be read; move the others out of the folder, or set "
                              "data.train to one file")


def test_a_parquet_folder_copied_from_a_mac_skips_its_hidden_files(tmp_path, tokenizer):
    """A folder copied from a Mac holds AppleDouble files (``._0000.parquet``, the resource fork, not Parquet):
    the split's rglob picked them up and the run stopped, 'not a readable Parquet file'. Hidden files and
    folders (``.Trash``, ``.ipynb_checkpoints``) are no data either."""
    objs = gen_objs("standard", 10, seed=3)
    write_parquet(tmp_path / "hub/default/train/0000.parquet", objs)
    apple_double = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)
    for name in ("default/train/._0000.parquet", "._default/train/0001.parquet", "default/.Trash/train.parquet",
                 "default/train/.ipynb_checkpoints/0000-checkpoint.parquet"):
        (tmp_path / "hub" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "hub" / name).write_bytes(apple_double)
    src = resolve(str(tmp_path / "hub"), DataConfig())
    assert src.files == (tmp_path / "hub/default/train/0000.parquet",)
    out, n_bad, _ = check_file(str(tmp_path / "hub"), cfg_for("standard"), tokenizer)
    one, _, _ = check_file(str(tmp_path / "hub/default/train/0000.parquet"), cfg_for("standard"), tokenizer)
    assert out.splitlines()[0].split(": ", 1)[1] == one.splitlines()[0].split(": ", 1)[1] and n_bad == 0
    assert out.startswith(f"{tmp_path / 'hub'}: 10 rows, ")


def test_a_path_too_long_for_the_file_system_is_one_clear_error():
    """A data.train longer than a file name may be was a bare OSError traceback ('File name too long')."""
    for spec in ("q" * 300, "q" * 300 + "/name"):  # the launcher asks is_hub_id first
        assert not is_hub_id(spec)
        with pytest.raises(DataError) as err:
            resolve(spec, DataConfig())
        assert str(err.value) == f"{'q' * 80}...: not a usable path: File name too long (data.train)"


def test_unknown_folder_and_missing_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is a directory but no data folder"):
        resolve(str(tmp_path / "empty"), DataConfig())
    with pytest.raises(DataError) as err:
        resolve(str(tmp_path / "gone.parquet"), DataConfig())
    assert str(err.value) == f"{tmp_path}/gone.parquet: data file not found (data.train)"
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=f"^{tmp_path}/junk.parquet: not a readable Parquet file"):
        load_rows(str(tmp_path / "junk.parquet"), DataConfig())


def test_empty_table_has_no_rows(tmp_path):
    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value) == f"{path}: no rows"


def test_fingerprint_covers_content_not_place(tmp_path):
    objs = gen_objs("standard", 20, seed=4)
    a = save_dict_like(tmp_path / "a", {"train": objs, "test": objs[:4]}, shards=2)
    shutil.copytree(a, tmp_path / "b")
    fp = lambda p, **kw: fingerprint([resolve(str(p), DataConfig(**kw))])  # noqa: E731
    assert fp(a) == fp(tmp_path / "b") and len(fp(a)) == 64
    assert fp(a) != fp(a, split="test")
    save_dict_like(tmp_path / "c", {"train": objs[:19] + [{**objs[19], "chosen": "changed"}], "test": objs[:4]}, shards=2)
    assert fp(tmp_path / "c") != fp(a)
    p1 = write_parquet(tmp_path / "p1.parquet", objs)
    assert fp(p1) != fp(write_parquet(tmp_path / "p2.parquet", objs[1:]))
    j = write_jsonl(tmp_path / "j.jsonl", objs)
    assert fp(j) == hashlib.sha256((tmp_path / "j.jsonl").read_bytes()).hexdigest()  # sha256sum, as before


def test_data_check_on_each_container(tmp_path, tokenizer):
    objs = [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}, {"prompt": "Q", "chosen": "a"}]
    for path, bad in ((write_parquet(tmp_path / "c.parquet", objs), f"{tmp_path}/c.parquet:row 1"),
                      (save_dict_like(tmp_path / "cd", {"train": objs}), f"{tmp_path}/cd[train]:row 1")):
        out, n_bad, _ = check_file(path, DataConfig(), tokenizer)
        lines = out.splitlines()
        assert n_bad == 1 and lines[0] == f"{path}: 2 rows, 1 usable, 1 bad, 0 dropped"
        assert lines[2] == f"  {bad}: field 'rejected' is null"


def test_parquet_dataset_equals_jsonl_dataset(tmp_path, tokenizer):
    objs = gen_objs("conversational", 60, seed=5)
    cfg = dict(valid_fraction=0.2, max_length=24, max_prompt_length=12)
    a = load_dataset(DataConfig(train=write_jsonl(tmp_path / "d.jsonl", objs), **cfg), tokenizer, seed=3, log=None)
    b = load_dataset(DataConfig(train=write_parquet(tmp_path / "d.parquet", objs), **cfg), tokenizer, seed=3, log=None)
    strip = lambda ps: [dataclasses.replace(p, source="") for p in ps]  # noqa: E731
    assert strip(a.train) == strip(b.train) and strip(a.valid) == strip(b.valid) and len(a.train) > 30
    assert (a.report.truncated, len(a.report.bad)) == (b.report.truncated, len(b.report.bad))


class CountingTokenizer:
    """Forwards to ``inner`` (mlx-lm's TokenizerWrapper); counts the calls that render or tokenize."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def __call__(self, *args, **kwargs):  # render.py calls the Hugging Face tokenizer for offsets
        self.calls += 1
        return self.inner._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_cache_equals_tokenizing_and_skips_it(tmp_path, tokenizer):
    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 80, seed=6)), DataConfig())
    cfg = DataConfig(max_length=20, max_prompt_length=10)
    expected = tokenize_rows(rows, tokenizer, cfg)
    assert expected[1].truncated > 0 and len(expected[0]) > 0
    counting = CountingTokenizer(tokenizer)
    first = tokenize_cached(rows, counting, cfg, tmp_path / "cache")
    assert first == expected and counting.calls > 0
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.name == f"{cache_key(rows, tokenizer, cfg)}.npz"
    counting.calls = 0
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected and counting.calls == 0
    entry.write_bytes(b"damaged")  # a damaged entry is tokenized and written again
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected and counting.calls > 0
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected


def test_cache_entries_follow_the_umask_like_other_outputs(tmp_path, tokenizer):
    """Entries were written through mkstemp, whose files are 0600 whatever the umask."""
    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 8, seed=6)), DataConfig())
    old = os.umask(0o022)
    try:
        tokenize_cached(rows, tokenizer, DataConfig(), tmp_path / "cache")
    finally:
        os.umask(old)
    (entry,) = (tmp_path / "cache").iterdir()
    assert oct(entry.stat().st_mode & 0o777) == oct(0o644)


def _cache_entry(tmp_path, tokenizer) -> tuple:
    """``(entry path, rows, cfg, expected result)`` of one fresh cache entry."""
    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 2, seed=12)), DataConfig())
    cfg = DataConfig(max_length=20, max_prompt_length=10)
    expected = tokenize_cached(rows, tokenizer, cfg, tmp_path / "cache")
    (entry,) = (tmp_path / "cache").iterdir()
    return entry, rows, cfg, expected


def test_cache_entry_with_an_unknown_compression_method_is_written_again(tmp_path, tokenizer):
    import struct

    entry, rows, cfg, expected = _cache_entry(tmp_path, tokenizer)
    data = bytearray(entry.read_bytes())
    struct.pack_into("<H", data, 8, 99)  # the zip's local header: compression method 99 (NotImplementedError)
    struct.pack_into("<H", data, data.find(b"PK\x01\x02") + 10, 99)  # and its central directory
    entry.write_bytes(bytes(data))
    counting = CountingTokenizer(tokenizer)
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected and counting.calls > 0
    assert entry.read_bytes()[8:10] == b"\x00\x00"  # written again, stored


def test_a_cache_entry_under_another_entrys_name_counts_as_absent(tmp_path, tokenizer):
    """An entry renamed or copied over another (data_cache edited by hand) was read as the other key's pairs: the
    held-out pairs trained as the training pairs, or a resume refused as 'training pairs: 27 in the checkpoint, 3
    now' with the data unchanged. An entry names its key inside; one under another name is tokenized again."""
    entry, rows, cfg, expected = _cache_entry(tmp_path, tokenizer)
    other_rows, _ = load_rows(write_jsonl(tmp_path / "e.jsonl", gen_objs("standard", 3, seed=13)), DataConfig())
    other = tmp_path / "cache" / f"{cache_key(other_rows, tokenizer, cfg)}.npz"
    shutil.copyfile(entry, other)
    counting = CountingTokenizer(tokenizer)
    assert tokenize_cached(other_rows, counting, cfg, tmp_path / "cache") == tokenize_rows(other_rows, tokenizer, cfg)
    assert counting.calls > 0
    counting.calls = 0
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected and counting.calls == 0


def test_every_one_bit_flip_of_a_cache_entry_loads_the_same_or_counts_as_absent(tmp_path, tokenizer):
    from dtrain.data.cache import _load

    entry, _, _, expected = _cache_entry(tmp_path, tokenizer)
    good = entry.read_bytes()
    outcomes = set()
    for bit in range(0, len(good) * 8, 3):  # every third bit: a third of the time, every byte
        data = bytearray(good)
        data[bit // 8] ^= 1 << bit % 8
        entry.write_bytes(bytes(data))
        loaded = _load(entry)
        assert loaded in (None, expected), bit
        outcomes.add(loaded is None)
    assert outcomes == {True, False}  # some flips (unused header bits) are harmless


@pytest.mark.parametrize("damage", ["float ids", "uint8 ids", "ids cut short", "negative length", "no sources",
                                    "negative id"])
def test_a_cache_entry_whose_arrays_do_not_fit_its_layout_is_written_again(tmp_path, tokenizer, damage):
    """A whole zip whose arrays were of another dtype or did not add up was decoded as it was: float ids
    (``1.5``), ids wrapped to uint8, the last pair's ids cut short, a rejected side emptied by a negative
    length, or no pairs at all when the sources were missing, and trained on. Now it counts as absent."""
    import json

    import numpy as np

    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 6, seed=12)), DataConfig())
    cfg = DataConfig()
    expected = tokenize_cached(rows, tokenizer, cfg, tmp_path / "cache")
    assert len(expected[0]) >= 2
    (entry,) = (tmp_path / "cache").iterdir()
    with np.load(entry) as z:
        arrays = dict(z)
    tokens, lengths, meta = arrays["tokens"], arrays["lengths"], json.loads(str(arrays["meta"]))
    arrays.update({"float ids": {"tokens": tokens.astype(np.float64) + 0.5},
                   "uint8 ids": {"tokens": tokens.astype(np.uint8)},
                   "ids cut short": {"tokens": tokens[:-3]},
                   "negative length": {"lengths": lengths * np.array([1, 1, -1, 1])},
                   "no sources": {"meta": np.array(json.dumps({**meta, "sources": []}))},
                   "negative id": {"tokens": tokens - tokens.max() - 1}}[damage])
    with open(entry, "wb") as f:
        np.savez(f, **arrays)
    counting = CountingTokenizer(tokenizer)
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected and counting.calls > 0
    counting.calls = 0
    assert tokenize_cached(rows, counting, cfg, tmp_path / "cache") == expected and counting.calls == 0


def test_cache_key_changes_with_what_decides_tokens(tmp_path, tokenizer):
    from conftest import make_tokenizer

    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 10, seed=7)), DataConfig())
    key = cache_key(rows, tokenizer, DataConfig())
    assert key == cache_key(rows, make_tokenizer(), DataConfig())  # same tokenizer rebuilt
    for other in (cache_key(rows[1:], tokenizer, DataConfig()),
                  cache_key(rows[:-1] + [dataclasses.replace(rows[-1], chosen="other")], tokenizer, DataConfig()),
                  cache_key(rows, tokenizer, DataConfig(max_length=100)),
                  cache_key(rows, tokenizer, DataConfig(append_eos=False)),
                  cache_key(rows, tokenizer, DataConfig(prompt_template="raw")),
                  cache_key(rows, make_tokenizer(chat_template=None), DataConfig()),
                  cache_key(rows, make_tokenizer(add_bos=False), DataConfig())):
        assert other != key


def test_cache_key_changes_with_the_tokenizers_split_special_tokens(tmp_path):
    """tokenizer_config.json's ``split_special_tokens: true`` makes the tokenizer read control-token text as text
    (the template's ``<|im_start|>`` too), outside its tokenizer.json; the key did not cover it, so a run with the
    flag changed read the pairs tokenized without it."""
    from conftest import make_tokenizer

    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 4, seed=7)), DataConfig())
    cfg, cache = DataConfig(), tmp_path / "cache"
    first = tokenize_cached(rows, make_tokenizer(), cfg, cache)
    split = make_tokenizer()
    split._tokenizer.split_special_tokens = True
    expected = tokenize_rows(rows, split, cfg)
    assert first[0][0].prompt[1] == 3 and expected[0][0].prompt[1] != 3  # <|im_start|> (id 3) read as text
    assert cache_key(rows, split, cfg) != cache_key(rows, make_tokenizer(), cfg)
    assert tokenize_cached(rows, split, cfg, cache) == expected


def test_cache_key_keeps_with_settings_that_only_choose_rows(tmp_path, tokenizer):
    """Another data.valid file, on_bad_row or split leaves the training rows as they were: their pairs were
    tokenized again, since every data key was in the key."""
    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 10, seed=7)), DataConfig())
    key = cache_key(rows, tokenizer, DataConfig(train="d.jsonl"))
    for same in (DataConfig(train="d.jsonl", valid="v2.jsonl"), DataConfig(train="d.jsonl", on_bad_row="error"),
                 DataConfig(train="d.jsonl", valid_split="test", split="all"), DataConfig(train="moved/d.jsonl")):
        assert cache_key(rows, tokenizer, same) == key
    assert cache_key(rows, tokenizer, DataConfig(train="d.jsonl", max_length=100)) != key


def test_cache_key_keeps_across_days_where_no_template_writes_the_date(tmp_path, tokenizer):
    """data.template_date (null: the day a run starts) went into every key, though only a template that calls
    strftime_now renders it: a ChatML run's second run into the same folder on a later day tokenized again.
    The day is in the key only where a template of the load reads the clock (Llama 3.2's)."""
    from chat_fixtures import LLAMA32, style_tokenizer

    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 4, seed=7)), DataConfig())
    days = [DataConfig(template_date=d) for d in ("2026-03-01", "2026-03-02")]
    assert cache_key(rows, tokenizer, days[0]) == cache_key(rows, tokenizer, days[1])
    assert tokenize_rows(rows, tokenizer, days[0]) == tokenize_rows(rows, tokenizer, days[1])
    llama = style_tokenizer("llama32")
    assert cache_key(rows, llama, days[0]) != cache_key(rows, llama, days[1])
    template = tmp_path / "llama32.jinja"
    template.write_text(LLAMA32)
    given = [dataclasses.replace(d, chat_template=str(template)) for d in days]
    assert cache_key(rows, tokenizer, given[0]) != cache_key(rows, tokenizer, given[1])
    counting = CountingTokenizer(tokenizer)
    assert tokenize_cached(rows, counting, days[0], tmp_path / "cache") == tokenize_rows(rows, tokenizer, days[1])
    counting.calls = 0
    assert tokenize_cached(rows, counting, days[1], tmp_path / "cache")[0] and counting.calls == 0


def test_cache_key_changes_with_the_text_of_a_chat_template_file(tmp_path, tokenizer):
    """An edited data.chat_template file renders other tokens at the same path; its key was the path's,
    so a second run into the same folder trained on the pairs of the old template."""
    from dtrain.data.templates import CHATML

    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 3, seed=7)), DataConfig())
    template = tmp_path / "t.jinja"
    template.write_text(CHATML)
    cfg = DataConfig(chat_template=str(template))
    first = tokenize_cached(rows, tokenizer, cfg, tmp_path / "cache")
    template.write_text(CHATML.replace("'<|im_end|>\n'", "'<|im_end|>\n\n'"))  # a blank line after each turn
    again = tokenize_cached(rows, tokenizer, cfg, tmp_path / "cache")
    assert again == tokenize_rows(rows, tokenizer, cfg) and again != first
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_load_dataset_caches_next_to_output(tmp_path, tokenizer):
    cfg = DataConfig(train=write_parquet(tmp_path / "d.parquet", gen_objs("openai", 50, seed=8)))
    first = load_dataset(cfg, tokenizer, log=None, cache_dir=tmp_path / "out/data_cache")
    assert not (tmp_path / "out").exists()  # written only once the run owns its folder
    write_entries(first.cache_entries)
    assert len(list((tmp_path / "out/data_cache").iterdir())) == 2  # train and valid
    counting = CountingTokenizer(tokenizer)
    again = load_dataset(cfg, counting, log=None, cache_dir=tmp_path / "out/data_cache")
    assert again == first and counting.calls == 0 and again.cache_entries == []


def test_cache_keeps_an_sft_runs_rows_and_a_pairwise_runs_apart(tmp_path, tokenizer):
    """SFT keeps preference rows a pairwise objective drops (same text, same ids, no rejected side): a run
    of one kind must not read the other's entry, or it trains rows it must not (or misses rows it keeps)."""
    from test_data_sft import CUT, PAIRWISE_ONLY

    cfg = dataclasses.replace(CUT, train=write_jsonl(tmp_path / "p.jsonl", PAIRWISE_ONLY))
    cache = tmp_path / "out/data_cache"
    expected = {pw: load_dataset(cfg, tokenizer, log=None, pairwise=pw) for pw in (True, False)}
    assert [len(expected[pw].train) for pw in (True, False)] == [1, 5]
    for pw in (False, True):
        first = load_dataset(cfg, tokenizer, log=None, cache_dir=cache, pairwise=pw)
        assert first == expected[pw]
        write_entries(first.cache_entries)
    assert len(list(cache.iterdir())) == 2  # one entry each (no held-out rows)
    counting = CountingTokenizer(tokenizer)
    for pw in (True, False):
        assert load_dataset(cfg, counting, log=None, cache_dir=cache, pairwise=pw) == expected[pw]
    assert counting.calls == 0


def _datasets():
    return pytest.importorskip("datasets")


def test_fixture_layout_matches_datasets(tmp_path):
    ds_lib = _datasets()
    objs = gen_objs("conversational", 25, seed=9)
    ds_lib.DatasetDict({"train": ds_lib.Dataset.from_list(objs), "test": ds_lib.Dataset.from_list(objs[:7])}).save_to_disk(
        str(tmp_path / "real"), num_shards={"train": 3, "test": 1})
    save_dict_like(tmp_path / "ours", {"train": objs, "test": objs[:7]}, shards={"train": 3, "test": 1})
    files = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert files(tmp_path / "real") == files(tmp_path / "ours") and len(files(tmp_path / "ours")) == 9
    real_state = json.loads((tmp_path / "real/train/state.json").read_text())
    assert set(real_state) == set(json.loads((tmp_path / "ours/train/state.json").read_text()))
    for split in ("train", "test"):
        cfg = DataConfig(split=split)
        real, ours = load_rows(str(tmp_path / "real"), cfg), load_rows(str(tmp_path / "ours"), cfg)
        assert plain(real[0]) == plain(ours[0]) and [r.source for r in real[0]] == [
            s.replace("/ours", "/real") for s in (r.source for r in ours[0])]
    single = tmp_path / "single"
    ds_lib.Dataset.from_list(objs).save_to_disk(str(single))
    assert plain(load_rows(str(single), DataConfig())[0]) == plain(load_rows(str(tmp_path / "ours"), DataConfig())[0])


def test_hub_dataset_rows(tmp_path):
    ds_lib = _datasets()
    objs = gen_objs("sharegpt", 30, seed=10)
    path = write_parquet(tmp_path / "d.parquet", objs)
    ds = ds_lib.load_dataset("parquet", data_files={"train": path}, split="train", cache_dir=str(tmp_path / "hf"))
    src = dataset_source(ds, "owner/name[train]", "train")
    rows, report = read_rows(src, DataConfig())
    ref_rows, ref = load_rows(path, DataConfig())
    assert plain(rows) == plain(ref_rows) and report.bad == [(s.replace(path, "owner/name[train]"), w) for s, w in ref.bad]
    assert rows[0].source == ref_rows[0].source.replace(path, "owner/name[train]")
    assert len(fingerprint([src])) == 64
    with pytest.raises(DataError, match="has no Arrow cache files"):
        dataset_source(ds_lib.Dataset.from_list(objs), "mem")


def _resolve_in_subprocess(spec: str, env: dict, prelude: str = "") -> str:
    code = (prelude + "from dtrain.config import DataConfig\nfrom dtrain.data.sources import resolve\n"
            "from dtrain.errors import DataError\n"
            f"try:\n    resolve({spec!r}, DataConfig())\nexcept DataError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    return out.stdout.strip()


def offline_message(spec: str) -> str:
    return (f"{spec}: no such file or folder, and as a hub dataset it is not in the local cache and the hub cannot "
            f"be reached (offline?); download it where there is network: hf download --repo-type dataset {spec} "
            "--local-dir DIR, then set data.train: DIR")


def test_hub_id_offline_says_how_to_download():
    _datasets()
    assert _resolve_in_subprocess("owner-x/no-such-dataset", {"HF_HUB_OFFLINE": "1"}) == offline_message(
        "owner-x/no-such-dataset")


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """The hub unreachable (one probe answers as with no DNS) and an empty ``datasets`` cache; yields the probes."""
    ds_lib = _datasets()
    import huggingface_hub
    from huggingface_hub.utils import httpx

    probes = []

    def dataset_info(self, repo_id, **kwargs):
        probes.append((repo_id, kwargs.get("timeout")))
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(ds_lib.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    return probes


def test_an_uncached_hub_id_offline_fails_after_one_request(monkeypatch, no_network):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset retries for ~25 s"))
    with pytest.raises(DataError) as err:
        resolve("someone/some-pairs", DataConfig())
    assert str(err.value) == offline_message("someone/some-pairs")
    assert no_network == [("someone/some-pairs", 10.0)]


def test_a_cached_hub_id_offline_is_loaded_from_the_cache(monkeypatch, tmp_path, no_network):
    import datasets

    (tmp_path / "hf/someone___some-pairs/default/0.0.0/abc123").mkdir(parents=True)
    loads = []
    monkeypatch.setattr(datasets, "load_dataset", lambda spec, split: loads.append((spec, split)) or _raise(
        ConnectionError("Couldn't reach 'someone/some-pairs' on the Hub")))
    with pytest.raises(DataError, match="hub cannot be reached"):
        resolve("someone/some-pairs", DataConfig())
    assert loads == [("someone/some-pairs", "train")] and no_network == []


def _raise(err):
    raise err


def test_data_check_offline_on_a_missing_relative_folder_prints_one_line(monkeypatch, tmp_path, no_network, capsys):
    from fixtures_launch import make_model_folder

    from dtrain.cli import main

    model = make_model_folder(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert main(["data", "check", "data/mypairs", "--model.path", str(model)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("dtrain: BLAS")]
    assert err == [f"dtrain: error: {offline_message('data/mypairs')}"]


def test_hub_id_without_datasets_library():
    no_datasets = "import sys\nsys.modules['datasets'] = None  # import datasets raises ImportError\n"
    assert _resolve_in_subprocess("owner/name", {}, no_datasets) == (
        "owner/name: no such file or folder; to read it as a Hugging Face hub dataset "
        "install the datasets library: pip install 'dtrain[hf]'")


@pytest.mark.parametrize("spec", ["data/pairs.JSONL", "data/pairs.Json", "data/pairs.PARQUET", "data/pairs.JSONL.GZ",
                                  "data/pairs.Pq", "data/pairs.arrow", "data/pairs.Feather"])
def test_missing_path_with_an_upper_case_suffix_is_not_a_hub_id(spec):
    assert not is_hub_id(spec)
    with pytest.raises(DataError, match=f"^{spec}: data file not found \\(data.train\\)$"):
        resolve(spec, DataConfig())


def test_training_run_writes_cache_and_resume_skips_tokenizing(tmp_path):
    from types import SimpleNamespace

    from conftest import make_tiny_model, make_tokenizer
    from dtrain.config import load_config
    from dtrain.run.trainer import train

    objs = [{"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(12)]
    data = write_parquet(tmp_path / "d.parquet", objs)
    out = tmp_path / "out"

    def run(steps: int, *extra):
        cfg = load_config(None, [f"data.train={data}", f"train.output_dir={out}", f"train.steps={steps}",
                                 "train.global_batch_pairs=2", "train.micro_batch_pairs=2", "lora.rank=2",
                                 "train.progress=false", "train.save_every=1", *extra])
        tok = CountingTokenizer(make_tokenizer())
        train(cfg, loaded=SimpleNamespace(aliases=(), model=make_tiny_model(), tokenizer=tok, identity="tiny", source="tiny",
                                          reference={}))
        return tok.calls

    assert run(1) > 0 and len(list((out / "data_cache").iterdir())) == 2
    assert run(2, "train.resume=auto") == 0  # the resumed run reads the cache


def test_data_check_command_on_a_saved_dataset(tmp_path, capsys):
    from fixtures_launch import make_model_folder

    from dtrain.cli import main

    model = make_model_folder(tmp_path / "model")
    objs = [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}, {"prompt": "Q", "chosen": "a"}]
    folder = save_dict_like(tmp_path / "dd", {"train": objs[:1], "test": objs})
    assert main(["data", "check", folder, "--model.path", str(model), "--data.split", "test",
                 "--train.global_batch_pairs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{folder}: 2 rows, 1 usable, 1 bad, 0 dropped"
    assert f"  {folder}[test]:row 1: field 'rejected' is null" in out


def test_a_pipe_is_named_as_one(tmp_path):
    """``--data.train <(zcat pairs.jsonl.gz)`` (a FIFO) was 'data file not found', though it exists."""
    fifo = tmp_path / "pairs.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError) as err:
        resolve(str(fifo), DataConfig())
    assert str(err.value) == (f"{fifo}: not a regular file (data.train); data is read more than once (its format, "
                              f"its fingerprint), so write it to a file first (compressed files are read as they are)")


def test_a_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """A data file without read permission ended in PermissionError's traceback (tested through open: root
    reads any file)."""
    from dtrain.data import sources

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "Q", "chosen": "a", "rejected": "b"}\n')

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(sources, "open", refused, raising=False)
    with pytest.raises(DataError) as err:
        resolve(str(path), DataConfig())
    assert str(err.value) == f"{path}: cannot be read: Permission denied"


def test_the_shipped_configs_placeholder_says_what_to_pass(tmp_path):
    """./launch configs/dpo.yaml as shipped said only 'PATH/TO/pairs.jsonl: data file not found (data.train)'."""
    with pytest.raises(DataError) as err:
        resolve("PATH/TO/pairs.jsonl", DataConfig())
    assert str(err.value) == ("PATH/TO/pairs.jsonl: data file not found (data.train); it is the config's placeholder: "
                              "pass the data with --data.train")
    with pytest.raises(DataError) as err:
        resolve("PATH/TO/valid.jsonl", DataConfig(), role="valid")
    assert str(err.value).endswith("pass the data with --data.valid")


def test_cache_key_changes_with_the_jinja2_that_renders_the_templates(tmp_path, tokenizer, monkeypatch):
    """The key named the versions of tokenizers, transformers and mlx-lm but not of jinja2, which renders every
    chat template (transformers' apply_chat_template): after an upgrade the pairs rendered by the old one were
    read back."""
    import jinja2

    rows, _ = load_rows(write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 4, seed=7)), DataConfig())
    key = cache_key(rows, tokenizer, DataConfig())
    monkeypatch.setattr(jinja2, "__version__", jinja2.__version__ + ".post1")
    assert cache_key(rows, tokenizer, DataConfig()) != key


def _bracket_renderer(messages, add_generation_prompt=False, **kwargs):
    """A chat renderer in Python, as mlx-lm's ``chat_template_type`` modules are (``mlx_lm.chat_templates``)."""
    text = "".join(f"[{m['role']}] {m['content']}\n" for m in messages)
    return text + ("[assistant] " if add_generation_prompt else "")


def test_cache_key_changes_with_mlx_lms_own_chat_renderer(tmp_path):
    """mlx-lm's tokenizer renders with a Python module instead of the Jinja template where the tokenizer names one
    (tokenizer_config.json's ``chat_template_type``); the key covered the Jinja template only, so the same
    tokenizer with and without that renderer shared one entry, and a run read the other's pairs."""
    from conftest import make_tokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = make_tokenizer()._tokenizer
    own = TokenizerWrapper(hf, chat_template=_bracket_renderer)
    path = write_jsonl(tmp_path / "d.jsonl", gen_objs("conversational", 4, seed=7))
    rows, _ = load_rows(path, DataConfig())
    cfg, cache = DataConfig(), tmp_path / "cache"
    tokenize_cached(rows, TokenizerWrapper(hf), cfg, cache)  # the tokenizer's Jinja template: an entry
    assert cache_key(rows, own, cfg) != cache_key(rows, TokenizerWrapper(hf), cfg)
    assert tokenize_cached(rows, own, cfg, cache) == tokenize_rows(rows, own, cfg)
    assert cache_key(rows, own, cfg) == cache_key(rows, TokenizerWrapper(hf, chat_template=_bracket_renderer), cfg)


@pytest.mark.parametrize("pairwise, unit", [(True, "pair"), (False, "row")])
def test_the_tokenizing_bar_counts_rows_under_sft(tmp_path, tokenizer, monkeypatch, pairwise, unit):
    """objective.kind sft (load_dataset pairwise=False) trains rows: its tokenizing bar counted "pair/s", where
    its other messages say rows (types.example_noun)."""
    import tqdm

    bars, real = [], tqdm.tqdm

    def recording(*args, **kwargs):
        bars.append((kwargs["desc"], kwargs["unit"], kwargs["disable"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", recording)
    path = write_jsonl(tmp_path / "d.jsonl", gen_objs("standard", 8, seed=6))
    load_dataset(DataConfig(train=path, valid_fraction=0.25), tokenizer, log=lambda _: None, pairwise=pairwise)
    assert bars == [("tokenizing train", unit, False), ("tokenizing valid", unit, False)]
