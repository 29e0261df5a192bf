"""`dtrain data check`: dropped kinds with file:line, --show, the on_bad_row error line,
non-JSON files, data.fields syntax, data.chat_template on a base model."""

from __future__ import annotations

import dataclasses
import json

import pytest
from chat_fixtures import style_tokenizer
from fixtures_launch import make_model_folder

from dtrain.cli import main
from dtrain.config import DataConfig, load_config
from dtrain.data import check_file, load_dataset, load_rows, tokenize_rows
from dtrain.errors import ConfigError, DataError
from dtrain.types import Row

STEPS = "The answer has many steps. " * 20
ROWS = [
    {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
    {"prompt": "Explain.", "chosen": STEPS + "Finally: good.", "rejected": STEPS + "Finally: bad."},
    {"prompt": "Hi", "chosen": "<|im_end|>", "rejected": "No"},
    {"prompt": "word " * 100, "chosen": "ok", "rejected": "no", "system": "You are terse."},
    {"prompt": "Q", "chosen": "a"},
    {"prompt": "Hello there my friend. " * 3, "chosen": "Paris", "rejected": "no"},
    {"prompt": "", "chosen": "Yes", "rejected": "No"},
]


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return str(path)


def test_check_reports_every_dropped_kind_with_line_and_reason(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    out, n_bad, _ = check_file(path, DataConfig(max_length=80, max_prompt_length=27), tokenizer)
    lines = out.splitlines()
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    hello, explain = (len(tokenizer.encode(chat.format(ROWS[i]["prompt"]))) for i in (5, 1))
    assert (hello, explain) == (63, 17)  # 63 > 27, and 63 + 3 response tokens fit max_length=80
    assert lines[:11] == [
        f"{path}: 7 rows, 3 usable, 1 bad, 3 dropped",
        "1 of 7 rows skipped (bad rows):",
        f"  {path}:5: missing field 'rejected'",
        "3 of 7 rows dropped (1 same ids, 1 empty response, 1 prompt too long):",
        f"  {path}:2: same ids: chosen and rejected are the same 63 tokens after truncation to data.max_length=80",
        f"  {path}:3: empty response: 'chosen' has no text besides end-of-turn marks",
        f"  {path}:4: prompt too long: the system message and the template's structure need 28 tokens; "
        "data.max_prompt_length=27",
        "1 pair truncated to data.max_prompt_length / data.max_length",
        "1 of them had the prompt cut to data.max_prompt_length although prompt + response fit data.max_length "
        "(raise data.max_prompt_length to keep them whole)",
        "token lengths (untruncated, 4 pairs): min / median / p95 / max",
        "  prompt   9 / 17 / 63 / 63",  # rows 1, 2, 6, 7 (an empty prompt is a user turn here)
    ]
    assert lines[-2:] == ["limits: max_prompt_length=27, max_length=80: 1 pair truncated, "
                          "1 of them only because of max_prompt_length",
                          f"held out by data.valid_fraction 0.1: {path}:4; none is usable"]  # training would stop
    assert n_bad == 1


def test_check_empty_prompt_and_same_ids_transcript(tmp_path, tokenizer):
    raw = write_jsonl(tmp_path / "raw.jsonl", [ROWS[0], ROWS[6]])
    out, _, _ = check_file(raw, DataConfig(prompt_template="raw"), make_no_bos())
    assert f"  {raw}:2: empty prompt: no prompt tokens before the response (add a prompt, or a BOS token)" in out
    hh = write_jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "\n\nHuman: hi\n\nAssistant: Yes", "rejected": "\n\nHuman: hi\n\nAssistant: No"},
        {"chosen": "\n\nHuman: hi\n\nAssistant: Yes", "rejected": "\n\nHuman: hi\n\nAssistant:  Yes"}])
    out, _, _ = check_file(hh, DataConfig(), tokenizer)
    assert out.splitlines()[:3] == [f"{hh}: 2 rows, 1 usable, 0 bad, 1 dropped", "1 of 2 rows dropped (1 same ids):",
                                    f"  {hh}:2: same ids: chosen and rejected are the same 4 tokens after rendering"]


def make_no_bos():
    from conftest import make_tokenizer

    return make_tokenizer(add_bos=False)


def test_show_prints_pairs_as_trained(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {**ROWS[0], "chosen": "Yes<|im_end|>"}, ROWS[5]])
    out, _, _ = check_file(path, DataConfig(), tokenizer, show=2)
    shown = out.splitlines()[-14:]
    assert shown == [
        f"pair 1: {path}:1  (prompt ends after token 18; responses follow it)",
        '  prompt      18 tokens  "<s><|im_start|>user\\nWhat is 2 + 2?<|im_end|>\\n<|im_start|>assistant\\n"',
        f"            ids {tokenizer.encode('<|im_start|>user' + chr(10) + 'What is 2 + 2?<|im_end|>' + chr(10) + '<|im_start|>assistant' + chr(10))}",
        '  chosen       2 tokens  "4<|im_end|>"',
        "            ids [24, 4]",
        '  rejected     2 tokens  "5<|im_end|>"',
        "            ids [25, 4]",
        f"pair 2: {path}:2  (prompt ends after token 18; responses follow it)",
        shown[8], shown[9],
        f'  chosen       {len(tokenizer.encode("Yes", add_special_tokens=False)) + 1} tokens  "Yes<|im_end|>"',
        f"            ids {tokenizer.encode('Yes', add_special_tokens=False) + [4]}",
        '  rejected     2 tokens  "5<|im_end|>"', "            ids [25, 4]"]
    assert "pair 3" not in out


@pytest.mark.parametrize("row", [{"prompt": "What is 2 + 2?", "completion": "4"}, ROWS[0]], ids=["sft", "pair"])
def test_check_under_sft_shows_the_chosen_side_only(tmp_path, tokenizer, row):
    """SFT rows have one completion: the report listed 'rejected 0 / 0 / 0 / 0' and each shown pair an empty
    'rejected 0 tokens'; SFT trains the chosen side of preference rows (engine.sft.fit_dataset), and the
    report showed their rejected side too, as if trained."""
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    out, _, _ = check_file(path, DataConfig(), tokenizer, show=1, objective="sft")
    lines = out.splitlines()
    assert lines[1:4] == ["token lengths (untruncated, 1 row): min / median / p95 / max",  # sft's are rows
                          "  prompt   18 / 18 / 18 / 18", "  chosen   2 / 2 / 2 / 2"]
    assert lines[4].endswith(": 0 rows truncated, 0 of them only because of max_prompt_length")
    assert lines[5].startswith(f"row 1: {path}:1  (prompt ends after token 18")
    assert lines[-2:] == ['  chosen       2 tokens  "4<|im_end|>"', "            ids [24, 4]"]
    assert "rejected" not in out


# -- command line ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("model"))


def test_cli_show_and_on_bad_row_error_line(tmp_path, model_dir, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1] + ROWS[4:5])
    status = main(["data", "check", path, "--model.path", str(model_dir), "--show", "1", "--train.global_batch_pairs",
                   "1"])
    out = capsys.readouterr()
    errors = lambda err: [line for line in err.splitlines() if line.startswith("dtrain: error:")]  # noqa: E731
    assert status == 0 and "pair 1: " in out.out and errors(out.err) == []
    status = main(["data", "check", path, "--model.path", str(model_dir), "--data.on_bad_row", "error"])
    out = capsys.readouterr()
    assert status == 1 and f"  {path}:2: missing field 'rejected'" in out.out
    assert errors(out.err) == [f"dtrain: error: {path}: 1 bad row(s) and data.on_bad_row is 'error' "
                               "(training would stop; see the rows listed above)"]


@pytest.mark.parametrize("override", [["--data.train", "other.jsonl"], ["--data.demo_pairs=600"]])
def test_cli_data_keys_the_file_replaces_are_refused(tmp_path, model_dir, override, capsys):
    """`dtrain data check a.jsonl --data.train b.jsonl` checked a.jsonl, and --data.demo_pairs 600 checked the file,
    each override dropped without a word: FILE is the data the check reads."""
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    assert main(["data", "check", path, "--model.path", str(model_dir), *override]) == 2
    key = override[0].split("=")[0]
    assert capsys.readouterr().err == (f"dtrain: error: data check: {key} is not read: FILE ({path}) is the data it "
                                       f"checks; remove {key}\n")
    # the values the check reads anyway pass (configs/demo.yaml's advice: --data.demo_pairs 0 to train on a file)
    assert main(["data", "check", path, "--model.path", str(model_dir), "--data.demo_pairs", "0", "--data.train",
                 path, "--train.global_batch_pairs", "1", "--data.valid_fraction", "0"]) == 0


def test_cli_fewer_training_pairs_than_a_step_fails_as_training_fails(tmp_path, model_dir, capsys):
    """Three usable pairs, two after the held-out split, and train.global_batch_pairs 8: training stops
    (sampler.for_run), and the check said nothing and exited 0; it exits 1, as where training stops on bad rows."""
    path = write_jsonl(tmp_path / "d.jsonl", [{**ROWS[0], "prompt": f"What is {i} + 2?"} for i in range(3)])
    status = main(["data", "check", path, "--model.path", str(model_dir)])
    out = capsys.readouterr()
    assert status == 1 and f"{path}: 3 rows, 3 usable, 0 bad, 0 dropped" in out.out
    assert [line for line in out.err.splitlines() if line.startswith("dtrain: error:")] == [
        f"dtrain: error: train.global_batch_pairs is 8 but {path} has 2 training pair(s) (after the held-out split, "
        f"data.valid_fraction=0.1); a step would train a pair more than once: set train.global_batch_pairs to at "
        f"most 2, or add data (training would stop)"]
    assert main(["data", "check", path, "--model.path", str(model_dir), "--train.global_batch_pairs", "2"]) == 0


def test_cli_keep_best_without_held_out_pairs_fails_as_training_fails(tmp_path, model_dir, capsys):
    """One pair: data.valid_fraction holds out none, so train.keep_best has nothing to choose by and training
    stops (run.held_out.held_out_steering); the check exited 0. With data.valid set it passes (pairs held out)."""
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    args = ["data", "check", path, "--model.path", str(model_dir), "--train.global_batch_pairs", "1",
            "--train.keep_best", "eval/loss", "--train.eval_every", "1"]
    status = main(args)
    out = capsys.readouterr()
    assert status == 1 and f"{path}: 1 rows, 1 usable, 0 bad, 0 dropped" in out.out
    assert [line for line in out.err.splitlines() if line.startswith("dtrain: error:")] == [
        "dtrain: error: train.keep_best needs held-out pairs, and this run has none: data.valid_fraction 0.1 of 1 "
        "pairs gives none (it holds out whole prompts, one kept to train on): set data.valid or add pairs of other "
        "prompts (or turn it off) (training would stop)"]
    assert main(args + ["--data.valid", path]) == 0


def test_cli_no_usable_pair_fails_as_training_fails(tmp_path, model_dir, capsys):
    # every row lacks the mapped field: training stops ("no usable training pairs"), so the check
    # must not exit 0 (it did, printing "0 usable")
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "Hi?", "good": "Yes", "bad": "No"}] * 2)
    status = main(["data", "check", path, "--model.path", str(model_dir), "--data.fields",
                   "{prompt: q, chosen: good, rejected: bda}"])
    out = capsys.readouterr()
    assert status == 1 and f"  {path}:2: missing field 'bda' (data.fields.rejected; the row's columns: q, good, bad)" in out.out
    assert [line for line in out.err.splitlines() if line.startswith("dtrain: error:")] == [
        f"dtrain: error: {path}: no usable pairs (training would stop; see the rows listed above)"]


def test_non_json_file_named_clearly(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# dtrain\n\nORPO + LoRA on MLX.\n")
    with pytest.raises(DataError) as err:
        load_rows(str(readme), DataConfig())
    assert str(err.value) == (f"{readme}: not a JSONL file or a JSON array: none of its 2 non-blank lines is JSON "
                              "(1: invalid JSON: Expecting value (column 1))")
    lists = tmp_path / "lists.jsonl"
    lists.write_text('3\n"a"\n')
    with pytest.raises(DataError, match=r"no row is a JSON object \(rows are: number, string\)"):
        load_rows(str(lists), DataConfig())


def test_fields_syntax_in_errors_and_on_the_command_line(tmp_path):
    cfg = load_config(None, ["data.demo_pairs=1", "data.fields={prompt: question, chosen: good, rejected: bad}"])
    assert cfg.data.fields == {"prompt": "question", "chosen": "good", "rejected": "bad"}
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", "data.fields=prompt=question"])
    assert str(err.value) == ("command line: key 'data.fields' must map prompt/chosen/rejected/system (SFT: "
                              "completion/messages/text) to column names, got 'prompt=question'; e.g. --data.fields '{prompt: question, chosen: response_j, "
                              "rejected: response_k}'")
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Q", "answer": "A"}])
    with pytest.raises(DataError, match=r"--data.fields '\{prompt: question, chosen: response_j"):
        load_rows(path, DataConfig())
    with pytest.raises(DataError, match=r"data.fields.chosen: expected a column name, got \['a'\]; e.g. --data"):
        load_rows(path, DataConfig(fields={"chosen": ["a"]}))


# -- data.chat_template on a base model (issue 15) ----------------------------------------------------

MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


def test_base_model_message_rows_need_a_template_or_raw():
    base = style_tokenizer("base")
    with pytest.raises(DataError, match="message rows need a chat template, and the tokenizer has none: set "
                                        "data.chat_template"):
        tokenize_rows([Row(MSGS, "Yes", "No", source="f:1")], base, DataConfig())


def test_base_model_raw_renders_messages_as_plain_text():
    base = style_tokenizer("base")
    pairs, _ = tokenize_rows([Row(MSGS, "Yes", "No")], base, DataConfig(prompt_template="raw"))
    (pair,) = pairs
    assert base.decode(pair.prompt) == "<s>System: Be terse.\n\nUser: Hi\n\nAssistant:"
    assert (base.decode(pair.chosen), base.decode(pair.rejected)) == (" Yes</s>", " No</s>")
    assert pair.prompt + pair.chosen == base.encode("System: Be terse.\n\nUser: Hi\n\nAssistant: Yes") + [1]
    named, _ = tokenize_rows([Row(MSGS, "Yes", "No")], base, DataConfig(chat_template="plain"))
    assert named == pairs  # the same text as the named `plain` template


def test_named_chatml_on_base_model_text_markers_and_eos():
    base = style_tokenizer("base")
    (pair,), _ = tokenize_rows([Row(MSGS, "Yes", "No")], base, DataConfig(chat_template="chatml"))
    assert base.decode(pair.prompt) == "<s><|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                                       "<|im_start|>assistant\n"
    assert base.decode(pair.chosen) == "Yes<|im_end|></s>" and pair.chosen[-1] == 1  # the marker is text here: EOS ends
    whole = base.encode("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\nYes<|im_end|>") + [1]
    assert pair.prompt + pair.chosen == whole


def test_chat_template_text_or_a_name_too_long_is_one_clear_error(tokenizer):
    """The template's text given as data.chat_template (as mlx_lm.server --chat-template takes it) ended in a bare
    OSError traceback, 'File name too long', once longer than a file name may be."""
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}" + "{# a long comment #}" * 20
    for value in (text, text[:60]):
        with pytest.raises(DataError) as err:
            tokenize_rows([Row("Q", "a", "b")], tokenizer, DataConfig(chat_template=value))
        assert str(err.value) == ("data.chat_template: the template's text was given; it takes a template name "
                                  "(chatml, plain) or a Jinja file: save the text to a .jinja file and name it")
    with pytest.raises(DataError) as err:
        tokenize_rows([Row("Q", "a", "b")], tokenizer, DataConfig(chat_template="t" * 300))
    assert str(err.value) == (f"data.chat_template: {'t' * 300!r} is neither a template name (chatml, plain) nor "
                              "a Jinja file")


def test_chat_template_file_overrides_the_models(tmp_path, tokenizer):
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                     "{% if add_generation_prompt %}[assistant]{% endif %}")
    (pair,), _ = tokenize_rows([Row("Hi", "Yes", "No")], tokenizer, DataConfig(chat_template=str(jinja)))
    assert tokenizer.decode(pair.prompt) == "<s>[user] Hi</s>[assistant]"
    assert tokenizer.decode(pair.chosen) == " Yes</s>" and pair.chosen.count(2) == 1
    (same,), _ = tokenize_rows([Row("Hi", "Yes", "No")], tokenizer, DataConfig(chat_template="chatml"))
    (own,), _ = tokenize_rows([Row("Hi", "Yes", "No")], tokenizer, DataConfig())
    assert same == own  # the model's template is ChatML too
    with pytest.raises(DataError) as err:
        tokenize_rows([Row("Hi", "Yes", "No")], tokenizer, DataConfig(chat_template="nope"))
    assert str(err.value) == "data.chat_template: 'nope' is neither a template name (chatml, plain) nor a Jinja file"


def test_check_show_on_base_model_with_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "oa.jsonl", [{"input": {"messages": MSGS}, "preferred_output": [
        {"role": "assistant", "content": "Yes"}], "non_preferred_output": [{"role": "assistant", "content": "No"}]}])
    out, _, _ = check_file(path, DataConfig(chat_template="plain"), style_tokenizer("base"), show=1)
    base = style_tokenizer("base")
    prompt, yes = base.encode("System: Be terse.\n\nUser: Hi\n\nAssistant:"), base.encode(" Yes", add_special_tokens=False)
    assert out.splitlines()[-6:-2] == [
        f"  prompt      {len(prompt)} tokens  \"<s>System: Be terse.\\n\\nUser: Hi\\n\\nAssistant:\"",
        f"            ids {prompt}", f"  chosen       {len(yes) + 1} tokens  \" Yes</s>\"", f"            ids {yes + [1]}"]


def test_check_counts_raw_prompts_glued_to_their_response(tmp_path, tokenizer):
    rows = [
        {"prompt": "Say hi", "chosen": "hi", "rejected": " hello"},  # chosen glued: "Say hihi"
        {"prompt": "Say hi ", "chosen": "hi", "rejected": "hello"},  # space at the prompt's end
        {"prompt": "Say hi\n", "chosen": "hi", "rejected": "yo"},
        {"prompt": "Q:", "chosen": " a", "rejected": "\nb"},  # both responses start with whitespace
        {"prompt": "Add", "chosen": "ed", "rejected": "ing"},
    ]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    out, _, _ = check_file(path, DataConfig(prompt_template="raw"), tokenizer)
    warning = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warning == [f"warning: 2 of 5 rows glue a raw prompt to its response with no whitespace between them "
                       f"(\"Say hi\" + \"hi\" trains \"Say hihi\"), first {path}:1; end the prompts with a space or "
                       "newline, or set data.prompt_template: chat"]
    chat, _, _ = check_file(path, DataConfig(), tokenizer)  # a user turn: the template separates them
    assert "warning:" not in chat
    base, _, _ = check_file(path, DataConfig(), style_tokenizer("base"))  # no template: raw text too
    assert warning[0] in base.splitlines()


@pytest.mark.parametrize("name", ["2024", "null", "yes", "a: b.jsonl", "my #1.jsonl"])
def test_cli_file_is_read_by_its_name_as_given(tmp_path, model_dir, capsys, monkeypatch, name):
    """The positional FILE is data.train as typed: not read as YAML (2024 an int, null none, yes true)."""
    monkeypatch.chdir(tmp_path)  # the bare name, as typed in the folder that holds it
    write_jsonl(tmp_path / name, ROWS[:1])
    status = main(["data", "check", name, "--model.path", str(model_dir), "--train.global_batch_pairs", "1"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out.startswith(f"{name}: 1 rows, 1 usable, 0 bad, 0 dropped")


def test_cli_show_refuses_a_negative_count(tmp_path, model_dir, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    status = main(["data", "check", path, "--model.path", str(model_dir), "--show", "-2"])
    out = capsys.readouterr()
    assert status == 2 and out.out == ""
    assert out.err == "dtrain: error: data check: --show N must be 0 or more (the first N usable pairs); got -2\n"


def test_cli_an_empty_file_argument_is_named_not_the_config(tmp_path, model_dir, capsys):
    """'' as FILE used to read as no data.train, which blamed the config for not setting it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  max_length: 40\n")
    status = main(["data", "check", "", "-c", str(cfg), "--model.path", str(model_dir)])
    out = capsys.readouterr()
    assert status == 2 and out.out == ""
    assert out.err == ("dtrain: error: data check: FILE is empty ('');"
                       " give a data file, folder or hub dataset id\n")


def test_cli_file_with_a_config_of_demo_pairs(tmp_path, model_dir, capsys):
    """FILE replaces the config's data: its demo pairs do not apply, its other data keys do."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  demo_pairs: 8\n  max_length: 40\n")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    status = main(["data", "check", path, "-c", str(cfg), "--model.path", str(model_dir), "--train.global_batch_pairs",
                   "1"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out.startswith(f"{path}: 1 rows, 1 usable") and "max_length=40" in out.out


SFT_ROWS = [{"prompt": "What is 2 + 2?", "completion": "4"}, {"prompt": "Hi", "completion": "Hello"}]


@pytest.mark.parametrize("kind", ["orpo", "dpo", "simpo"])
def test_cli_sft_rows_under_a_pairwise_objective_are_refused_as_training_refuses_them(tmp_path, model_dir, capsys,
                                                                                       kind):
    """`dtrain train` stops on prompt/completion rows under a pairwise objective
    (engine.sft.fit_dataset); data check used to call them usable pairs."""
    path = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    status = main(["data", "check", path, "--model.path", str(model_dir), "--objective.kind", kind])
    out = capsys.readouterr()
    assert status == 2 and out.out == ""
    assert out.err.splitlines()[-1] == (
        f"dtrain: error: {path}:1: a row with one completion (no rejected response) cannot train objective.kind "
        f"{kind}; set objective.kind: sft (configs/sft.yaml), or give preference rows (chosen and rejected)")
    status = main(["data", "check", path, "--model.path", str(model_dir), "--objective.kind", "sft",
                   "--train.global_batch_pairs", "1"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out.startswith(f"{path}: 2 rows, 2 usable, 0 bad, 0 dropped")

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Hi", "completion": ""}])  # an empty completion
    for kind, noun in (("sft", "rows"), ("orpo", "pairs")):
        assert main(["data", "check", bad, "--model.path", str(model_dir), "--objective.kind", kind]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"dtrain: error: {bad}: no usable {noun} (training would stop; see the rows listed above)")


def test_cli_overrides_before_the_file_leave_the_file_to_it(tmp_path, model_dir, capsys):
    """`dtrain data check --data.valid held.jsonl pairs.jsonl` took held.jsonl for FILE and pairs.jsonl for
    data.valid (argparse read the override's value as the positional): it checked the wrong file and exited 0.
    Overrides are taken out first, as ./launch does, wherever they stand."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", ROWS[:1] * 2)
    held = write_jsonl(tmp_path / "held.jsonl", ROWS[:1])
    status = main(["data", "check", "--data.valid", held, "--model.path", str(model_dir), pairs,
                   "--train.global_batch_pairs", "1"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert out.out.startswith(f"{pairs}: 2 rows, 2 usable, 0 bad, 0 dropped")
    assert main(["data", "check", "--data.max_length", "64", pairs, "--model.path", str(model_dir),
                 "--train.global_batch_pairs", "1"]) == 0
    assert "max_length=64" in capsys.readouterr().out


def test_check_under_sft_keeps_preference_rows_a_pairwise_objective_drops(tmp_path, tokenizer):
    """`data check` under objective.kind sft listed preference rows with identical sides (or sides cut to the
    same ids, or an empty or missing rejected side) as dropped or bad, and training dropped them too: SFT
    trains their chosen side. A pairwise objective reports them as before."""
    from test_data_sft import CUT, PAIRWISE_ONLY

    path = write_jsonl(tmp_path / "p.jsonl", PAIRWISE_ONLY)
    out, n_bad, (train, held_out) = check_file(path, CUT, tokenizer)
    assert out.splitlines()[:7] == [
        f"{path}: 5 rows, 1 usable, 2 bad, 2 dropped", "2 of 5 rows skipped (bad rows):",
        f"  {path}:3: empty response in 'rejected'", f"  {path}:4: missing field 'rejected'",
        "2 of 5 rows dropped (1 same text, 1 same ids):", f"  {path}:1: same text: chosen and rejected are identical",
        f"  {path}:2: same ids: chosen and rejected are the same 5 tokens after truncation to data.max_length=23"]
    assert (n_bad, len(train), held_out) == (2, 1, [])
    out, n_bad, (train, held_out) = check_file(path, CUT, tokenizer, objective="sft")
    assert out.splitlines()[:2] == [f"{path}: 5 rows, 5 usable, 0 bad, 0 dropped",  # rows, as the limits line says
                                    "1 row truncated to data.max_prompt_length / data.max_length"]
    assert "limits: max_prompt_length=20, max_length=23: 1 row truncated, 0 of them" in out
    assert (n_bad, [p.source for p in train], held_out) == (0, [f"{path}:{i}" for i in range(1, 6)], [])
    assert all(p.rejected == [] for p in train)


def test_check_names_the_row_training_stops_on_first(tmp_path, tokenizer):
    """Training tokenizes the rows it trains on, then the data.valid_fraction it holds out; the check tokenized
    the file in its order, so where a held-out row came first it named another row than training did: another
    first row for 'message rows need a chat template' on a base model, another first bad row listed under
    data.on_bad_row: error. Generated files (seeded): both name the same row, list the same bad rows in the same
    order, and give the same pairs."""
    import random

    rng = random.Random(5)
    base, differed, stopped = style_tokenizer("base"), 0, 0
    for case in range(10):
        objs = []
        for i in range(rng.randint(4, 14)):
            if rng.random() < 0.35:  # a message row, and two system prompts: bad where a template renders it
                objs.append({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": f"Q{i}"}],
                             "system": "T", "chosen": [{"role": "assistant", "content": f"a{i}"}],
                             "rejected": [{"role": "assistant", "content": "b"}]})
            else:
                objs.append({"prompt": f"Q{i}", "chosen": f"a{i}", "rejected": "b"})
        path = write_jsonl(tmp_path / f"d{case}.jsonl", objs)
        cfg = DataConfig(train=path, fields={"prompt": "prompt"}, valid_fraction=rng.choice([0.2, 0.4]))
        errors = []
        for run in (lambda: load_dataset(cfg, base, seed=case, log=None), lambda: check_file(path, cfg, base, seed=case)):
            with pytest.raises(DataError) as err:
                run()
            errors.append(str(err.value))
        assert errors[0] == errors[1] and "message rows need a chat template" in errors[0]
        first_in_file = next(i for i, o in enumerate(objs) if isinstance(o["prompt"], list)) + 1
        differed += not errors[0].startswith(f"{path}:{first_in_file}:")
        stop = dataclasses.replace(cfg, on_bad_row="error")
        with pytest.raises(DataError) as err:
            load_dataset(stop, tokenizer, seed=case, log=None)
        out, n_bad, _ = check_file(path, stop, tokenizer, seed=case)
        listed, named = [line.strip() for line in out.splitlines() if line.startswith(f"  {path}:")], \
            str(err.value).splitlines()
        assert named[0].startswith(f"{listed[0]} ({n_bad} bad row(s);")
        assert listed[:5] == [line.strip() for line in named[2:7] if not line.startswith("  ... and")]
        _, _, (train, held) = check_file(path, cfg, tokenizer, seed=case)
        if held is None:  # every held-out row bad: both stop
            with pytest.raises(DataError, match="^no usable held-out pairs among the "):
                load_dataset(cfg, tokenizer, seed=case, log=None)
            stopped += 1
            continue
        data = load_dataset(cfg, tokenizer, seed=case, log=None)
        assert (train, held) == (data.train, data.valid) and n_bad == len(data.report.bad)
    assert differed >= 2 and stopped >= 1  # files whose first message row is held out; all held-out rows bad


def test_cli_held_out_source_is_checked_as_training_reads_it(tmp_path, model_dir, capsys):
    """An mlx-lm data folder's valid.jsonl is the run's held-out data, but the check read only train.jsonl:
    with every held-out pair dropped (same text) and train.keep_best on, it exited 0 and training stopped;
    a bad held-out row was listed nowhere. The held-out source is read and reported too."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:1] * 2)
    valid = write_jsonl(folder / "valid.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "a"}, ROWS[4]])
    args = ["data", "check", str(folder), "--model.path", str(model_dir), "--train.global_batch_pairs", "1"]
    assert main(args) == 1  # training stops: held-out rows given, none usable (it exited 0 while training went on)
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("dtrain: error:")] == [
        f"dtrain: error: no usable held-out pairs in {valid} (training would stop; see the rows listed above)"]
    assert out.splitlines()[0] == f"{folder}: 2 rows, 2 usable, 0 bad, 0 dropped"
    assert (f"held out: {valid}: 2 rows, 0 usable, 1 bad, 1 dropped\n"
            "1 of 2 rows skipped (bad rows):\n"
            f"  {valid}:2: missing field 'rejected'\n"
            "1 of 2 rows dropped (1 same text):\n"
            f"  {valid}:1: same text: chosen and rejected are identical") in out
    assert main(args + ["--data.on_bad_row", "error"]) == 1
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("dtrain: error:")] == [
        f"dtrain: error: {folder}: 1 bad row(s) and data.on_bad_row is 'error' "
        "(training would stop; see the rows listed above)"]
    write_jsonl(folder / "valid.jsonl", ROWS[:1])
    assert main(args) == 0


def test_data_check_help_says_it_takes_overrides_and_when_it_exits_1(capsys):
    """`dtrain data check --help` showed only -c and --show: the overrides it takes and its exit statuses
    were in `dtrain data --help` alone."""
    with pytest.raises(SystemExit) as done:
        main(["data", "check", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    assert out.startswith("usage: dtrain data check [-h] [-c CONFIG] [--show N] [--section.key VALUE ...] file")
    # train.* and model.* keys decide the exit status too (global_batch_pairs, keep_best, model.path), not data.* alone
    assert "(overrides: --section.key VALUE, such as --data.fields or --train.global_batch_pairs; exit status 1 " \
           "where training would stop on the data:" in out


def test_cli_stops_on_the_data_in_training_order(tmp_path, model_dir, tokenizer, capsys):
    """Training stops on bad rows under data.on_bad_row: error, and on an unreadable held-out source, before it
    refuses rows with one completion (engine.sft.fit_dataset); the check refused them first, with exit status 2
    and another reason."""
    path = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS + [{"prompt": "Hi", "completion": 5}])
    common = ["--model.path", str(model_dir), "--objective.kind", "dpo", "--train.global_batch_pairs", "1"]
    with pytest.raises(DataError, match="d.jsonl:3: field 'completion' must be a string"):
        load_dataset(DataConfig(train=path, on_bad_row="error"), tokenizer, log=None)
    status = main(["data", "check", path, *common, "--data.on_bad_row", "error"])
    out = capsys.readouterr()
    assert status == 1 and f"  {path}:3: field 'completion' must be a string, got number" in out.out
    assert out.err.splitlines()[-1] == (f"dtrain: error: {path}: 1 bad row(s) and data.on_bad_row is 'error' "
                                        "(training would stop; see the rows listed above)")
    folder = tmp_path / "mlx"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", SFT_ROWS)
    valid = folder / "valid.jsonl"
    valid.write_text("7\n")
    assert main(["data", "check", str(folder), *common]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"dtrain: error: {valid}: no row is a JSON object (rows are: number); expected one object per line in one of "
        "the formats standard, conversational, transcript, openai, sharegpt, mapped, messages, prompt_completion, text")


def test_check_lists_bad_rows_that_stop_training_before_a_template_error(tmp_path):
    """Under data.on_bad_row: error training stops on the rows it cannot read before it tokenizes any; the check
    tokenized first and stopped on 'message rows need a chat template' (exit 2), naming another reason."""
    base = style_tokenizer("base")
    ok = {"prompt": MSGS, "chosen": [{"role": "assistant", "content": "Yes"}],
          "rejected": [{"role": "assistant", "content": "No"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [ok, {**ok, "chosen": 5}])
    cfg = DataConfig(train=path, on_bad_row="error")
    with pytest.raises(DataError, match="d.jsonl:2: field 'chosen' must be a list of messages, got number"):
        load_dataset(cfg, base, log=None)
    out, n_bad, pairs = check_file(path, cfg, base)
    assert out.splitlines() == [
        f"{path}: 2 rows, 1 bad, 0 dropped (not tokenized: {path}:1: message rows need a chat template, and the "
        "tokenizer has none: set data.chat_template (chatml, plain or a Jinja file), or data.prompt_template: raw to "
        "write messages as plain 'User: ...' text)",
        "1 of 2 rows skipped (bad rows):", f"  {path}:2: field 'chosen' must be a list of messages, got number"]
    assert (n_bad, pairs) == (1, ([], []))
    with pytest.raises(DataError, match="message rows need a chat template"):  # skipped, the rows are tokenized
        check_file(path, DataConfig(train=path), base)


def test_responses_the_template_drops_text_from_are_counted_by_check_and_the_run(tmp_path):
    """The count of responses the chat template rendered without some of their text (DeepSeek-R1 drops the
    reasoning before '</think>') is in `data check`'s report and, once, in the run's notices."""
    rows = [{"prompt": "hi", "chosen": "<think>a</think>yes", "rejected": "no"},
            {"prompt": "ok", "chosen": "yes", "rejected": "no"}]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    line = (f"the chat template drops text from the responses of 1 pair, trained as it renders them "
            f"(first: {path}:1: '<think>a</think>')")
    out, _, _ = check_file(path, DataConfig(valid_fraction=0.0), style_tokenizer("deepseek"))
    assert line in out.splitlines()
    notices = []
    load_dataset(DataConfig(train=path, valid_fraction=0.0), style_tokenizer("deepseek"), log=notices.append)
    assert notices == [line]


def test_check_says_how_many_prompts_and_rows_the_split_holds_out_when_prompts_repeat(tmp_path, tokenizer):
    """data.valid_fraction holds out whole prompts (data.split_rows); where prompts repeat, the report says how many
    of them and of the rows it held out, so a held-out share far from the fraction of the rows is explained."""
    import random

    rows = [{"prompt": f"What is {i % 4} + 2?", "chosen": f"{i % 4 + 2}", "rejected": f"{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    out, _, (train, held) = check_file(path, DataConfig(valid_fraction=0.25), tokenizer, seed=0)
    (k,) = random.Random(0).sample(range(4), 1)
    assert [p.source for p in held] == [f"{path}:{i + 1}" for i in range(10) if i % 4 == k]
    assert (f"held out by data.valid_fraction 0.25: 1 of 4 prompts ({len(held)} of 10 rows; rows that share a prompt "
            f"stay on one side)") in out.splitlines()
    out, _, _ = check_file(write_jsonl(tmp_path / "u.jsonl", rows[:4]), DataConfig(valid_fraction=0.25), tokenizer)
    assert "held out by" not in out  # no prompt repeated: the rows, one by one


def test_check_says_the_split_holds_out_none_when_every_row_shares_one_prompt(tmp_path, tokenizer):
    """Rows that all share one prompt (many pairs of one question) leave data.valid_fraction nothing to hold out,
    one prompt kept to train on; the report said how many prompts and rows the split held out only when it held
    out some, so the check said nothing of a run that would have no held-out pairs (its row split held out 1 of
    4)."""
    rows = [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": f"{i}"} for i in range(4)]
    out, _, (train, held) = check_file(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig(valid_fraction=0.25),
                                       tokenizer)
    assert (len(train), held) == (4, [])
    assert ("held out by data.valid_fraction 0.25: 0 of 1 prompts (0 of 4 rows; rows that share a prompt stay on "
            "one side, one prompt kept to train on): no held-out pairs") in out.splitlines()
    out, _, _ = check_file(write_jsonl(tmp_path / "d.jsonl", rows), DataConfig(valid_fraction=0.0), tokenizer)
    assert "held out by" not in out  # none asked for


def test_a_split_whose_held_out_rows_are_all_dropped_stops_training_and_the_check(tmp_path, tokenizer, model_dir,
                                                                                  capsys):
    """data.valid_fraction held out a prompt whose pairs were all dropped (the same ids once cut to max_length):
    the run trained with no evaluation, or with train.keep_best said the fraction "gives none (it holds out whole
    prompts, one kept to train on)", of a file of several prompts. Held-out rows that give no usable pair stop
    training and the check, as a held-out source of its own does."""
    long = "x " * 100
    same = [{"prompt": "Q same", "chosen": long + "a", "rejected": long + "b"}] * 3  # the same ids once cut
    rows = same + [{"prompt": "Q good", "chosen": "a", "rejected": "b"}] * 3
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(train=path, valid_fraction=0.5, max_length=32, max_prompt_length=16)
    seed = next(s for s in range(20) if load_dataset_split(path, cfg, s) == "Q same")
    with pytest.raises(DataError) as err:
        load_dataset(cfg, tokenizer, seed=seed, log=None)
    assert str(err.value) == (f"no usable held-out pairs among the 3 row(s) data.valid_fraction 0.5 held out, {path}:1, "
                              f"{path}:2, {path}:3 (0 bad rows, 3 dropped: 3 same ids): set data.valid, or fix those rows "
                              "(dtrain data check lists them)")
    assert check_file(path, cfg, tokenizer, seed=seed)[2] == (load_dataset(
        dataclasses.replace(cfg, valid_fraction=0.0), tokenizer, log=None).train, None)
    args = ["data", "check", path, "--model.path", str(model_dir), "--data.valid_fraction", "0.5",
            "--data.max_length", "32", "--data.max_prompt_length", "16", "--train.seed", str(seed),
            "--train.global_batch_pairs", "1"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("dtrain: error:")] == [
        "dtrain: error: no usable held-out pairs among the rows data.valid_fraction 0.5 held out (training would stop; "
        "see the rows listed above)"]
    assert f"  {path}:1: same ids: chosen and rejected are the same" in out
    assert f"held out by data.valid_fraction 0.5: {path}:1, {path}:2, {path}:3; none is usable" in out.splitlines()


def load_dataset_split(path: str, cfg, seed: int) -> str:
    """The prompt of the rows ``cfg.valid_fraction`` holds out of ``path`` with ``seed`` (one, here)."""
    from dtrain.data import split_rows

    return split_rows(load_rows(path, cfg)[0], cfg.valid_fraction, seed)[1][0].prompt


def test_name_rows_names_the_first_rows_and_counts_the_rest():
    from dtrain.data import name_rows
    from dtrain.types import Row

    rows = [Row("Q", "a", "b", source=f"d.jsonl:{i}") for i in range(1, 6)]
    assert name_rows(rows[:1]) == "d.jsonl:1"
    assert name_rows(rows) == "d.jsonl:1, d.jsonl:2, d.jsonl:3 and 2 more"


def test_cli_check_of_a_runs_config_renders_the_day_the_run_started(tmp_path, model_dir, monkeypatch, capsys):
    """`dtrain data check` with a run's config showed the pairs rendered with today's date where the template
    writes one (Llama 3.2), not those the run trains, rendered the day it started: it renders the day the
    run's newest checkpoint recorded, or data.template_date."""
    from chat_fixtures import LLAMA32, fake_day

    template = tmp_path / "llama32.jinja"
    template.write_text(LLAMA32)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q {i}?", "chosen": "yes", "rejected": "no"}
                                              for i in range(10)])
    common = ["--model.path", str(model_dir), "--data.chat_template", str(template), "--train.output_dir",
              str(tmp_path / "run")]
    fake_day(monkeypatch, "2026-03-01")
    assert main(["train", "--data.train", path, *common, "--train.steps", "1", "--train.global_batch_pairs", "4",
                 "--train.micro_batch_pairs", "4", "--lora.rank", "2", "--train.progress", "false"]) == 0
    fake_day(monkeypatch, "2026-03-02")
    capsys.readouterr()
    for extra, day in (([], "01 Mar 2026"), (["--data.template_date", "2024-07-26"], "26 Jul 2024")):
        assert main(["data", "check", path, *common, "--show", "1", "--train.global_batch_pairs", "4", *extra]) == 0
        out = capsys.readouterr().out
        assert f"data.chat_template {template} writes the date into every conversation: rendered with {day}" in out
        assert f"Today Date: {day}" in out and "02 Mar 2026" not in out
