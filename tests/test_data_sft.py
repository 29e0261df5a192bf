"""SFT rows: mlx-lm's chat/completions/text and TRL's messages/prompt-completion rows,
rendered by the chat template with one terminator, bad rows with file:line; the
chosen side of preference rows; pairwise objectives refuse SFT rows.

Ids for the fixture tokenizer (conftest.make_tokenizer: 1 <s>, 2 </s>,
3 <|im_start|>, 4 <|im_end|>).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from conftest import make_tokenizer

from dtrain.config import DataConfig
from dtrain.data import check_file, load_dataset, tokenize_rows
from dtrain.data.formats import detect_format, parse_rows
from dtrain.errors import DataError
from dtrain.engine import DPO, ORPO, SFT, fit_dataset
from dtrain.types import Row

Q = "What is 2 + 2?"
CHAT_Q = "<s><|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
FOX = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def rows_of(objs, fmt="auto"):
    return parse_rows([(f"f.jsonl:{i + 1}", o) for i, o in enumerate(objs)], DataConfig(format=fmt), "f.jsonl")


@pytest.mark.parametrize("obj, fmt", [
    ({"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]}, "messages"),
    ({"prompt": Q, "completion": "4"}, "prompt_completion"),
    ({"prompt": [{"role": "user", "content": Q}], "completion": [{"role": "assistant", "content": "4"}]},
     "prompt_completion"),
    ({"text": FOX}, "text"),
])
def test_formats_are_detected_and_read_as_one_completion(obj, fmt):
    assert detect_format(obj, None) == fmt
    rows, report = rows_of([obj])
    assert report.bad == [] and rows[0].rejected is None and rows[0].source == "f.jsonl:1"


@pytest.mark.parametrize("obj", [
    {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]},
    {"prompt": Q, "completion": "4"},
    {"prompt": [{"role": "user", "content": Q}], "completion": [{"role": "assistant", "content": "4"}]},
    # data written pre-formatted: the template writes the one end-of-turn itself
    {"prompt": Q, "completion": "4<|im_end|>"},
])
def test_chat_rows_render_with_the_template_and_one_end_of_turn(tok, obj):
    rows, _ = rows_of([obj])
    pairs, report = tokenize_rows(rows, tok, DataConfig())
    assert report.bad == [] and report.dropped == []
    (p,) = pairs
    assert (tok.decode(p.prompt), tok.decode(p.chosen), p.rejected) == (CHAT_Q, "4<|im_end|>", [])
    assert p.chosen.count(4) == 1 and p.chosen[-1] == 4 and p.prompt.count(1) == 1


def test_text_rows_are_bos_text_eos_with_everything_after_bos_trained(tok):
    rows, _ = rows_of([{"text": FOX}, {"text": FOX + "</s>"}])
    pairs, report = tokenize_rows(rows, tok, DataConfig())
    assert report.dropped == []
    for p in pairs:
        assert p.prompt == [1] and p.chosen[-1] == 2 and p.chosen.count(2) == 1 and p.rejected == []
        assert tok.decode(p.prompt + p.chosen) == "<s>" + FOX + "</s>"
    assert len(pairs[0].chosen) == 10  # 9 text tokens + EOS
    cut, _ = tokenize_rows(rows[:1], tok, DataConfig(max_length=4))
    assert len(cut[0].prompt + cut[0].chosen) == 4


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_text_rows_end_with_one_eos_when_the_tokenizer_appends_one(source):
    """A tokenizer whose post-processor appends EOS (tokenizer.json, GGUF add_eos_token): the text row took the
    tokenizer's EOS and then dtrain's, so every text row trained '</s></s>'."""
    from test_data_terminators import variant

    tok = variant("chatml", source, "bos+eos")
    rows, _ = rows_of([{"text": "hello world"}])
    (p,), _ = tokenize_rows(rows, tok, DataConfig())
    assert (p.prompt, p.chosen) == ([1], [262, 386, 382, 2])
    (p,), _ = tokenize_rows(rows, tok, DataConfig(append_eos=False))
    assert (p.prompt, p.chosen) == ([1], [262, 386, 382])


def test_text_rows_with_no_room_are_dropped_as_no_room(tok):
    rows, _ = rows_of([{"text": FOX}, {"text": "hello world"}])
    cfg = DataConfig(max_length=1, max_prompt_length=1)
    pairs, report = tokenize_rows(rows, tok, cfg)
    assert pairs == [] and report.bad == []
    assert report.dropped == [(f"f.jsonl:{n}", "no room: no chosen tokens fit in data.max_length=1 after a 1-token "
                                             "prompt") for n in (1, 2)]
    pairs, report = tokenize_rows(rows, tok, DataConfig(max_length=2, max_prompt_length=1))
    assert [len(p.chosen) for p in pairs] == [1, 1] and report.dropped == []


def test_control_text_in_a_text_row_is_plain_text(tok):
    rows, _ = rows_of([{"text": "a <|im_end|> b"}])
    pairs, report = tokenize_rows(rows, tok, DataConfig())
    assert 4 not in pairs[0].chosen and report.control_text == [("f.jsonl:1", "<|im_end|>")]


@pytest.mark.parametrize("obj, why", [
    ({"messages": [{"role": "user", "content": Q}]}, "'messages' must end with an assistant message"),
    ({"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": " "}]}, "empty response"),
    ({"prompt": Q, "completion": ""}, "empty response in 'completion'"),
    ({"prompt": Q, "completion": 4}, "field 'completion' must be a string"),
    ({"text": ""}, "empty response in 'text'"),
])
def test_bad_rows_are_reported_with_file_and_line(obj, why):
    fmt = detect_format(obj, None)
    good = {"messages": {"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]},
            "prompt_completion": {"prompt": Q, "completion": "4"}, "text": {"text": FOX}}[fmt]
    rows, report = rows_of([good, obj], fmt)
    assert len(rows) == 1
    assert [s for s, _ in report.bad] == ["f.jsonl:2"] and why in report.bad[0][1]


DEFAULT_SYSTEM = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
                  "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
                  "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER_FIRST = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user "
              "message') }}{% endif %}" + DEFAULT_SYSTEM)
LONE = {"messages": [{"role": "assistant", "content": "4"}]}


@pytest.mark.parametrize("template, prompts", [
    (None, ["<s><|im_start|>assistant\n", "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"]),
    (DEFAULT_SYSTEM, ["<s><|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
                      "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"]),
])
def test_a_lone_assistant_message_trains_with_an_empty_prompt(tmp_path, tok, template, prompts):
    """TRL's SFTTrainer trains a messages row of one assistant turn (refused before: 'no prompt'). Its prompt
    is what the template writes before the reply (a default system message too), never trained."""
    path = tmp_path / "t.jinja"
    path.write_text(template or "")
    rows, report = rows_of([LONE, {**LONE, "system": "Be brief."}])
    assert report.bad == [] and rows[0].prompt == []
    pairs, report = tokenize_rows(rows, tok, DataConfig(chat_template=str(path) if template else None))
    assert report.bad == [] and report.dropped == []
    assert [(tok.decode(p.prompt), tok.decode(p.chosen), p.rejected) for p in pairs] == [
        (prompt, "4<|im_end|>", []) for prompt in prompts]


def test_a_lone_assistant_message_the_template_refuses_is_a_bad_row(tmp_path, tok):
    path = tmp_path / "t.jinja"
    path.write_text(USER_FIRST)
    rows, _ = rows_of([{"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]}, LONE])
    pairs, report = tokenize_rows(rows, tok, DataConfig(chat_template=str(path)))
    assert len(pairs) == 1 and report.bad == [("f.jsonl:2", f"the chat template (data.chat_template {path}) cannot "
                                                            "render this row: Conversations must start with a user "
                                                            "message")]


def test_load_dataset_reads_a_file_of_completions_rows(tmp_path, tok):
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{Q} {i}", "completion": str(i)}) for i in range(10)) + "\n")
    data = load_dataset(DataConfig(train=str(path), valid_fraction=0.2), tok, log=None)
    assert len(data.train) == 8 and len(data.valid) == 2
    assert all(p.rejected == [] and p.chosen[-1] == 4 for p in data.train + data.valid)


def test_sft_trains_the_chosen_side_of_preference_pairs_and_pairwise_objectives_refuse_sft_rows(tok):
    pref, _ = tokenize_rows([Row(Q, "4", "5", source="p.jsonl:1")], tok, DataConfig())
    single, _ = tokenize_rows(rows_of([{"prompt": Q, "completion": "4"}])[0], tok, DataConfig())
    fitted = fit_dataset(SFT(), SimpleNamespace(train=pref, valid=[]))
    assert fitted.train[0].rejected == [] and fitted.train[0].chosen == pref[0].chosen == single[0].chosen
    assert pref[0].rejected != []  # the caller's pairs are unchanged
    for obj in (ORPO(0.1), DPO()):
        with pytest.raises(DataError, match=r"f.jsonl:1: a row with one completion \(no rejected response\) cannot train objective.kind (orpo|dpo); set objective.kind: sft"):
            fit_dataset(obj, SimpleNamespace(train=pref + single, valid=[]))


def mapped(objs, fields):
    return parse_rows([(f"f.jsonl:{i + 1}", o) for i, o in enumerate(objs)], DataConfig(fields=fields), "f.jsonl")


def test_data_fields_maps_sft_columns():
    """An SFT file with its own column names (Alpaca's instruction/output, a 'conversation' list) was refused
    row by row ("missing field 'rejected'"): data.fields mapped preference columns only."""
    msgs = [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]
    rows, report = mapped([{"instruction": Q, "output": "4", "sys": "Be brief.", "input": ""}],
                          {"prompt": "instruction", "completion": "output", "system": "sys"})
    assert rows == [Row(Q, "4", None, "Be brief.", source="f.jsonl:1")] and not report.bad
    rows, _ = mapped([{"conversation": msgs}], {"messages": "conversation"})
    assert rows == [Row(msgs[:1], "4", None, None, source="f.jsonl:1")]
    rows, _ = mapped([{"body": FOX}], {"text": "body"})
    assert rows == [Row(None, FOX, None, None, source="f.jsonl:1")]
    _, report = mapped([{"instruction": Q, "answer": "4"}, {"output": "4"}],
                       {"prompt": "instruction", "completion": "output"})
    assert report.bad == [("f.jsonl:1", "missing field 'output' (data.fields.completion; the row's columns: instruction, answer)"),
                          ("f.jsonl:2", "missing field 'instruction' (data.fields.prompt; the row's columns: output)")]


@pytest.mark.parametrize("fields", [{"chosen": "a", "completion": "b"}, {"messages": "a", "text": "b"}])
def test_data_fields_mapping_a_pair_and_an_sft_row_is_refused(fields):
    with pytest.raises(DataError) as err:
        mapped([{"a": "x", "b": "y"}], fields)
    named = ", ".join(sorted(fields))
    assert str(err.value) == (f"data.fields maps {named}: a row is a preference pair (chosen, rejected) or one SFT "
                              f"completion (completion, messages or text), not both")


def test_message_content_as_text_parts_is_read_as_its_text():
    """OpenAI-style content parts ([{type: text, text: ...}], as multimodal-ready datasets store text) were a bad
    row with a generic message; text parts are read back to back, any other part is named."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    rows, report = rows_of([{"messages": [{"role": "user", "content": parts},
                                          {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]},
                            {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]},
                                          {"role": "assistant", "content": "4"}]},
                            {"messages": [{"role": "user", "content": ["2 + 2?"]},
                                          {"role": "assistant", "content": "4"}]}])
    assert rows == [Row([{"role": "user", "content": Q}], "4", None, None, source="f.jsonl:1")]
    assert report.bad == [("f.jsonl:2", "messages[0] content[0] is not a text part ('image'); dtrain trains on text only"),
                          ("f.jsonl:3", "messages[0] content[0] is not a text part ('string'); dtrain trains on text only")]


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_a_message_with_a_separate_reasoning_field_is_a_bad_row(key):
    """Reasoning datasets keep the model's reasoning beside its answer (Qwen3's template writes it as a <think>
    block); dtrain dropped it without a word and trained the answer alone. An empty one is no reasoning."""
    rows, report = rows_of([{"messages": [{"role": "user", "content": Q},
                                          {"role": "assistant", "content": "4", key: "2 and 2 make 4."}]},
                            {"messages": [{"role": "user", "content": Q},
                                          {"role": "assistant", "content": "4", key: ""}]}])
    assert [r.source for r in rows] == ["f.jsonl:2"]
    assert report.bad == [("f.jsonl:1", f"messages[1] {key!r}: messages with a separate reasoning field are not read "
                           "(dtrain renders the messages' role and content only); write the reasoning into 'content' "
                           "as the model's chat template would")]


def test_data_fields_maps_one_column_of_an_sft_row():
    """An SFT row whose other columns have their own names ({instruction, completion}, mlx-lm's prompt_feature
    alone; a system column beside messages) read as a pair with its 'chosen' missing."""
    msgs = [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]
    rows, report = mapped([{"instruction": Q, "completion": "4"}], {"prompt": "instruction"})
    assert rows == [Row(Q, "4", None, None, source="f.jsonl:1")] and not report.bad
    rows, report = mapped([{"messages": msgs, "sys": "Be brief."}], {"system": "sys"})
    assert rows == [Row(msgs[:1], "4", None, "Be brief.", source="f.jsonl:1")] and not report.bad


# Preference rows whose rejected side breaks a pairwise rule; SFT trains their chosen side only.
PAIRWISE_ONLY = [
    {"prompt": Q, "chosen": "4", "rejected": "4"},  # same text
    {"prompt": Q, "chosen": FOX + " yes", "rejected": FOX + " no"},  # same ids once cut to max_length
    {"prompt": Q, "chosen": "4", "rejected": ""},  # an empty rejected side
    {"prompt": Q, "chosen": "4"},  # no rejected side
    {"prompt": Q, "chosen": "4", "rejected": "5"},
]
CUT = DataConfig(max_length=23, max_prompt_length=20, valid_fraction=0.0)  # the 18-token prompt + 5 response tokens


def write_rows(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def test_sft_keeps_preference_rows_that_only_a_pairwise_objective_drops(tmp_path, tok):
    """Under objective.kind sft a file of preference rows with identical sides ended with no rows to train
    ('no usable training pairs'): the pairwise rules (same text, same ids, an empty or missing rejected side)
    cost rows whose rejected side is never trained. SFT keeps them, trained as their chosen side alone."""
    cfg = dataclasses.replace(CUT, train=write_rows(tmp_path / "p.jsonl", PAIRWISE_ONLY))
    pairwise = load_dataset(cfg, tok, log=None)
    src = f"{cfg.train}:"
    assert [p.source for p in pairwise.train] == [src + "5"]
    assert pairwise.report.bad == [(src + "3", "empty response in 'rejected'"), (src + "4", "missing field 'rejected'")]
    assert pairwise.report.dropped == [
        (src + "1", "same text: chosen and rejected are identical"),
        (src + "2", "same ids: chosen and rejected are the same 5 tokens after truncation to data.max_length=23")]
    logged = []
    sft = load_dataset(cfg, tok, log=logged.append, pairwise=False, progress=False)
    assert [p.source for p in sft.train] == [src + str(i) for i in range(1, 6)] and sft.valid == []
    assert logged == ["1 row truncated to data.max_prompt_length / data.max_length"]  # sft's examples are rows
    assert (sft.report.bad, sft.report.dropped, sft.report.truncated) == ([], [], 1)
    completions, _ = tokenize_rows(rows_of([{"prompt": Q, "completion": o["chosen"]} for o in PAIRWISE_ONLY])[0],
                                   tok, CUT)
    assert [(p.prompt, p.chosen, p.rejected, p.rejected_prompt) for p in sft.train] == [
        (p.prompt, p.chosen, [], None) for p in completions]  # each the row's chosen side as a completion row


def sides(fmt, chosen, rejected):
    """One preference row of ``fmt`` whose responses are ``chosen`` and ``rejected`` (None: no rejected key)."""
    user, say = [{"role": "user", "content": Q}], (lambda t: [{"role": "assistant", "content": t}])
    obj = {"standard": lambda: {"prompt": Q, "chosen": chosen, "rejected": rejected},
           "explicit": lambda: {"prompt": user, "chosen": say(chosen), "rejected": say(rejected)},
           "implicit": lambda: {"chosen": user + say(chosen), "rejected": user + say(rejected)},
           "transcript": lambda: {"chosen": f"\n\nHuman: {Q}\n\nAssistant: {chosen}",
                                  "rejected": f"\n\nHuman: {Q}\n\nAssistant: {rejected}"},
           "openai": lambda: {"input": {"messages": user}, "preferred_output": say(chosen),
                              "non_preferred_output": say(rejected)},
           "sharegpt": lambda: {"conversations": [{"from": "human", "value": Q}], "chosen": {"from": "gpt", "value": chosen},
                                "rejected": {"from": "gpt", "value": rejected}}}[fmt]()
    if rejected is None:
        obj = {k: v for k, v in obj.items() if k not in ("rejected", "non_preferred_output")}
    return obj


@pytest.mark.parametrize("fmt", ["standard", "explicit", "implicit", "transcript", "openai", "sharegpt"])
def test_every_preference_format_keeps_its_chosen_side_under_sft(fmt):
    """Identical sides were dropped as 'same text' and an empty or missing rejected side was a bad row under
    objective.kind sft too; a pairwise objective still refuses them as before."""
    fmt_of = {"explicit": "conversational", "implicit": "conversational"}.get(fmt, fmt)
    objs = [sides(fmt, "4", "4"), sides(fmt, "4", ""), sides(fmt, "4", None)]
    items = [(f"f.jsonl:{i + 1}", o) for i, o in enumerate(objs)]
    rows, report = parse_rows(items, DataConfig(format=fmt_of), "f.jsonl")
    assert rows == [] and report.dropped == [("f.jsonl:1", "same text: chosen and rejected are identical")]
    assert [src for src, _ in report.bad] == ["f.jsonl:2", "f.jsonl:3"]
    rows, report = parse_rows(items, DataConfig(format=fmt_of), "f.jsonl", pairwise=False)
    assert (report.bad, report.dropped) == ([], [])
    assert [(r.source, r.chosen, r.rejected, r.rejected_prompt) for r in rows] == [
        (f"f.jsonl:{i}", "4" if fmt != "transcript" else " 4", None, None) for i in (1, 2, 3)]
    assert len({repr(r.prompt) for r in rows}) == 1  # the prompt as the pairwise read finds it


def test_data_fields_under_sft_need_no_rejected_column():
    """A mapped preference row without its rejected column was a bad row under objective.kind sft."""
    items = [("f.jsonl:1", {"q": Q, "good": "4"}), ("f.jsonl:2", {"q": Q, "good": "4", "bad": "4"})]
    cfg = DataConfig(fields={"prompt": "q", "chosen": "good", "rejected": "bad"})
    rows, report = parse_rows(items, cfg, "f.jsonl")
    assert rows == [] and report.bad == [("f.jsonl:1", "missing field 'bad' (data.fields.rejected; the row's "
                                                       "columns: q, good)")]
    rows, report = parse_rows(items, cfg, "f.jsonl", pairwise=False)
    assert rows == [Row(Q, "4", None, source=f"f.jsonl:{i}") for i in (1, 2)] and not report.bad


@pytest.mark.parametrize("fmt", ["auto", "standard"])
def test_data_fields_under_sft_need_no_rejected_column_whatever_the_format(fmt):
    """With data.format standard (not auto) data.fields renamed the row before the SFT read: a mapped row
    without its rejected column was a bad row ("missing field 'bad'") where format auto read it."""
    items = [("f.jsonl:1", {"q": Q, "good": "4"})]
    cfg = DataConfig(format=fmt, fields={"prompt": "q", "chosen": "good", "rejected": "bad"})
    rows, report = parse_rows(items, cfg, "f.jsonl", pairwise=False)
    assert (rows, report.bad) == ([Row(Q, "4", None, source="f.jsonl:1")], [])
    rows, report = parse_rows(items, cfg, "f.jsonl")
    assert rows == [] and report.bad == [("f.jsonl:1", "missing field 'bad' (data.fields.rejected; the row's "
                                                       "columns: q, good)")]


# TRL's unpaired preference rows (KTOTrainer): one completion each, judged desirable (true) or not (false).
KTO = [{"prompt": f"{Q} {i}", "completion": str(i), "label": i % 2 == 0} for i in range(6)]
UNPAIRED = ("{}: unpaired preference rows (KTO-style: prompt, completion and a true/false 'label') cannot train a "
            "pairwise objective (orpo, dpo, simpo), which needs a chosen and a rejected response per prompt; pair "
            "the completions into chosen/rejected rows, or set objective.kind: sft to train the label true ones")


@pytest.mark.parametrize("objs", [KTO, [{"prompt": [{"role": "user", "content": Q}],
                                         "completion": [{"role": "assistant", "content": "4"}], "label": False}]])
def test_unpaired_kto_rows_are_refused_by_a_pairwise_objective(tmp_path, tok, objs):
    """KTO rows read as prompt/completion SFT rows with 'label' ignored: a pairwise objective named 'a row with one
    completion', sft trained the undesirable completions too."""
    cfg = DataConfig(train=write_rows(tmp_path / "kto.jsonl", objs))
    with pytest.raises(DataError) as err:
        load_dataset(cfg, tok, log=None)
    assert str(err.value) == UNPAIRED.format(f"{cfg.train}:1")
    with pytest.raises(DataError) as err:
        check_file(cfg.train, cfg, tok, objective="dpo")
    assert str(err.value) == UNPAIRED.format(f"{cfg.train}:1")


def test_sft_drops_kto_rows_labelled_false_and_counts_them(tmp_path, tok):
    cfg = DataConfig(train=write_rows(tmp_path / "kto.jsonl", KTO), valid_fraction=0.0)
    logged = []
    data = load_dataset(cfg, tok, log=logged.append, pairwise=False)
    src = f"{cfg.train}:"
    assert [p.source for p in data.train] == [src + str(i) for i in (1, 3, 5)]
    why = "label false: an undesirable completion (KTO-style row); sft trains the label true ones"
    assert data.report.dropped == [(src + str(i), why) for i in (2, 4, 6)] and data.report.bad == []
    assert logged[0].splitlines()[:2] == ["3 of 6 rows dropped (3 label false):", f"  {src}2: {why}"]
    out, _, _ = check_file(cfg.train, cfg, tok, objective="sft")
    assert out.splitlines()[:2] == [f"{cfg.train}: 6 rows, 3 usable, 0 bad, 3 dropped",
                                    "3 of 6 rows dropped (3 label false):"]


def test_a_file_of_kto_rows_all_labelled_false_names_why_none_is_left(tmp_path, tok):
    """The error said the 3 rows were dropped for 'no preference signal or no room'; they were labelled false."""
    cfg = DataConfig(train=write_rows(tmp_path / "kto.jsonl", KTO[1::2]), valid_fraction=0.0)
    with pytest.raises(DataError) as err:
        load_dataset(cfg, tok, log=None, pairwise=False)
    # sft's examples are rows, as its run and `data check` call them
    assert str(err.value) == f"no usable training rows in {cfg.train} (0 bad rows, 3 dropped: 3 label false)"


@pytest.mark.parametrize("label, shown", [("false", "'false'"), ("True", "'True'"), (0, "0"), (1.0, "1.0"),
                                          (None, "null")])
def test_a_kto_label_written_as_text_or_a_number_is_a_bad_row(tmp_path, tok, label, shown):
    """A label written "false" or 0 was not a boolean, so the row read as a plain prompt/completion row: sft
    trained the undesirable completion, said nowhere; a pairwise objective said only 'a row with one completion'.
    So was a label written null (a KTO file's missing label, as Parquet keeps it): sft trained the row."""
    objs = [*KTO, {"prompt": Q, "completion": "4", "label": label}]
    cfg = DataConfig(train=write_rows(tmp_path / "kto.jsonl", objs), valid_fraction=0.0)
    data = load_dataset(cfg, tok, log=None, pairwise=False)
    assert [p.source for p in data.train] == [f"{cfg.train}:{i}" for i in (1, 3, 5)]
    assert data.report.bad == [(f"{cfg.train}:7", f"'label' is {shown}, not true or false: an unpaired (KTO-style) "
                                                 f"row's label is a JSON boolean")]
    with pytest.raises(DataError) as err:
        load_dataset(dataclasses.replace(cfg, train=write_rows(tmp_path / "one.jsonl", objs[-1:])), tok, log=None)
    assert str(err.value) == UNPAIRED.format(f"{tmp_path / 'one.jsonl'}:1")


def test_a_label_that_is_no_truth_value_is_another_column(tok):
    rows, report = rows_of([{"prompt": Q, "completion": "4", "label": "arithmetic"}])
    assert report.bad == [] and [r.chosen for r in rows] == ["4"]


@pytest.mark.parametrize("conv, why", [
    ([{"role": "assistant", "content": "4"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "4"}], None),
    ([{"role": "user", "content": Q}], "empty response in 'chosen': no assistant message after the shared prompt"),
    ([{"role": "user", "content": Q}, {"role": "assistant", "content": " "}], "empty response in 'chosen'"),
])
def test_a_mapped_chosen_message_list_under_sft_reads_as_a_messages_row(tok, conv, why):
    """A mapped row whose chosen column holds the whole conversation and that has no rejected column: a lone
    assistant message (which a messages row trains) was a bad row, and a chosen side at fault was reported as
    "missing field 'rejected'", which sft does not need."""
    as_messages, _ = rows_of([{"messages": conv}])
    items = [("f.jsonl:1", {"conv": conv}), ("f.jsonl:2", {"chosen": conv, "rejected": [
        {"role": "assistant", "content": "5"}]})]  # unmapped, its rejected side sharing no prompt
    for cfg, item in ((DataConfig(fields={"chosen": "conv"}), items[0]), (DataConfig(), items[1])):
        rows, report = parse_rows([item], cfg, "f.jsonl", pairwise=False)
        if why is None:
            assert rows == [dataclasses.replace(as_messages[0], source=item[0])] and report.bad == []
        else:
            assert rows == [] and report.bad == [(item[0], why)]
    if why is None:
        single, _ = tokenize_rows(rows, tok, DataConfig())
        expected, _ = tokenize_rows(as_messages, tok, DataConfig())
        assert [(p.prompt, p.chosen) for p in single] == [(p.prompt, p.chosen) for p in expected]


def test_sharegpt_conversations_rows_read_as_messages_rows():
    """ShareGPT SFT rows, ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` (TRL's
    SFTTrainer reads them: maybe_convert_to_chatml), were 'unknown row format' with hints that led nowhere
    (``data.fields {messages: conversations}``: "messages[0] must be an object with string 'role' and 'content'";
    ``data.format sharegpt``: "missing field 'chosen'"), and a file of one such row 'one JSON object holding 3
    rows under 'conversations''. They are messages rows, speakers named as in ShareGPT preference rows."""
    conv = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": Q}, {"from": "gpt", "value": "4"}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q},
            {"role": "assistant", "content": "4"}]
    assert detect_format({"conversations": conv}, None) == "messages"
    rows, report = rows_of([{"conversations": conv, "id": "x1"}])
    expected, _ = rows_of([{"messages": msgs}])
    assert report.bad == [] and rows == expected
    bad = [{"conversations": conv[:2]}, {"conversations": [conv[1], {"from": "tool", "value": "42"}, conv[2]]}]
    rows, report = rows_of([{"conversations": conv}, *bad])
    assert len(rows) == 1 and report.bad == [
        ("f.jsonl:2", "'conversations' must end with an assistant message (the completion)"),
        ("f.jsonl:3", "conversations[1]: unknown speaker 'tool' (known: human, user, gpt, assistant, chatgpt, model, "
                      "system)")]


def test_a_text_side_beside_messages_is_one_turn_as_in_preference_rows():
    """``{"prompt": "Q", "chosen": [assistant], "rejected": [assistant]}`` trains, but the row TRL's
    unpair_preference_dataset makes of it, ``{"prompt": "Q", "completion": [assistant], "label": true}``, was
    "field 'prompt' must be a list of messages, got string"; so was a text completion (or chosen) beside prompt
    messages. The text side is one turn: a prompt the user's, a response the assistant's."""
    u, a = {"role": "user", "content": Q}, {"role": "assistant", "content": "4"}
    expected, _ = rows_of([{"prompt": [u], "completion": [a]}])
    for obj in ({"prompt": Q, "completion": [a], "label": True}, {"prompt": Q, "completion": [a]},
                {"prompt": [u], "completion": "4"}, {"prompt": [u], "chosen": "4", "rejected": "5"}):
        rows, report = parse_rows([("f.jsonl:1", obj)], DataConfig(), "f.jsonl", pairwise=False)
        assert report.bad == [] and rows == expected, obj
    rows, report = parse_rows([("f.jsonl:1", {"prompt": [u], "chosen": "4", "rejected": "5"})], DataConfig(), "f.jsonl")
    assert report.bad == [] and (rows[0].prompt, rows[0].chosen, rows[0].rejected) == ([u], "4", "5")


def test_data_fields_naming_a_sharegpt_column_as_messages_reads_its_turns():
    """``data.fields: {messages: conversations}`` on ShareGPT rows (the mapping an earlier hint led to, and the
    one a column of another name needs: ``{messages: dialog}``) made every row bad: "messages[0] must be an object
    with string 'role' and 'content'". ``{from, value}`` turns are read as in a ``conversations`` column."""
    conv = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": Q}, {"from": "gpt", "value": "4"}]
    expected, _ = rows_of([{"conversations": conv}])
    for column in ("conversations", "dialog"):
        rows, report = parse_rows([("f.jsonl:1", {column: conv})], DataConfig(fields={"messages": column}), "f.jsonl")
        assert report.bad == [] and rows == expected, column
    rows, report = parse_rows([("f.jsonl:1", {"dialog": [conv[1], {"from": "gpt"}]})],
                              DataConfig(fields={"messages": "dialog"}), "f.jsonl")
    assert report.bad == [("f.jsonl:1", "messages[1] must be an object with string 'from' and 'value'")]


def test_openai_message_weights_train_no_assistant_message_of_weight_0():
    """OpenAI's fine-tuning rows mark an assistant message not to train on with ``"weight": 0``; dtrain dropped
    the key, so a messages row whose last assistant message had weight 0 trained exactly that message. A messages
    row trains its last assistant message of another weight (what follows it is not trained either way); a
    response of weight 0 in a row whose responses are all trained is a bad row, as is a weight not 0 or 1."""
    s, u, u2 = {"role": "system", "content": "S"}, {"role": "user", "content": Q}, {"role": "user", "content": "Sure?"}
    a, a2 = {"role": "assistant", "content": "4"}, {"role": "assistant", "content": "Yes."}
    w0, w1 = {"weight": 0}, {"weight": 1}
    for msgs, expected in (([u, {**a, **w1}, u2, {**a2, **w0}], [u, a]),
                           ([s, u, {**a, **w0}, u2, {**a2, **w1}], [s, u, a, u2, a2]),
                           ([u, {**a, "weight": None}], [u, a])):  # null: no weight (Parquet's missing key)
        rows, report = rows_of([{"messages": msgs}])
        want, _ = rows_of([{"messages": expected}])
        assert report.bad == [] and rows == want, msgs
    trained = ("has weight 0 (OpenAI's mark for a message not trained on), and a response is trained: remove the "
               "message or its weight")
    for obj, why in (({"messages": [u, {**a, **w0}]}, "'messages' has no assistant message to train on: every one "
                                                      "has weight 0 (OpenAI's mark for a message not trained on)"),
                     ({"messages": [u, {**a, "weight": 0.5}]},
                      "messages[1] 'weight' is 0.5: OpenAI's weight is 0 (not trained on) or 1"),
                     ({"messages": [u, {**a, "weight": "0"}]},
                      "messages[1] 'weight' is '0': OpenAI's weight is 0 (not trained on) or 1"),
                     ({"prompt": [u], "completion": [{**a, **w0}]}, f"'completion' holds a message that {trained}"),
                     ({"prompt": [u], "chosen": [{**a, **w0}], "rejected": [a2]},
                      f"'chosen' holds a message that {trained}")):
        rows, report = rows_of([obj])
        assert rows == [] and report.bad == [("f.jsonl:1", why)]
    rows, report = parse_rows([("f.jsonl:1", {"prompt": [u], "chosen": [a], "rejected": [{**a2, **w0}]})], DataConfig(),
                              "f.jsonl")
    assert rows == [] and report.bad == [("f.jsonl:1", f"'rejected' holds a message that {trained}")]


def test_sharegpt_turns_carry_openai_weights_as_role_content_messages_do():
    """A ``{from, value}`` turn with ``"weight": 0`` (in ``conversations``, under a mapped messages column, or as a
    ShareGPT pair's response) lost its weight as it was read, so a row whose last gpt turn had weight 0 trained
    exactly that turn; the weight is read as on a ``{role, content}`` message."""
    h, g, h2 = {"from": "human", "value": Q}, {"from": "gpt", "value": "4"}, {"from": "human", "value": "Sure?"}
    g2 = {"from": "gpt", "value": "Yes."}
    want, _ = rows_of([{"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}]}])
    conv = [h, g, h2, {**g2, "weight": 0}]
    rows, report = rows_of([{"conversations": conv}])
    assert report.bad == [] and rows == want
    rows, report = parse_rows([("f.jsonl:1", {"dialog": conv})], DataConfig(fields={"messages": "dialog"}), "f.jsonl")
    assert report.bad == [] and rows == want
    for obj, why in (({"conversations": [h, {**g, "weight": "0"}]},
                      "conversations[1] 'weight' is '0': OpenAI's weight is 0 (not trained on) or 1"),
                     ({"conversations": [h], "chosen": {**g, "weight": 0}, "rejected": g2},
                      "'chosen' holds a message that has weight 0 (OpenAI's mark for a message not trained on), and "
                      "a response is trained: remove the message or its weight")):
        rows, report = rows_of([obj])
        assert rows == [] and report.bad == [("f.jsonl:1", why)], obj


def test_a_transcript_prompt_of_a_prompt_completion_row_is_read_as_its_turns(tok):
    """An HH prompt apart (``"\\n\\nHuman: ...\\n\\nAssistant:"``) is its turns in a preference row, so sft trained
    ``{prompt: HH, chosen: ' 4', ...}`` after 'user\\nWhat is 2 + 2?'; the same prompt in a prompt/completion row
    (or Dahoas/full-hh-rlhf mapped with data.fields {completion: response}) was one user turn holding the markers
    ('<|im_start|>user\\n\\n\\nHuman: What is 2 + 2?\\n\\nAssistant:<|im_end|>') and ' 4' trained with its space."""
    hh = f"\n\nHuman: {Q}\n\nAssistant:"
    expected, _ = tokenize_rows(rows_of([{"prompt": hh, "chosen": " 4", "rejected": " 5"}])[0], tok, DataConfig())
    for obj, cfg in (({"prompt": hh, "completion": " 4"}, DataConfig()),
                     ({"prompt": hh, "response": " 4", "chosen": " 4", "rejected": " 5"},
                      DataConfig(fields={"completion": "response"}))):
        rows, report = parse_rows([("f.jsonl:1", obj)], cfg, "f.jsonl", pairwise=False)
        pairs, _ = tokenize_rows(rows, tok, cfg)
        assert report.bad == [] and [(p.prompt, p.chosen) for p in pairs] == [(p.prompt, p.chosen) for p in expected]
        assert tok.decode(pairs[0].prompt) == CHAT_Q
    rows, report = rows_of([{"prompt": hh, "completion": " 4\n\nHuman: Sure?"}])
    assert report.bad == [("f.jsonl:1", "'completion' ends with a 'Human:' turn: a response is the model's turn, and "
                                        "that turn would be trained as its words")]
