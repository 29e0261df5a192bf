"""Row formats: detection, normalisation, implicit prompts, bad rows, file errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.config import DataConfig
from dtrain.data import load_rows
from dtrain.data.formats import parse_rows
from dtrain.errors import DataError
from dtrain.types import Row

HH_PROMPT = "\n\nHuman: What is 2 + 2?\n\nAssistant:"


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return str(path)


def rows_of(tmp_path, objs, **cfg):
    rows, report = load_rows(write_jsonl(tmp_path / "d.jsonl", objs), DataConfig(**cfg))
    return rows, report


def one_row(tmp_path, obj, **cfg) -> Row:
    rows, report = rows_of(tmp_path, [obj], **cfg)
    assert report.bad == [] and len(rows) == 1
    return rows[0]


def test_standard(tmp_path):
    row = one_row(tmp_path, {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5", "system": "Be brief."})
    assert (row.prompt, row.chosen, row.rejected, row.system) == ("What is 2 + 2?", "4", "5", "Be brief.")
    assert row.source == f"{tmp_path / 'd.jsonl'}:1" and row.rejected_prompt is None


def test_conversational_explicit_prompt(tmp_path):
    user = [{"role": "user", "content": "hi"}]
    row = one_row(tmp_path, {"prompt": user, "chosen": [{"role": "assistant", "content": "hello"}],
                             "rejected": [{"role": "assistant", "content": "go"}]})
    assert (row.prompt, row.chosen, row.rejected) == (user, "hello", "go")


def test_conversational_implicit_prompt_is_longest_common_prefix(tmp_path):
    shared = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    row = one_row(tmp_path, {"chosen": shared + [{"role": "assistant", "content": "yes"}],
                             "rejected": shared + [{"role": "assistant", "content": "no"}]})
    assert (row.prompt, row.chosen, row.rejected, row.rejected_prompt) == (shared, "yes", "no", None)


def test_conversational_implicit_histories_differ_gives_rejected_prompt(tmp_path):
    u1, a1 = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    c = [u1, a1, {"role": "user", "content": "more?"}, {"role": "assistant", "content": "yes"}]
    r = [u1, a1, {"role": "user", "content": "less?"}, {"role": "assistant", "content": "no"}]
    row = one_row(tmp_path, {"chosen": c, "rejected": r})
    assert row.prompt == c[:3] and row.rejected_prompt == r[:3]
    assert (row.chosen, row.rejected) == ("yes", "no")


def test_conversational_multi_message_completion_kept_as_messages(tmp_path):
    u = {"role": "user", "content": "a"}
    tail = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}]
    row = one_row(tmp_path, {"chosen": [u] + tail, "rejected": [u, {"role": "assistant", "content": "w"}]})
    assert row.prompt == [u] and row.chosen == tail and row.rejected == "w"


def test_transcript_implicit_prompt(tmp_path):
    row = one_row(tmp_path, {"chosen": HH_PROMPT + " 4", "rejected": HH_PROMPT + " 5"})
    assert (row.prompt, row.chosen, row.rejected, row.transcript) == (HH_PROMPT, " 4", " 5", True)


def test_transcript_splits_at_common_prefix_not_last_marker_of_one_side(tmp_path):
    chosen = HH_PROMPT + " 4.\n\nHuman: Sure?\n\nAssistant: Yes."
    row = one_row(tmp_path, {"chosen": chosen, "rejected": HH_PROMPT + " 5."})
    assert row.prompt == HH_PROMPT
    assert row.chosen == " 4.\n\nHuman: Sure?\n\nAssistant: Yes." and row.rejected == " 5."


def test_transcript_common_prefix_past_the_marker(tmp_path):
    # Both answers start with "The " -- the prompt still ends at the marker.
    row = one_row(tmp_path, {"chosen": HH_PROMPT + " The sum is 4", "rejected": HH_PROMPT + " The sum is 5"})
    assert (row.prompt, row.chosen, row.rejected) == (HH_PROMPT, " The sum is 4", " The sum is 5")


def test_a_prompt_column_of_another_name_is_named_in_the_bad_row(tmp_path):
    """Intel/orca_dpo_pairs rows (system/question/chosen/rejected) have no prompt key, so they read as
    transcripts: every row was 'no shared prompt ending at an Assistant: turn marker', with no word of data.fields."""
    rows, report = rows_of(tmp_path, [{"system": "", "question": "Q", "chosen": "a", "rejected": "b", "id": 3}])
    assert rows == [] and [r for _, r in report.bad] == [
        "no shared prompt ending at an 'Assistant:' turn marker; name its prompt column with data.fields: "
        "{prompt: COLUMN} (text columns: question)"]
    rows, report = rows_of(tmp_path, [{"chosen": "a", "rejected": "b"}])
    assert [r for _, r in report.bad] == [NO_PROMPT]
    row = one_row(tmp_path, {"system": "", "question": "Q", "chosen": "a", "rejected": "b"},
                  fields={"prompt": "question"})
    assert (row.prompt, row.chosen, row.rejected) == ("Q", "a", "b")



def test_a_prompt_column_left_out_of_data_fields_is_named_in_the_bad_row(tmp_path):
    """stack_exchange_paired_tiny's question/response_j/response_k with data.fields {chosen: response_j, rejected:
    response_k} (its prompt column not mapped) was told 'rows of chosen and rejected text alone ...: give the prompt
    a 'prompt' column', of rows that have one under another name: the renamed row had lost its unmapped columns."""
    obj = {"question": "Q", "response_j": "a", "response_k": "b", "id": 3}
    rows, report = rows_of(tmp_path, [obj], fields={"chosen": "response_j", "rejected": "response_k"})
    assert rows == [] and [r for _, r in report.bad] == [
        "no shared prompt ending at an 'Assistant:' turn marker; name its prompt column with data.fields: "
        "{prompt: COLUMN} (text columns: question)"]
    rows, report = rows_of(tmp_path, [{"a": "x", "b": "y"}], fields={"chosen": "a", "rejected": "b"})
    assert [r for _, r in report.bad] == [NO_PROMPT]


def test_a_prompt_column_under_data_format_transcript_is_named_in_the_bad_row(tmp_path):
    """data.format: transcript on prompt/chosen/rejected rows told each row to 'give the prompt a 'prompt' column',
    which it had: a transcript reads chosen and rejected whole, and the prompt column is read by the standard format."""
    rows, report = rows_of(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}], format="transcript")
    assert rows == [] and [r for _, r in report.bad] == [
        "no shared prompt ending at an 'Assistant:' turn marker; data.format: transcript reads chosen and rejected "
        "whole, and this row has a 'prompt' column: set data.format: auto (or standard)"]

NO_PROMPT = ("no shared prompt ending at an 'Assistant:' turn marker; rows of chosen and rejected text alone are "
             "read as HH transcripts ('\\n\\nHuman: ... \\n\\nAssistant: ...'): give the prompt a 'prompt' column")


def test_trl_implicit_prompt_text_rows_are_told_where_the_prompt_goes(tmp_path):
    """TRL's standard preference rows with an implicit prompt (``{"chosen": "The sky is blue.", "rejected": "The sky
    is green."}``, which TRL splits at their first differing character) were each 'no shared prompt ending at an
    'Assistant:' turn marker', with no word of what dtrain reads or where the prompt goes."""
    rows, report = rows_of(tmp_path, [{"chosen": "The sky is blue.", "rejected": "The sky is green."}])
    assert rows == [] and [r for _, r in report.bad] == [NO_PROMPT]


def test_an_empty_system_column_is_no_system_message(tmp_path):
    """Intel/orca_dpo_pairs leaves ``system`` empty in many rows: an empty system turn was rendered in place of
    the template's default one (mlx_lm.generate then prompts with the default, not what was trained)."""
    from conftest import CHATML, make_tokenizer

    from dtrain.data import tokenize_rows

    default = "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe kind.<|im_end|>\n{% endif %}" + CHATML
    tok = make_tokenizer(chat_template=default)
    row = one_row(tmp_path, {"prompt": "Q", "chosen": "a", "rejected": "b", "system": " "})
    assert row.system is None
    (pair,), _ = tokenize_rows([row], tok, DataConfig())
    assert tok.decode(pair.prompt).startswith("<s><|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nQ")
    row = one_row(tmp_path, {"prompt": "Q", "chosen": "a", "rejected": "b", "system": "Be brief."})
    assert row.system == "Be brief."


def test_rows_with_tools_are_bad_rows_saying_so():
    """mlx-lm's and TRL's ``tools``, OpenAI's ``input.tools`` and a message's ``tool_calls`` are rendered by chat
    templates; dtrain renders role and content only. A row with tools trained without their definitions, and a
    tool call was 'must be an object with string 'role' and 'content''."""
    u, a = {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "w"}}]}
    tools = [{"type": "function", "function": {"name": "w", "parameters": {}}}]
    items = [({"messages": [u, a], "tools": tools}, "messages", "'tools' (tool definitions)"),
             ({"messages": [u, call, {"role": "tool", "content": "sun"}, a]}, "messages", "messages[1] 'tool_calls'"),
             ({"input": {"messages": [u], "tools": tools}, "preferred_output": [a],
               "non_preferred_output": [{"role": "assistant", "content": "Rain."}]},
              "openai", "'tools' (tool definitions)")]
    for obj, fmt, what in items:
        rows, report = parse_rows([("f.jsonl:1", obj)], DataConfig(format=fmt), "f.jsonl")
        assert rows == [] and report.bad == [
            ("f.jsonl:1", f"{what}: rows with tools are not read (dtrain renders the messages' role and content only)")]
    for none in ([], None, "[]", ""):  # hub datasets keep tools as JSON text
        rows, report = parse_rows([("f.jsonl:1", {"messages": [u, a], "tools": none})], DataConfig(), "f.jsonl")
        assert report.bad == [] and len(rows) == 1
    _, report = parse_rows([("f.jsonl:1", {"messages": [u, a], "tools": json.dumps(tools)})], DataConfig(), "f.jsonl")
    assert [why for _, why in report.bad] == [
        "'tools' (tool definitions): rows with tools are not read (dtrain renders the messages' role and content only)"]



def test_rows_with_openais_legacy_functions_are_bad_rows_as_tools_are():
    """OpenAI's chat fine-tuning format before tools: a ``functions`` column and an assistant message's
    ``function_call``. They were dropped silently: the call's text-less turn trained as an empty answer, or the
    text beside it as the whole answer, and the function definitions never reached the template."""
    u, a = {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}
    call = {"role": "assistant", "content": "Let me look.", "function_call": {"name": "w", "arguments": "{}"}}
    functions = [{"name": "w", "parameters": {}}]
    items = [({"messages": [u, a], "functions": functions}, "'functions' (function definitions)"),
             ({"messages": [u, call]}, "messages[1] 'function_call'"),
             ({"messages": [u, call, {"role": "function", "name": "w", "content": "sun"}, a]},
              "messages[1] 'function_call'"),
             ({"input": {"messages": [u], "functions": functions}, "preferred_output": [a],
               "non_preferred_output": [{"role": "assistant", "content": "Rain."}]}, "'functions' (function definitions)")]
    one = {"name": "w", "description": "The weather.", "parameters": {"type": "object"}}  # one definition, not in a list
    items += [({"messages": [u, a], "functions": one}, "'functions' (function definitions)"),
              ({"messages": [u, a], "functions": json.dumps(one)}, "'functions' (function definitions)")]
    for obj, what in items:
        rows, report = parse_rows([("f.jsonl:1", obj)], DataConfig(), "f.jsonl", pairwise="messages" not in obj)
        assert rows == [] and report.bad == [
            ("f.jsonl:1", f"{what}: rows with tools are not read (dtrain renders the messages' role and content only)")]
    for functions in ([], "[]", ["parse", "main"], "parse, main", {}, {"main": "def main(): pass"}):  # none, or a code dataset's column of names
        rows, report = parse_rows([("f.jsonl:1", {"messages": [u, {**a, "function_call": None}], "functions": functions})],
                                  DataConfig(), "f.jsonl", pairwise=False)
        assert report.bad == [] and len(rows) == 1

def test_openai_format(tmp_path):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    row = one_row(tmp_path, {"input": {"messages": msgs},
                             "preferred_output": [{"role": "assistant", "content": "good"}],
                             "non_preferred_output": [{"role": "assistant", "content": "bad"}]})
    assert (row.prompt, row.chosen, row.rejected) == (msgs, "good", "bad")


def test_sharegpt_format(tmp_path):
    row = one_row(tmp_path, {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}],
                             "chosen": {"from": "gpt", "value": "good"}, "rejected": {"from": "gpt", "value": "bad"}})
    assert row.prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert (row.chosen, row.rejected) == ("good", "bad")


def test_field_mapping(tmp_path):
    obj = {"question": "Q", "response_j": "good", "response_k": "bad", "sys": "S", "extra": 1}
    fields = {"prompt": "question", "chosen": "response_j", "rejected": "response_k", "system": "sys"}
    row = one_row(tmp_path, obj, fields=fields)
    assert (row.prompt, row.chosen, row.rejected, row.system) == ("Q", "good", "bad", "S")
    rows, report = rows_of(tmp_path, [{"question": "Q", "response_j": "good"}], fields=fields)
    assert rows == [] and report.bad[0][1] == "missing field 'response_k' (data.fields.rejected; the row's columns: question, response_j)"
    # a mapped system column that the row lacks is a bad row, as a mapped prompt is (a misspelt
    # column used to train every row without its system message)
    rows, report = rows_of(tmp_path, [{k: v for k, v in obj.items() if k != "sys"}], fields=fields)
    assert rows == [] and report.bad[0][1] == "missing field 'sys' (data.fields.system; the row's columns: question, response_j, response_k, extra)"
    rows, report = rows_of(tmp_path, [{**obj, "sys": None}], fields=fields)  # present, null: no system message
    assert report.bad == [] and rows[0].system is None


def test_null_field_is_named_null_not_missing(tmp_path):
    rows, report = rows_of(tmp_path, [{"prompt": "Q", "chosen": None, "rejected": "b"}, {"prompt": "Q", "chosen": "a"},
                                      {"prompt": "Q", "chosen": "a", "rejected": "b"}])
    assert [r.chosen for r in rows] == ["a"]
    assert [why for _, why in report.bad] == ["field 'chosen' is null", "missing field 'rejected'"]


def test_explicit_format_overrides_detection(tmp_path):
    rows, report = rows_of(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}], format="openai")
    assert rows == [] and report.bad[0][1] == "missing field 'input'"


def test_json_array_detected_by_content_with_item_lines(tmp_path):
    path = tmp_path / "pairs.data"  # suffix says nothing
    path.write_text('[\n {"prompt": "Q", "chosen": "a", "rejected": "b"},\n {"prompt": "Q", "chosen": "a"}\n]\n')
    rows, report = load_rows(str(path), DataConfig())
    assert [r.source for r in rows] == [f"{path}:2[0]"]
    assert report.bad == [(f"{path}:3[1]", "missing field 'rejected'")]


BAD_ROWS = [
    ('{"prompt": "Q", "chosen": "a", "rejected": "b"', "invalid JSON: Expecting ',' delimiter (column 47)"),
    ('[1, 2]', "expected a JSON object, got array"),
    ('{"prompt": "Q", "chosen": "a"}', "missing field 'rejected'"),
    ('{"prompt": "Q", "chosen": 3, "rejected": "b"}', "field 'chosen' must be a string, got number"),
    ('{"prompt": "Q", "chosen": "a", "rejected": " \\n "}', "empty response in 'rejected'"),
    ('{"prompt": "Q", "chosen": "a", "rejected": "b", "system": 1}', "field 'system' must be a string, got number"),
    ('{"prompt": "Q", "chosen": "a", "rejected": "\\ud800"}',
     "text is not valid UTF-8 (lone surrogate escape \\ud800)"),
]


def test_a_byte_order_mark_opening_any_line_is_skipped(tmp_path):
    """Files saved with a BOM and joined (``cat a.jsonl b.jsonl``) carry one at the start of a later line: that
    row was bad ('invalid JSON: Unexpected UTF-8 BOM'); only the file's first line was read past it."""
    line = '\ufeff{"prompt": "Q", "chosen": "a", "rejected": "b"}\r\n'
    path = tmp_path / "joined.jsonl"
    path.write_bytes((line * 3).encode())
    rows, report = load_rows(str(path), DataConfig())
    assert [r.source for r in rows] == [f"{path}:{n}" for n in (1, 2, 3)] and report.bad == []


def test_json_array_item_lines_count_each_newline_once():
    """The line of each array item was counted from the top of the file for every item: a JSON array of
    tens of MB spent minutes (quadratic) before its first row was read. Item lines stay exact."""
    from dtrain.data.jsonfile import _array_items

    class Counting(str):
        scanned = 0

        def count(self, sub, start=0, end=None):
            Counting.scanned += (len(self) if end is None else end) - start
            return super().count(sub, start, end)

    items = [{"prompt": "Q\n" * i, "chosen": "a", "rejected": "b"} for i in range(200)]
    text = Counting("[\n" + ",\n".join(json.dumps(o, indent=1) for o in items) + "\n]\n")
    starts = [2]  # "[" alone on line 1
    for o in items[:-1]:
        starts.append(starts[-1] + json.dumps(o, indent=1).count("\n") + 1)
    assert [line for line, _ in _array_items(text)] == starts
    assert Counting.scanned <= len(text)


def test_each_bad_row_kind_has_line_and_reason(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = '{"prompt": "Q", "chosen": "a", "rejected": "b"}'
    raw = "\n".join([good] + [line for line, _ in BAD_ROWS]).encode() + b'\n{"prompt": "Q", "chosen": "\xff", "rejected": "b"}\n'
    path.write_bytes(raw)
    rows, report = load_rows(str(path), DataConfig())
    assert len(rows) == 1 and report.rows_read == len(BAD_ROWS) + 2
    expected = [(f"{path}:{i + 2}", reason) for i, (_, reason) in enumerate(BAD_ROWS)]
    expected.append((f"{path}:{len(BAD_ROWS) + 2}", "text is not valid UTF-8 (undecodable byte 0xff)"))
    assert report.bad == expected
    assert f"{len(expected)} of {len(expected) + 1} rows skipped" in report.summary()


def test_an_object_field_of_another_type_is_named_an_object():
    """The message read 'must be a object'."""
    for obj, fmt, field in (({"input": "Q", "preferred_output": [], "non_preferred_output": []}, "openai", "input"),
                            ({"conversations": [], "chosen": "A", "rejected": "B"}, "sharegpt", "chosen")):
        _, report = parse_rows([("f.jsonl:1", obj)], DataConfig(format=fmt), "f.jsonl")
        assert report.bad == [("f.jsonl:1", f"field '{field}' must be an object, got string")]


def test_conversational_bad_rows(tmp_path):
    u = {"role": "user", "content": "a"}
    rows, report = rows_of(tmp_path, [
        {"chosen": [u, {"role": "assistant", "content": "x"}], "rejected": [u]},
        {"chosen": [u, {"role": "assistant", "content": "x"}], "rejected": [{"role": "user"}]},
    ])
    assert rows == []
    assert [r for _, r in report.bad] == [
        "empty response in 'rejected': no assistant message after the shared prompt",
        "rejected[0] must be an object with string 'role' and 'content'",
    ]


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "data file not found"),
    (lambda p: p.mkdir(), "is a directory but no data folder (data.train)"),
    (lambda p: p.write_text(" \n"), "file is empty"),
    (lambda p: p.write_text('{"question": "Q", "answer": "A"}\n'), "unknown row format (keys of the first row: ['answer', 'question'])"),
    (lambda p: p.write_text('[{"prompt": "Q",}]'), "1: invalid JSON array: Expecting property name enclosed in double quotes (column 17)"),
    (lambda p: p.write_text('{\n "prompt": "Q", "chosen": "a", "rejected": "b"\n}\n'), "one JSON object spread over several lines"),
])
def test_file_level_errors(tmp_path, setup, message):
    path = tmp_path / "x.jsonl"
    setup(path)
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value).startswith(str(path)) and message in str(err.value)


ROWS = [{"prompt": f"Q{i}", "chosen": "a", "rejected": "b"} for i in range(3)]


@pytest.mark.parametrize("obj, indent, message", [
    ({"data": ROWS}, None, "x.json:1: one JSON object holding 3 rows under 'data'; dtrain reads a JSON array of rows or "
                           "one row per line (JSONL): write that list as the file, e.g. jq -c '.data[]' {p}"),
    ({"version": "1", "train": ROWS}, 2, "x.json: one JSON object holding 3 rows under 'train'; dtrain reads a JSON "
                                         "array of rows or one row per line (JSONL): write that list as the file, "
                                         "e.g. jq -c '.train[]' {p}"),
    ({"my rows": ROWS}, None, "x.json:1: one JSON object holding 3 rows under 'my rows'; dtrain reads a JSON array of "
                              "rows or one row per line (JSONL): write that list as the file"),
])
def test_a_json_object_holding_the_rows_under_a_key_is_named(tmp_path, obj, indent, message):
    """``json.dump({"data": rows}, f)`` (the rows under a key, as SQuAD-style files and some exports hold them) was
    'unknown row format (keys of the first row: ['data']) ... set data.format, or data.fields to map your column
    names', which cannot help; written with indent, 'one JSON object spread over several lines'."""
    path = tmp_path / "x.json"
    path.write_text(json.dumps(obj, indent=indent))
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value) == str(tmp_path / message.format(p=path))
    path.write_text(json.dumps({"question": "Q", "answers": [{"label": "a"}, {"label": "b"}]}))  # a row, not rows
    with pytest.raises(DataError, match=r"unknown row format \(keys of the first row: \['answers', 'question'\]\)"):
        load_rows(str(path), DataConfig())


def test_a_one_row_file_of_messages_under_an_unknown_key_is_not_rows_under_it(tmp_path):
    """A file of one row whose only column holds its messages (``{"dialog": [{"role": "user", ...}, ...]}``) was
    'one JSON object holding 2 rows under 'dialog' ... e.g. jq -c '.dialog[]'', which writes its messages as rows;
    it is a row of an unknown format, whose message says how to map the column."""
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    path = tmp_path / "x.jsonl"
    for turns in (msgs, [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]):
        path.write_text(json.dumps({"dialog": turns}) + "\n")
        with pytest.raises(DataError) as err:
            load_rows(str(path), DataConfig())
        assert str(err.value).startswith(f"{path}:1: unknown row format (keys of the first row: ['dialog'])")


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16LE"), ("utf-16-le", "UTF-16LE"),
                                            ("utf-16-be", "UTF-16BE"), ("utf-32", "UTF-32LE"), ("utf-32-be", "UTF-32BE")])
@pytest.mark.parametrize("text", ['{"prompt": "Q", "chosen": "a", "rejected": "b"}\r\n', '[{"prompt": "Q"}]'])
def test_a_utf16_file_is_named_as_such(tmp_path, encoding, name, text):
    """A JSONL file saved as UTF-16 (Windows PowerShell's > and Out-File) was 'not a JSONL file or a JSON array:
    none of its lines is JSON'; plain or compressed, the message names the encoding and the conversion."""
    import gzip

    for path, data in ((tmp_path / "x.jsonl", text.encode(encoding)),
                       (tmp_path / "x.jsonl.gz", gzip.compress(text.encode(encoding)))):
        path.write_bytes(data)
        with pytest.raises(DataError) as err:
            load_rows(str(path), DataConfig())
        after = " (after gzip decompression)" if path.suffix == ".gz" else ""
        assert str(err.value) == (f"{path}: {name} text{after}; JSON and JSONL files are read as UTF-8: "
                                  f"convert it, e.g. iconv -f {name} -t UTF-8 (or save it as UTF-8)")


def test_unknown_fields_key(tmp_path):
    with pytest.raises(DataError, match="data.fields: unknown key 'answer'"):
        rows_of(tmp_path, [{"q": "Q"}], fields={"answer": "q"})


def test_real_orca_file_all_rows_parse_in_auto_mode(shared_data):
    rows, report = load_rows(str(shared_data / "orca_dpo_pairs_validation.jsonl"), DataConfig())
    assert report.bad == [] and len(rows) == 284
    assert rows[0].prompt[0]["role"] == "system" and rows[0].prompt[1]["content"].startswith("MM. Georges Colombier")
    assert rows[0].chosen.startswith("Step 1: Identify the names") and rows[0].rejected.startswith("Sure, I'd be happy")


def test_real_stack_exchange_file_with_field_mapping(shared_data):
    cfg = DataConfig(fields={"prompt": "question", "chosen": "response_j", "rejected": "response_k"})
    rows, report = load_rows(str(shared_data / "stack_exchange_paired_tiny.json"), cfg)
    assert report.bad == [] and len(rows) == 25
    assert rows[0].prompt.startswith("I'm writing a code using Java Swing")
    assert len({r.prompt for r in rows}) == 8 and max(len(r.chosen) for r in rows) > 9000


def _nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a": ' * depth + "1" + "}" * depth


@settings(max_examples=25, deadline=None)
@given(depth=st.integers(1, 6000), kind=st.sampled_from(["list", "dict"]))
def test_a_deeply_nested_line_is_a_bad_row_whatever_its_depth(tmp_path_factory, depth, kind):
    good = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    path = tmp_path_factory.mktemp("deep") / "deep.jsonl"
    path.write_text(json.dumps(good) + '\n{"prompt": ' + _nested(depth, kind) + ', "chosen": "a", "rejected": "b"}\n')
    rows, report = load_rows(str(path), DataConfig())
    assert len(rows) == 1 and [src for src, _ in report.bad] == [f"{path}:2"]


def test_a_too_deeply_nested_line_and_json_array(tmp_path):
    good = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(good) + '\n{"prompt": ' + _nested(5000, "list") + ', "chosen": "a", "rejected": "b"}\n')
    assert load_rows(str(path), DataConfig())[1].bad == [
        (f"{path}:2", "invalid JSON: nested more than 100 levels deep")]
    array = tmp_path / "deep.json"
    array.write_text("[" + json.dumps(good) + ",\n" + _nested(5000, "dict") + "]")
    rows, report = load_rows(str(array), DataConfig())
    assert [r.source for r in rows] == [f"{array}:1[0]"]
    assert report.bad == [(f"{array}:2[1]", "invalid JSON: nested more than 100 levels deep")]
    array.write_text("[" + json.dumps(good) + ",\n" + _nested(5000, "dict")[:-1] + "]")  # its end cannot be found
    with pytest.raises(DataError) as err:
        load_rows(str(array), DataConfig())
    assert str(err.value) == f"{array}: invalid JSON array: nested more than 100 levels deep"


def _unreadable_item(rng, n: int) -> tuple:
    """``(JSON text, reason)`` of a row that Python's json cannot read, or reads too deep to keep."""
    deep = rng.randint(101, 6000)
    row = '{"prompt": "[{\\"%d", "chosen": "a]", "rejected": "b}", "x": %s}'
    return rng.choice([
        (row % (n, _nested(deep, "list")), "nested more than 100 levels deep"),
        (row % (n, _nested(deep, "dict")), "nested more than 100 levels deep"),
        (_nested(deep, "list"), "nested more than 100 levels deep"),
        (row % (n, "[" + "7" * rng.randint(4301, 9000) + "]"), "an integer of more than 4300 digits"),
        ("-" + "1" * rng.randint(4301, 9000), "an integer of more than 4300 digits"),
        ('{"prompt": "a", "prompt": "b", "chosen": "a", "rejected": "b"}', "key 'prompt' given twice in one object"),
    ])


def test_an_unreadable_json_array_item_is_a_bad_row_as_a_jsonl_line_is(tmp_path):
    """One JSON array item nested too deep for Python or holding an integer over its int/str limit refused the
    whole file ('invalid JSON array: nested more than 100 levels deep'), where the same row on a JSONL line is
    one bad row. Generated files (seeded): each such item is a bad row named ``file:line[index]``, the other
    rows read, and the array gives the rows and reasons its JSONL twin gives."""
    import random

    rng = random.Random(11)
    for case in range(12):
        texts, reasons = [], {}
        for i in range(rng.randint(3, 9)):
            if rng.random() < 0.3:
                text, reasons[i] = _unreadable_item(rng, i)
            else:
                row = {"prompt": f"Q{i} [{{\"}}]", "chosen": f"a{i}", "rejected": "b"}
                text = json.dumps(row, indent=rng.choice([None, 2]))
            texts.append(text)
        seps = [rng.choice([", ", ",\n", "\n,\n  ", " ,\n\n"]) for _ in texts]
        body, lines = "[" + rng.choice(["", "\n", "\n  "]), []
        for text, sep in zip(texts, seps):
            lines.append(body.count("\n") + 1)
            body += text + sep
        array, jsonl = tmp_path / f"a{case}.json", tmp_path / f"a{case}.jsonl"
        array.write_text(body[: -len(seps[-1])] + rng.choice(["]", "\n]\n"]))
        jsonl.write_text("".join(t.replace("\n", "") + "\n" for t in texts))
        got, report = load_rows(str(array), DataConfig(format="standard"))
        assert report.bad == [(f"{array}:{lines[i]}[{i}]", f"invalid JSON: {why}") for i, why in reasons.items()]
        assert [r.source for r in got] == [f"{array}:{lines[i]}[{i}]" for i in range(len(texts)) if i not in reasons]
        twin, twin_report = load_rows(str(jsonl), DataConfig(format="standard"))
        assert [why for _, why in twin_report.bad] == [why for _, why in report.bad]
        assert [(r.prompt, r.chosen) for r in twin] == [(r.prompt, r.chosen) for r in got]


GOOD_ROWS = [{"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(40)]
BAD_FIRST = [  # rows of no format, or of another format than the rest of the file
    ({"chosen": "ANSWER: 2", "rejected": "It is 3."}, "missing field 'prompt'"),  # alone, it reads as a transcript
    ({"prompt": "What is 1+1?", "chosen": "ANSWER: 2"}, "missing field 'rejected'"),  # alone, no format at all
    ({"question": "Q", "answer": "A"}, "missing field 'prompt'"),
]


@pytest.mark.parametrize("bad, reason", BAD_FIRST)
def test_a_bad_first_row_is_one_bad_row(tmp_path, bad, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [bad] + GOOD_ROWS[:24])
    rows, report = load_rows(path, DataConfig())
    assert [r.chosen for r in rows] == [o["chosen"] for o in GOOD_ROWS[:24]]
    assert report.bad == [(f"{path}:1", reason)]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_auto_format_reads_every_good_row_wherever_the_bad_rows_are(tmp_path_factory, data):
    good = data.draw(st.integers(2, 30))
    bad = data.draw(st.lists(st.sampled_from(BAD_FIRST), max_size=good - 1))
    objs = list(GOOD_ROWS[:good])
    for b in bad:
        objs.insert(data.draw(st.integers(0, len(objs))), b)
    path = write_jsonl(tmp_path_factory.mktemp("d") / "d.jsonl", [o[0] if isinstance(o, tuple) else o for o in objs])
    rows, report = load_rows(path, DataConfig())
    assert [r.chosen for r in rows] == [o["chosen"] for o in GOOD_ROWS[:good]]
    assert report.bad == [(f"{path}:{i + 1}", o[1]) for i, o in enumerate(objs) if isinstance(o, tuple)]


def test_no_row_of_a_known_format_is_one_error_naming_the_first_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [42, {"question": "Q", "answer": "A"}, {"q": "Q2"}])
    with pytest.raises(DataError) as err:
        load_rows(path, DataConfig())
    assert str(err.value).startswith(f"{path}:2: unknown row format (keys of the first row: ['answer', 'question']);")


def test_no_items_is_one_error_naming_where_not_an_index_error():
    with pytest.raises(DataError, match=r"^mine\.jsonl: no rows$"):
        parse_rows([], DataConfig(), "mine.jsonl")


def test_a_pair_identical_as_written_is_dropped_not_bad(tmp_path):
    """Chosen == rejected reads well but carries no preference: a drop (``same text``), as the README lists
    drops; it was a bad row, which data.on_bad_row: error stopped a run for."""
    rows, report = parse_rows([("f.jsonl:1", {"prompt": "Q", "chosen": "a", "rejected": "a"}),
                               ("f.jsonl:2", {"prompt": "Q", "chosen": "a", "rejected": "b"})], DataConfig(), "f.jsonl")
    assert [r.source for r in rows] == ["f.jsonl:2"] and report.bad == []
    assert report.dropped == [("f.jsonl:1", "same text: chosen and rejected are identical")]


def test_a_pair_identical_as_written_is_dropped_in_every_preference_format():
    """Identical message lists (implicit prompt), transcripts, OpenAI and ShareGPT outputs are ``same text`` drops
    too, as TRL's extract_prompt keeps the last message as the response; an identical conversation was a bad row
    ('no assistant message after the shared prompt'), which data.on_bad_row: error stopped a run for."""
    u, a = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    items = [("f.jsonl:1", {"chosen": [u, a], "rejected": [u, a]}),
             ("f.jsonl:2", {"chosen": HH_PROMPT + " 4", "rejected": HH_PROMPT + " 4"}),
             ("f.jsonl:3", {"input": {"messages": [u]}, "preferred_output": [a], "non_preferred_output": [a]}),
             ("f.jsonl:4", {"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "gpt", "value": "A"},
                            "rejected": {"from": "gpt", "value": "A"}})]
    for item in items:
        rows, report = parse_rows([item], DataConfig(), "f.jsonl")
        assert (rows, report.bad) == ([], [])
        assert report.dropped == [(item[0], "same text: chosen and rejected are identical")]


def test_conversational_text_prompt_repeated_in_the_messages_is_not_trained_twice(tmp_path):
    """HuggingFaceH4/ultrafeedback_binarized rows carry ``prompt`` as text and the whole conversation in
    ``chosen``/``rejected``: the prompt is the messages' shared prefix (TRL maybe_extract_prompt). The text
    prompt was made a user turn in front of the messages, so the user turn was trained twice, once as response."""
    s, u = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is the sky?"}
    row = one_row(tmp_path, {"prompt": "What color is the sky?", "prompt_id": "0a1b",
                             "chosen": [s, u, {"role": "assistant", "content": "Blue."}],
                             "rejected": [s, u, {"role": "assistant", "content": "Green."}]})
    assert (row.prompt, row.chosen, row.rejected, row.rejected_prompt) == ([s, u], "Blue.", "Green.", None)
    # a text prompt in front of replies alone is still their user turn
    row = one_row(tmp_path, {"prompt": "Q", "chosen": [{"role": "assistant", "content": "x"}],
                             "rejected": [{"role": "assistant", "content": "y"}]})
    assert (row.prompt, row.chosen, row.rejected) == ([{"role": "user", "content": "Q"}], "x", "y")


def test_a_message_prompt_both_sides_repeat_is_not_trained_twice(tmp_path):
    """A message-list ``prompt`` beside ``chosen``/``rejected`` lists that hold the whole conversation (each opens
    with the prompt's messages) was a bad row ("'chosen' opens with a 'system' message"; TRL refuses it too, its
    prompt + completion not starting with its prompt). The prompt is the messages' shared prefix, as it is
    beside a text copy of the prompt."""
    s, u = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is the sky?"}
    a, b = {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Green."}
    for prompt in ([s, u], []):
        row = one_row(tmp_path, {"prompt": prompt, "chosen": [s, u, a], "rejected": [s, u, b]})
        assert (row.prompt, row.chosen, row.rejected, row.rejected_prompt) == ([s, u], "Blue.", "Green.", None)
    # a prompt in front of replies alone is still their prompt
    row = one_row(tmp_path, {"prompt": [s, u], "chosen": [a], "rejected": [b]})
    assert (row.prompt, row.chosen, row.rejected) == ([s, u], "Blue.", "Green.")


def test_an_empty_message_prompt_before_replies_alone_is_their_prompt(tmp_path):
    """``{prompt: [], chosen: [assistant], rejected: [assistant]}`` trained (the responses after the generation
    header alone, as sft still reads it), then read as lists holding the whole conversation, every such row
    bad: "no shared prompt: 'chosen' and 'rejected' start with an assistant message"."""
    a, b = {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Green."}
    row = one_row(tmp_path, {"prompt": [], "chosen": [a], "rejected": [b]})
    assert (row.prompt, row.chosen, row.rejected) == ([], "Blue.", "Green.")


def test_a_response_that_opens_with_another_turn_is_a_bad_row():
    """A response opening with a user turn before the assistant's (``prompt: [u]``, ``chosen: [u2, a]``) was
    trained as the model's turn, the prompt as trained ending inside the next turn's header
    (``<|im_start|>``); TRL refuses it (its prompt + completion does not start with its generation prompt)."""
    u, u2 = {"role": "user", "content": "Q"}, {"role": "user", "content": "Q2"}
    a, b = {"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}
    items = [({"prompt": [u], "chosen": [u2, a], "rejected": [b]}, "conversational",
              "'chosen' opens with a 'user' message: a response is the model's turn, written after the prompt"),
             ({"prompt": "Q", "chosen": [u, a], "rejected": [b]}, "conversational",
              "'chosen' opens with a 'user' message: a response is the model's turn, written after the prompt"),
             ({"prompt": [u], "completion": [{"role": "system", "content": "S"}, a]}, "prompt_completion",
              "'completion' opens with a 'system' message: a response is the model's turn, written after the prompt")]
    for obj, fmt, reason in items:
        rows, report = parse_rows([("f.jsonl:1", obj)], DataConfig(format=fmt), "f.jsonl")
        assert rows == [] and report.bad == [("f.jsonl:1", reason)]


def test_a_jsonl_file_whose_first_row_is_a_list_is_read_line_by_line(tmp_path):
    """A JSONL file opening with ``[1, 2]`` was read as one JSON array and stopped ('invalid JSON array:
    Extra data'); its lines are rows, the list a bad row."""
    path = tmp_path / "x.jsonl"
    path.write_text('[1, 2]\n{"prompt": "Q", "chosen": "a", "rejected": "b"}\n')
    rows, report = load_rows(str(path), DataConfig())
    assert [r.source for r in rows] == [f"{path}:2"]
    assert report.bad == [(f"{path}:1", "expected a JSON object, got array")]


def test_a_key_given_twice_in_a_row_is_a_bad_row(tmp_path):
    """``{"prompt": "a", "prompt": "b", ...}`` trained on "b" and said nothing (Python's json keeps the last);
    a JSONL line and a JSON array item with a key twice, at any depth, are bad rows naming it."""
    good = '{"prompt": "Q", "chosen": "a", "rejected": "b"}'
    twice = '{"prompt": "a", "prompt": "b", "chosen": "a", "rejected": "b"}'
    nested = '{"prompt": [{"role": "user", "role": "system", "content": "Q"}], "chosen": "a", "rejected": "b"}'
    lines, array = tmp_path / "x.jsonl", tmp_path / "x.json"
    lines.write_text("\n".join([good, twice, nested]) + "\n")
    array.write_text("[\n" + ",\n".join([good, twice, nested]) + "\n]\n")
    for path, sources in ((lines, ("1", "2", "3")), (array, ("2[0]", "3[1]", "4[2]"))):
        rows, report = load_rows(str(path), DataConfig())
        assert [r.source for r in rows] == [f"{path}:{sources[0]}"]
        assert report.bad == [(f"{path}:{sources[1]}", "invalid JSON: key 'prompt' given twice in one object"),
                              (f"{path}:{sources[2]}", "invalid JSON: key 'role' given twice in one object")]


def test_a_response_without_an_assistant_message_is_a_bad_row():
    """A conversational ``chosen`` holding only a user message was trained as the model's response (an explicit
    prompt, a prompt-completion row, ShareGPT's ``chosen`` from ``human``); the row is bad, naming the roles."""
    u, a = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    items = [({"prompt": [u], "chosen": [{"role": "user", "content": "more"}], "rejected": [a]}, "conversational",
              "'chosen' has no assistant message (roles: user): a response is the model's turn"),
             ({"prompt": [u], "chosen": [a], "rejected": [u, {"role": "system", "content": "S"}]}, "conversational",
              "'rejected' has no assistant message (roles: user, system): a response is the model's turn"),
             ({"prompt": [u], "completion": [u]}, "prompt_completion",
              "'completion' has no assistant message (roles: user): a response is the model's turn"),
             ({"conversations": [{"from": "human", "value": "Q"}], "chosen": {"from": "human", "value": "A"},
               "rejected": {"from": "gpt", "value": "B"}}, "sharegpt",
              "'chosen' has no assistant message (roles: user): a response is the model's turn")]
    for obj, fmt, reason in items:
        rows, report = parse_rows([("f.jsonl:1", obj)], DataConfig(format=fmt), "f.jsonl")
        assert rows == [] and report.bad == [("f.jsonl:1", reason)]


def test_an_openai_output_of_another_role_is_a_bad_row_naming_it():
    """``preferred_output: [{"role": "user", ...}]`` read 'must hold exactly one assistant message, got 1
    message(s)', which it seemed to; the reason names the role found, or the count when there are several."""
    u, a = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    for out, reason in (([u], "field 'preferred_output' must hold one assistant message, got a 'user' message"),
                        ([a, a], "field 'preferred_output' must hold one assistant message, got 2 messages"),
                        ([], "field 'preferred_output' must hold one assistant message, got 0 messages")):
        obj = {"input": {"messages": [u]}, "preferred_output": out, "non_preferred_output": [a]}
        _, report = parse_rows([("f.jsonl:1", obj)], DataConfig(format="openai"), "f.jsonl")
        assert report.bad == [("f.jsonl:1", reason)]


def test_an_integer_too_long_for_python_is_a_bad_row(tmp_path):
    """An integer of more than 4300 digits (Python's int/str limit) stopped the run with a ValueError traceback;
    on a line or as a JSON array item it is a bad row, in an object spread over lines a one-line error."""
    good = '{"prompt": "Q", "chosen": "a", "rejected": "b"}'
    long = '{"prompt": "Q", "chosen": "a", "rejected": "b", "n": ' + "1" * 5000 + "}"
    path = tmp_path / "x.jsonl"
    path.write_text(good + "\n" + long + "\n")
    rows, report = load_rows(str(path), DataConfig())
    assert len(rows) == 1 and report.bad == [(f"{path}:2", "invalid JSON: an integer of more than 4300 digits")]
    path.write_text("[" + good + ",\n" + long + "]")
    rows, report = load_rows(str(path), DataConfig())
    assert len(rows) == 1 and report.bad == [(f"{path}:2[1]", "invalid JSON: an integer of more than 4300 digits")]
    for text, message in ((long.replace(", ", ",\n"), "not a JSONL file or a JSON array: none of its 4 non-blank"),):
        path.write_text(text)
        with pytest.raises(DataError) as err:
            load_rows(str(path), DataConfig())
        assert str(err.value).startswith(f"{path}: {message}")


def test_tools_text_that_cannot_be_read_is_a_bad_row():
    """``tools`` kept as JSON text nested too deep, or holding an integer too long for Python, stopped the run
    with a RecursionError or ValueError traceback; like any non-empty tools text it makes the row bad."""
    u, a = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    for text in ("[" * 100_000, "[" + "1" * 5000 + "]", "[{not json"):
        rows, report = parse_rows([("f.jsonl:1", {"messages": [u, a], "tools": text})], DataConfig(), "f.jsonl")
        assert rows == [] and report.bad == [("f.jsonl:1", "'tools' (tool definitions): rows with tools are not "
                                              "read (dtrain renders the messages' role and content only)")]


def test_a_surrogate_escape_is_not_called_an_undecodable_byte(tmp_path):
    """The JSON escape ``\\udc80`` read as 'undecodable byte 0x80', the reason a raw byte 0x80 gets; each is
    named for what it is, on JSONL lines and in JSON arrays."""
    escaped = '{"prompt": "Q", "chosen": "a", "rejected": "\\udc80"}'.encode()
    raw = '{"prompt": "Q", "chosen": "a", "rejected": "'.encode() + b'\x80"}'
    lines, array = tmp_path / "x.jsonl", tmp_path / "x.json"
    lines.write_bytes(escaped + b"\n" + raw + b"\n")
    array.write_bytes(b"[" + escaped + b",\n" + raw + b"]")
    for path, sources in ((lines, ("1", "2")), (array, ("1[0]", "2[1]"))):
        assert load_rows(str(path), DataConfig())[1].bad == [
            (f"{path}:{sources[0]}", "text is not valid UTF-8 (lone surrogate escape \\udc80)"),
            (f"{path}:{sources[1]}", "text is not valid UTF-8 (undecodable byte 0x80)")]


def test_rows_that_are_no_object_are_named_in_json_terms(tmp_path):
    """A ``null`` line read 'expected a JSON object, got NoneType' and a file of such lines 'rows are: NoneType,
    list'; a file whose every line is JSON that cannot be read said its rows were 'invalid JSON'. Python's type
    names are JSON's, and a file of unreadable rows names the first one and why."""
    path = tmp_path / "x.jsonl"
    path.write_text('null\n[1]\n')
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value).startswith(f"{path}: no row is a JSON object (rows are: array, null); expected")
    path.write_text('null\n[1]\n{"prompt": "Q", "chosen": 1.5, "rejected": true}\n')
    _, report = load_rows(str(path), DataConfig())
    assert report.bad == [(f"{path}:1", "expected a JSON object, got null"),
                          (f"{path}:2", "expected a JSON object, got array"),
                          (f"{path}:3", "field 'chosen' must be a string, got number")]
    path.write_text('{"prompt": "a", "prompt": "b"}\n{"a": ' + "1" * 5000 + "}\n")
    with pytest.raises(DataError) as err:
        load_rows(str(path), DataConfig())
    assert str(err.value).startswith(f"{path}: no row can be read (first: {path}:1: invalid JSON: key 'prompt' "
                                     "given twice in one object); expected")


def test_cr_only_line_endings_are_named(tmp_path):
    """A JSONL file with old Mac line endings (CR only) is one line to a reader that splits at LF, and said
    'invalid JSON: Extra data' or 'line has N characters' with no hint why; the reason names the CRs."""
    row = '{"prompt": "Q", "chosen": "a", "rejected": "b"}\r'
    hint = "; the line holds CR (\\r) line breaks, and JSONL lines end at \\n: convert them, e.g. tr '\\r' '\\n'"
    path = tmp_path / "x.jsonl"
    for count, reason in ((3, "(1: invalid JSON: Extra data (column 49)"),
                          (50_000, f"(first: {path}:1: line has 2,399,999 characters; lines over 2,000,000 are not "
                                   "read")):
        path.write_bytes((row * count).encode())
        with pytest.raises(DataError) as err:
            load_rows(str(path), DataConfig())
        assert f"{reason}{hint})" in str(err.value)


@pytest.mark.parametrize("compress", [False, True])
def test_a_row_too_long_to_read_is_a_bad_row_in_a_json_array_as_in_jsonl(tmp_path, compress):
    """A JSONL line over MAX_LINE_CHARS is a bad row; the same row as a JSON array item was read and tokenized,
    so one file's rows gave other pairs (and another train/valid split) as JSONL and as a JSON array."""
    import gzip

    from dtrain.data import split_rows
    from dtrain.data.jsonfile import MAX_LINE_CHARS

    good = [{"prompt": f"Q{i}", "chosen": "a", "rejected": "b"} for i in range(6)]
    objs = good[:2] + [{**good[0], "chosen": "x" * MAX_LINE_CHARS}] + good[2:]
    lines = [json.dumps(o) for o in objs]
    out = {}
    for name, text in (("d.jsonl", "\n".join(lines) + "\n"), ("d.json", "[\n" + ",\n".join(lines) + "\n]\n")):
        path = tmp_path / (name + ".gz" if compress else name)
        path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
        rows, report = load_rows(str(path), DataConfig())
        out[name] = [(r.prompt, r.chosen) for r in rows], [r.prompt for r in split_rows(rows, 0.3, 0)[1]]
        assert [src for src, _ in report.bad] == [f"{path}:3" if name == "d.jsonl" else f"{path}:4[2]"]
        assert report.bad[0][1] == (f"{'line' if name == 'd.jsonl' else 'item'} has {len(lines[2]):,} characters; "
                                    f"{'lines' if name == 'd.jsonl' else 'items'} over {MAX_LINE_CHARS:,} are not read")
    assert out["d.json"] == out["d.jsonl"] and len(out["d.json"][0]) == 6


def test_sharegpt_role_names_in_role_content_messages_are_its_speakers(tmp_path):
    """Messages written ``{"role": "human"}`` / ``{"role": "gpt"}`` (ShareGPT's speakers under OpenAI's keys, as some
    converted datasets hold them) were bad rows ("'messages' must end with an assistant message", "'chosen' has no
    assistant message (roles: gpt)"), or, where a row did not need one, rendered with a 'human' header; they are
    read as the ShareGPT speakers they name, as ``{from, value}`` messages are."""
    u, a = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    rows, report = load_rows(write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "human", "content": "Q"}, {"role": "GPT", "content": "A"}]}]), DataConfig(), pairwise=False)
    assert report.bad == [] and (rows[0].prompt, rows[0].chosen) == ([u], "A")
    row = one_row(tmp_path, {"prompt": [{"role": "system", "content": "S"}, {"role": "human", "content": "Q"}],
                             "chosen": [{"role": "gpt", "content": "A"}], "rejected": [{"role": "model", "content": "B"}]})
    assert (row.prompt, row.chosen, row.rejected) == ([{"role": "system", "content": "S"}, u], "A", "B")
    row = one_row(tmp_path, {"chosen": [{"role": "human", "content": "Q"}, a],
                             "rejected": [u, {"role": "gpt", "content": "B"}]})  # implicit: one shared prompt
    assert (row.prompt, row.chosen, row.rejected, row.rejected_prompt) == ([u], "A", "B", None)
    row = one_row(tmp_path, {"prompt": [{"role": "tool", "content": "42"}], "chosen": [a], "rejected": [
        {"role": "assistant", "content": "B"}]})  # a role ShareGPT does not name is kept as written
    assert row.prompt == [{"role": "tool", "content": "42"}]


def test_a_message_with_an_empty_role_is_a_bad_row(tmp_path):
    """A message whose role is empty or blank ({"role": "", ...}) was accepted and rendered under an empty header;
    it is a bad row naming the message, in a prompt, a response or a messages row."""
    u, a, b = ({"role": r, "content": c} for r, c in (("user", "Q"), ("assistant", "A"), ("assistant", "B")))
    rows, report = rows_of(tmp_path, [{"prompt": [{"role": "", "content": "Q"}], "chosen": [a], "rejected": [b]},
                                      {"prompt": [u], "chosen": [{"role": " ", "content": "A"}], "rejected": [b]},
                                      {"prompt": [u], "chosen": [a], "rejected": [b]}])
    assert len(rows) == 1 and [why for _, why in report.bad] == [
        "prompt[0] 'role' is empty: a message names who speaks (user, assistant, system, ...)",
        "chosen[0] 'role' is empty: a message names who speaks (user, assistant, system, ...)"]
    _, report = load_rows(write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "", "content": "Q"}, a]}]),
                          DataConfig(), pairwise=False)
    assert [why for _, why in report.bad] == [
        "messages[0] 'role' is empty: a message names who speaks (user, assistant, system, ...)"]


def test_a_response_written_as_one_message_object_or_under_messages_is_read_as_mlx_lm_lora_reads_it(tmp_path):
    """mlx-lm-lora's preference rows (ORPODataset) take ``chosen``/``rejected`` as text, a message list, one message
    object (``{"role": "assistant", "content": ...}``) or ``{"messages": [...]}``; the last two were bad rows
    ("field 'chosen' must be a string, got object"; beside prompt messages "... a list of messages, got object")."""
    u, a, b = ({"role": r, "content": c} for r, c in (("user", "Q"), ("assistant", "A"), ("assistant", "B")))
    for prompt in ("Q", [u]):
        for chosen, rejected in ((a, b), ({"messages": [a]}, {"messages": [b]}), (a, [b])):
            row = one_row(tmp_path, {"prompt": prompt, "chosen": chosen, "rejected": rejected})
            assert (row.prompt, row.chosen, row.rejected) == ([u], "A", "B"), (prompt, chosen)
    row = one_row(tmp_path, {"chosen": {"messages": [u, a]}, "rejected": {"messages": [u, b]}})  # implicit prompt
    assert (row.prompt, row.chosen, row.rejected) == ([u], "A", "B")
    rows, report = rows_of(tmp_path, [{"prompt": "Q", "chosen": u, "rejected": b},
                                      {"prompt": "Q", "chosen": {"text": "A"}, "rejected": b}])
    assert rows == [] and [why for _, why in report.bad] == [
        "'chosen' has no assistant message (roles: user): a response is the model's turn",
        "chosen[0] must be an object with string 'role' and 'content'"]


def test_a_response_that_ends_with_another_turn_is_a_bad_row(tmp_path):
    """A response is the model's turn; one that ended with the user's message ({prompt, chosen: [assistant, user]},
    implicit sides [user, assistant, user] / [user, assistant], an HH side that ends with an unanswered
    '\\n\\nHuman: ...') trained that message as the model's words ('A<|im_end|>\\n<|im_start|>user\\nmore<|im_end|>'),
    where a messages row ending so is a bad row. It is one, as a response that opens with another turn is."""
    u, a, b, more = ({"role": r, "content": c} for r, c in (("user", "hi"), ("assistant", "A"), ("assistant", "B"),
                                                            ("user", "more")))
    why = "{!r} ends with a {!r} message: a response is the model's turn, and that message would be trained as its words"
    hh = "{!r} ends with a 'Human:' turn: a response is the model's turn, and that turn would be trained as its words"
    H = "\n\nHuman: hi\n\nAssistant:"
    for obj, reason in (({"prompt": [u], "chosen": [a, more], "rejected": [b]}, why.format("chosen", "user")),
                        ({"chosen": [u, a, more], "rejected": [u, b]}, why.format("chosen", "user")),
                        ({"prompt": "hi", "chosen": [a], "rejected": [b, {"role": "tool", "content": "42"}]},
                         why.format("rejected", "tool")),
                        ({"chosen": H + " A\n\nHuman: more", "rejected": H + " B"}, hh.format("chosen")),
                        ({"chosen": H + " A", "rejected": H + " B\n\nHuman: more\n\nAssistant: "}, hh.format("rejected")),
                        ({"prompt": H, "chosen": " A\n\nHuman:", "rejected": " B"}, hh.format("chosen"))):
        rows, report = rows_of(tmp_path, [obj])
        assert rows == [] and [why for _, why in report.bad] == [reason], obj
    rows, report = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": [u], "completion": [a, more]}]), DataConfig(),
                             pairwise=False)
    assert rows == [] and [why for _, why in report.bad] == [why.format("completion", "user")]
    row = one_row(tmp_path, {"chosen": H + " A\n\nHuman: more\n\nAssistant: C", "rejected": H + " B"})  # answered
    assert (row.chosen, row.rejected) == (" A\n\nHuman: more\n\nAssistant: C", " B")


def test_a_text_side_beside_a_message_side_reads_the_same_whichever_side_it_is(tmp_path):
    """``{prompt: 'Q', chosen: [assistant], rejected: 'B'}`` trained (a text beside messages is one turn), but its
    mirror ``{prompt: 'Q', chosen: 'A', rejected: [assistant]}`` was read as a standard row: "field 'rejected' must
    be a string, got array"; the format was told by the chosen side alone."""
    u, a, b = ({"role": r, "content": c} for r, c in (("user", "Q"), ("assistant", "A"), ("assistant", "B")))
    for chosen, rejected in (([a], "B"), ("A", [b]), ("A", b)):
        row = one_row(tmp_path, {"prompt": "Q", "chosen": chosen, "rejected": rejected})
        assert (row.prompt, row.chosen, row.rejected) == ([u], "A", "B"), (chosen, rejected)


def test_a_known_role_or_speaker_written_with_spaces_around_it_is_read_as_that_role(tmp_path):
    """``{"role": "assistant "}`` (a space left by a converter) was kept as written: a messages row was bad with
    "'messages' must end with an assistant message (the completion)" and a response with "'chosen' has no assistant
    message (roles: assistant )", which name the role the row holds; ShareGPT's ``{"from": "gpt "}`` was an
    unknown speaker. Known names are read as their roles with the spaces around them ignored, as with their case."""
    u, a = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}
    rows, report = load_rows(write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": " user", "content": "Q"}, {"role": "assistant ", "content": "A"}]},
        {"conversations": [{"from": "human\n", "value": "Q"}, {"from": " GPT", "value": "A"}]}]), DataConfig(),
        pairwise=False)
    assert report.bad == [] and [(r.prompt, r.chosen) for r in rows] == [([u], "A")] * 2
    row = one_row(tmp_path, {"prompt": [{"role": "System ", "content": "S"}, u],
                             "chosen": [{"role": " assistant", "content": "A"}], "rejected": [a]})
    assert (row.prompt, row.chosen, row.rejected) == ([{"role": "system", "content": "S"}, u], "A", "B")
