"""A corpus of bad inputs through `dtrain train`: each gives one clear message
naming the file, line or key, exits with status 2, never prints a traceback,
and leaves no output behind."""

import json
import os

import pytest

from dtrain.cli import main
from fixtures_launch import make_model_folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("model"))


GOOD = {"prompt": "What is 2 + 2?", "chosen": "ANSWER: 4", "rejected": "It is 5."}


def jsonl(*rows):
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"


# (name, file bytes, expected message fragment); row-level cases run with on_bad_row: error
DATA_CASES = [
    ("truncated_jsonl", jsonl(GOOD, '{"prompt": "x", "chosen": "y"'), ".jsonl:2: invalid JSON"),
    ("truncated_array", json.dumps([GOOD, GOOD])[:-5], "invalid JSON array"),
    ("chosen_number", jsonl(GOOD, {**GOOD, "chosen": 3}), ":2:"),
    ("prompt_int_list", jsonl(GOOD, {**GOOD, "prompt": [1, 2]}), ":2:"),
    ("empty_chosen", jsonl(GOOD, {**GOOD, "chosen": ""}), ":2:"),
    ("whitespace_rejected", jsonl(GOOD, {**GOOD, "rejected": "  \n\t"}), ":2:"),
    ("missing_rejected", jsonl(GOOD, {"prompt": "a", "chosen": "b"}), ":2:"),
    ("null_prompt", jsonl(GOOD, {**GOOD, "prompt": None}), ":2:"),
    ("string_row", jsonl(GOOD, '"just a string"'), ":2:"),
    ("number_row", jsonl(GOOD, "42"), ":2:"),
    ("messages_not_dicts", jsonl(GOOD, {"prompt": ["hi"], "chosen": ["a"], "rejected": ["b"]}), ":2:"),
    ("openai_empty_output", jsonl({"input": {"messages": [{"role": "user", "content": "q"}]},
                                   "preferred_output": [], "non_preferred_output": [{"role": "assistant", "content": "n"}]}), ":1:"),
    ("sharegpt_missing_value", jsonl({"conversations": [{"from": "human"}], "chosen": {"from": "gpt", "value": "a"},
                                      "rejected": {"from": "gpt", "value": "b"}}), ":1:"),
    ("unknown_format", jsonl({"question": "q", "answer": "a"}), "format"),
    ("single_object", json.dumps(GOOD, indent=2), "one JSON object spread over several lines"),
    ("empty_file", "", "file is empty"),
    ("blank_lines_only", "\n\n  \n", "file is empty"),
    ("deep_row", jsonl(GOOD, '{"prompt": ' + "[" * 5000 + "]" * 5000 + ', "chosen": "a", "rejected": "b"}'),
     ".jsonl:2: invalid JSON: nested more than 100 levels deep"),
    ("deep_array", "[" + json.dumps(GOOD) + ", " + "[" * 5000 + "]" * 5000 + "]",
     ".jsonl:1[1]: invalid JSON: nested more than 100 levels deep"),
]
BYTE_CASES = [
    ("invalid_utf8", jsonl(GOOD).encode() + b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n', ":2:"),
    ("huge_line", jsonl(GOOD).encode() + json.dumps({**GOOD, "chosen": "x" * 2_100_000}).encode() + b"\n", ":2: line has"),
]


def run(tmp_path, model_dir, *overrides, config_text=None):
    out = tmp_path / "out"
    args = ["train"]
    if config_text is not None:
        cfg = tmp_path / "job.yaml"
        cfg.write_bytes(config_text if isinstance(config_text, bytes) else config_text.encode())
        args += ["-c", str(cfg)]
    args += ["--model.path", str(model_dir), "--train.output_dir", str(out), "--train.steps", "1",
             "--train.progress", "false", *overrides]
    return main(args), out


def check(capsys, status, out, fragment):
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [l for l in err.splitlines() if l.startswith("dtrain: error:")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err
    assert not out.exists(), "a failed start must leave no output"


@pytest.mark.parametrize("name, text, fragment", DATA_CASES + BYTE_CASES, ids=[c[0] for c in DATA_CASES + BYTE_CASES])
def test_bad_data_file(tmp_path, model_dir, capsys, name, text, fragment):
    data = tmp_path / f"{name}.jsonl"
    data.write_bytes(text if isinstance(text, bytes) else text.encode())
    status, out = run(tmp_path, model_dir, "--data.train", str(data), "--data.on_bad_row", "error")
    check(capsys, status, out, fragment)


def test_directory_and_missing_files(tmp_path, model_dir, capsys):
    status, out = run(tmp_path, model_dir, "--data.train", str(tmp_path))
    check(capsys, status, out, "is a directory")
    status, out = run(tmp_path, model_dir, "--data.train", str(tmp_path / "missing.jsonl"))
    check(capsys, status, out, "not found")
    good = tmp_path / "good.jsonl"
    good.write_text(jsonl(GOOD, {**GOOD, "prompt": "other"}))
    status, out = run(tmp_path, model_dir, "--data.train", str(good), "--data.valid", str(tmp_path / "nope.jsonl"))
    check(capsys, status, out, "nope.jsonl")


CONFIG_CASES = [
    ("unknown_key", "train:\n  stepz: 3\n", "unknown key 'train.stepz'"),
    ("unknown_section", "trainer:\n  steps: 3\n", "unknown section 'trainer'"),
    ("wrong_type", "train:\n  steps: ten\n", "key 'train.steps': expected int"),
    ("bool_for_int", "train:\n  steps: true\n", "key 'train.steps'"),
    ("bad_choice", "engine:\n  kind: fast\n", "key 'engine.kind' must be one of"),
    ("invalid_yaml", "train:\n  steps: [1, 2\n", "invalid YAML"),
    ("top_level_list", "- 1\n- 2\n", "expected a mapping of sections"),
    ("section_not_mapping", "train: 3\n", "section 'train' must be a mapping"),
    ("zero_batch", "train:\n  global_batch_pairs: 0\n", "'train.global_batch_pairs' must be > 0"),
    ("negative_lambda", "orpo:\n  lambda: -1\n", "'orpo.lambda' must be >= 0"),
    ("bad_fraction", "data:\n  valid_fraction: 1.5\n", "'data.valid_fraction' must be in [0, 1)"),
    ("repeated_section", "train:\n  steps: 3\ntrain:\n  seed: 1\n", "line 3: key 'train' repeated (first at line 1)"),
    ("nan_learning_rate", "train:\n  learning_rate: .nan\n", "'train.learning_rate' must be a finite number"),
    ("not_utf8", b"train:\n  output_dir: caf\xe9\n", "not UTF-8"),
]


@pytest.mark.parametrize("name, text, fragment", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config(tmp_path, model_dir, capsys, name, text, fragment):
    data = tmp_path / "good.jsonl"
    data.write_text(jsonl(GOOD))
    status, out = run(tmp_path, model_dir, "--data.train", str(data), config_text=text)
    check(capsys, status, out, fragment)


def test_bad_command_line(tmp_path, model_dir, capsys):
    data = tmp_path / "good.jsonl"
    data.write_text(jsonl(GOOD))
    for extra, fragment in ((["--train.nope", "1"], "unknown key 'train.nope'"),
                            (["--train.steps"], "needs a value"),
                            (["stray"], "unexpected argument 'stray'"),
                            (["--model.dtype", "int8"], "key 'model.dtype' must be one of")):
        status, out = run(tmp_path, model_dir, "--data.train", str(data), *extra)
        check(capsys, status, out, fragment)
    cfg_dir = tmp_path / "cfgdir"
    cfg_dir.mkdir()
    assert main(["train", "-c", str(cfg_dir)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_output_dir_that_is_a_file(tmp_path, model_dir, capsys):
    """train.output_dir on a file (or under one): named with its key, not "not writable: File exists"."""
    data, blocker = tmp_path / "good.jsonl", tmp_path / "notes.txt"
    data.write_text(jsonl(GOOD, {**GOOD, "prompt": "other"}))
    blocker.write_text("x")
    for out, what in ((blocker, "is a file"), (blocker / "run", f"is under {blocker}, a file")):
        status = main(["train", "--model.path", str(model_dir), "--data.train", str(data), "--train.output_dir", str(out),
                       "--train.global_batch_pairs", "1", "--train.steps", "1", "--train.progress", "false"])
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        assert [x for x in err.splitlines() if x.startswith("dtrain: error:")] == [
            f"dtrain: error: train.output_dir {out} {what}, not a folder; choose another train.output_dir"], err
        assert blocker.read_text() == "x"


def test_bad_model_path(tmp_path, capsys):
    data = tmp_path / "good.jsonl"
    data.write_text(jsonl(GOOD))
    status, out = run(tmp_path, tmp_path / "no-model", "--data.train", str(data))
    check(capsys, status, out, "no-model")


@pytest.mark.parametrize("command", ["train", "convert", "export"])
def test_a_path_too_long_for_the_file_system_is_one_line(tmp_path, model_dir, capsys, command):
    """A model, GGUF or adapter path with a name longer than the file system allows ended the command in
    OSError's traceback (File name too long), where the config and hostfile paths said so in one line."""
    long = str(tmp_path / ("x" * 300))
    data = tmp_path / "good.jsonl"
    data.write_text(jsonl(GOOD))
    out = tmp_path / "out"
    if command == "train":
        status, out = run(tmp_path, long, "--data.train", str(data))
    else:
        status = main({"convert": ["convert", long + ".gguf", str(out)],
                       "export": ["export", long, "--base", str(model_dir), "--out", str(out)]}[command])
    # the path's first 80 characters, however many of them tmp_path takes ($TMPDIR: macOS's is ~50 long)
    check(capsys, status, out, f"dtrain: error: {long[:80]}...: not a usable path: File name too long")


def test_chat_template_syntax_error_is_one_error_naming_file_and_line(tmp_path, model_dir, capsys):
    data = tmp_path / "good.jsonl"
    data.write_text(jsonl(GOOD, {**GOOD, "prompt": "other"}))
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    fragment = f"data.chat_template {template}: Jinja syntax error on line 2: unexpected '}}'"
    status, out = run(tmp_path, model_dir, "--data.train", str(data), "--data.chat_template", str(template))
    check(capsys, status, out, fragment)
    assert main(["data", "check", str(data), "--model.path", str(model_dir), "--data.chat_template", str(template)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == f"dtrain: error: {fragment}" and "cannot render" not in captured.out


class Writes:
    """A stderr that records each write call (ranks under ./launch write unbuffered)."""

    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)
        return len(text)

    def flush(self):
        pass


def test_the_error_line_is_one_write(monkeypatch):
    """Under ./launch every rank's stderr is unbuffered: print's separate writes of the text and
    the newline let two ranks' errors run into one line ("...output_dirdtrain: error: rank 0 ...")."""
    stderr = Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    assert main(["config", "--trian.steps", "3"]) == 2
    assert stderr.calls == ["dtrain: error: command line: unknown section 'trian' (did you mean 'train'? known: data, distributed, "
                            "engine, lora, model, objective, orpo, train)\n"]


def test_an_interrupted_line_is_one_write(monkeypatch):
    """Two ranks stopped during start-up each print 'dtrain: interrupted'; print's separate writes of the text
    and the newline ran them into one line under ./launch ("dtrain: interrupteddtrain: interrupted")."""
    from dtrain import cli

    def interrupted(*_args):
        raise KeyboardInterrupt

    stderr = Writes()
    monkeypatch.setattr(cli, "_train", interrupted)
    monkeypatch.setattr("sys.stderr", stderr)
    assert main(["train", "-c", "job.yaml"]) == 130
    assert stderr.calls == ["dtrain: interrupted\n"]


def test_a_path_under_an_unknown_users_home_is_one_line():
    """model.path and data.chat_template under ~nosuchuser/ ended in pathlib's RuntimeError traceback."""
    from dtrain.data.templates import template_source
    from dtrain.errors import DataError, ModelError
    from dtrain.models import load_model

    with pytest.raises(ModelError) as err:
        load_model("~nosuchuser-dtrain/model.gguf")
    assert str(err.value) == ("~nosuchuser-dtrain/model.gguf: no such file or directory: no home folder for "
                              "~nosuchuser-dtrain")
    with pytest.raises(DataError) as err:
        template_source("~nosuchuser-dtrain/chat.jinja")
    assert str(err.value).startswith("data.chat_template: '~nosuchuser-dtrain/chat.jinja' is neither a template name")


def test_an_unreadable_config_file_is_one_line(tmp_path, monkeypatch, capsys):
    """A config file this user may not read ended in PermissionError's traceback."""
    from pathlib import Path

    cfg = tmp_path / "job.yaml"
    cfg.write_text("data: {demo_pairs: 4}\n")
    monkeypatch.setattr(Path, "read_text", lambda self, **_: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(self))))
    assert main(["config", "-c", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err == f"dtrain: error: {cfg}: cannot read the config file: Permission denied\n", err


def test_an_unreadable_chat_template_file_is_one_line(tmp_path, monkeypatch):
    """A data.chat_template Jinja file this user may not read ended in PermissionError's traceback."""
    from pathlib import Path

    from dtrain.data.templates import template_source
    from dtrain.errors import DataError

    jinja = tmp_path / "chat.jinja"
    jinja.write_text("{{ messages }}")
    monkeypatch.setattr(Path, "read_text", lambda self, **_: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(self))))
    with pytest.raises(DataError) as err:
        template_source(str(jinja))
    assert str(err.value) == f"data.chat_template: {jinja}: cannot be read: Permission denied"


def test_token_ids_past_the_models_vocabulary_are_refused_naming_the_row(tmp_path, capsys):
    """A tokenizer with more tokens (361) than the model's embedding has rows (vocab_size 312): the ids past
    311 (row 2's ' is' 314, ' +' 319; row 1's are below 312) read memory outside the embedding and the LM head (MLX does not check a gather's bounds), so the loss
    changed from run to run and the two engines disagreed; PyTorch raises there. Now both `dtrain train` and
    `dtrain data check` stop before any step, naming the row, the id and the vocabulary size."""
    from fixtures_launch import MODEL_CONFIG
    from mlx_lm.utils import save_config, save_model

    from conftest import make_tiny_model, make_tokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_model(model_dir, make_tiny_model(num_hidden_layers=2, vocab_size=312))
    save_config(dict(MODEL_CONFIG, vocab_size=312), config_path=model_dir / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(str(model_dir))
    data = tmp_path / "pairs.jsonl"
    data.write_text(jsonl({"prompt": "a", "chosen": "b", "rejected": "c"}, GOOD, {**GOOD, "prompt": "other"}))
    status, out = run(tmp_path, model_dir, "--data.train", str(data), "--data.valid_fraction", "0",
                      "--train.global_batch_pairs", "2", "--train.micro_batch_pairs", "2")
    check(capsys, status, out, "pairs.jsonl:2: token id ")
    err_line = "the model's vocabulary has 312 ids (0-311)"
    status = main(["data", "check", str(data), "--model.path", str(model_dir), "--data.valid_fraction", "0"])
    err = capsys.readouterr().err
    assert status == 1 and "pairs.jsonl:2: token id " in err and err_line in err and "Traceback" not in err, err


def test_an_empty_path_argument_is_named_not_read_as_the_working_folder(tmp_path, model_dir, capsys):
    """'' as convert's GGUF_FILE, export's ADAPTER_DIR or --base was read as the working folder (': a folder, not a
    GGUF file', ': not an adapter folder ...', ': folder has no config.json ...', naming nothing), and doctor's
    --model '' was refused as the key 'model.path', which the command line did not give."""
    status, out = run(tmp_path, model_dir, "--data.demo_pairs", "8", "--train.global_batch_pairs", "2",
                      "--train.micro_batch_pairs", "2")
    assert status == 0, capsys.readouterr().err
    capsys.readouterr()
    for argv, message in [
        (["convert", "", str(tmp_path / "o")], "the GGUF file path is empty text; give a .gguf file (or demo)"),
        (["export", "", "--base", str(model_dir), "--out", str(tmp_path / "o")],
         "the adapter folder path is empty text; give an adapter folder (a run's OUTPUT_DIR/adapters)"),
        (["export", str(out / "adapters"), "--base", "", "--out", str(tmp_path / "o")],
         "the model path is empty text; give demo, a .gguf file, a model folder or a hub id"),
        (["doctor", "--model", "", "--no-demo"],
         "doctor: --model is empty (''); give demo, a .gguf file, a model folder or a hub id"),
    ]:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert (captured.out, captured.err.splitlines()[-1:]) == ("", [f"dtrain: error: {message}"]), argv
        assert "Traceback" not in captured.err and not (tmp_path / "o").exists()


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_a_path_that_is_no_file_nor_folder_is_named_so(fifo, capsys):
    """/dev/null or a pipe (`-c <(envsubst < job.yaml)`) given as the config, the hostfile, the GGUF file of
    `dtrain convert` or model.path was called missing ('config file not found', 'hostfile not found', 'no such GGUF
    file', 'no such file or directory'), though it is there."""
    from dtrain.config import load_config
    from dtrain.errors import UserError
    from dtrain.launch.hosts import load_hostfile
    from dtrain.models import convert_gguf, load_model

    for path in ("/dev/null", str(fifo)):
        for call, fix in [(lambda: load_config(path), "give the config as a file"),
                          (lambda: load_hostfile(path), "give the hostfile as a file"),
                          (lambda: convert_gguf(path, str(fifo.parent / "out")), "give a .gguf file"),
                          (lambda: load_model(path), "expected demo, a .gguf file, a model folder or a hub id")]:
            with pytest.raises(UserError) as err:
                call()
            assert str(err.value) == f"{path}: not a regular file (a pipe, a socket or a device); {fix}"
        assert main(["train", "-c", path]) == 2
        assert capsys.readouterr().err == (f"dtrain: error: {path}: not a regular file (a pipe, a socket or a "
                                           f"device); give the config as a file\n")
