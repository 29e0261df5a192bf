"""Config loading, the demo config, and the README/CI contract."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dtrain import config, config_text
from dtrain.cli import main
from dtrain.config import Config, describe_fields, load_config, to_dict
from dtrain.config_text import allowed
from dtrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
# "  key: value  # comment" or, for a default the demo keeps, "  # key: value  # comment"
KEY_LINE = re.compile(r"^  (?P<off># )?(?P<key>\w+): (?P<value>.*?)\s+# (?P<comment>.+)$")


def demo_yaml_keys() -> dict:
    """``{(section, key): (active, value, comment)}`` of configs/demo.yaml, and every
    indented line that names a key without a comment (as ``comment=None``).
    A key listed twice is an error."""
    out, section = {}, None
    for line in (ROOT / "configs" / "demo.yaml").read_text().splitlines():
        if re.match(r"^\w+:", line):
            section = line.split(":")[0]
        elif section and re.match(r"^  (# )?\w+:", line):
            m = KEY_LINE.match(line)
            key = re.match(r"^  (# )?(\w+):", line).group(2)
            assert (section, key) not in out, f"configs/demo.yaml lists {section}.{key} twice"
            out[(section, key)] = (not line.startswith("  #"), m and m["value"], m and m["comment"])
    return out


def test_demo_config_lists_every_key_with_a_comment_and_true_defaults():
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"))
    assert cfg.model.path == "demo" and cfg.data.demo_pairs > 0 and cfg.orpo.lam == 0.1
    demo = demo_yaml_keys()
    expected = {(s.name, key) for s in dataclasses.fields(Config) for key, *_ in describe_fields(type(getattr(cfg, s.name)))}
    assert set(demo) == expected, (sorted(expected - set(demo)), sorted(set(demo) - expected))
    for (section, key), (active, value, comment) in demo.items():
        assert comment, f"configs/demo.yaml: {section}.{key} has no comment"
        tp, default, meta = next((t, d, m) for k, t, d, m in describe_fields(type(getattr(cfg, section))) if k == key)
        if meta["choices"]:
            assert f"[{allowed(tp, meta)}]" in comment, (section, key, comment)
        if not active:  # a commented-out key shows the default from dtrain/config.py
            assert yaml.safe_load(value) == default, (section, key, value, default)


def test_demo_config_comments_are_the_help_of_config_py():
    """configs/demo.yaml is what ``config_text.commented`` writes: each key's comment is its help
    and allowed values from dtrain/config.py, so the two cannot drift."""
    path = ROOT / "configs" / "demo.yaml"
    assert path.read_text() == config_text.commented(str(path)), \
        "configs/demo.yaml differs from dtrain/config.py's help; rewrite it as its header says"


def test_commented_rewrites_a_stale_comment_and_keeps_the_values(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("# my job\n\ntrain:\n  steps: 7   # a comment that drifted\ndata:\n  demo_pairs: 20\n")
    text = config_text.commented(str(path))
    assert text.startswith("# my job\n\nmodel:\n  # path: demo ")
    assert re.search(r"^  steps: 7 +# optimizer steps \[> 0\]$", text, re.M) and "drifted" not in text
    path.write_text(text)
    assert load_config(str(path)) == load_config(None, ["train.steps=7", "data.demo_pairs=20"])
    assert config_text.commented(str(path)) == text


def test_train_help_lists_every_key_from_config_py(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for section in dataclasses.fields(Config):
        for key, tp, default, meta in describe_fields(type(getattr(Config(), section.name))):
            line = f"  --{section.name}.{key} {config_text.yaml_value(default)}: {meta['help']} [{allowed(tp, meta)}]"
            assert line in out.splitlines(), line


@pytest.mark.parametrize("command", [["train"], ["config"], ["data", "check"]])
def test_the_usage_of_a_command_that_takes_overrides_shows_them(command, capsys):
    """`dtrain config --help` printed `usage: dtrain config [-h] [-c CONFIG]`, though it takes
    `--section.key VALUE` overrides as train and data check do."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert usage.startswith(f"usage: dtrain {' '.join(command)} ") and "[--section.key VALUE ...]" in usage, usage


def test_the_help_names_every_objective_it_trains(capsys):
    """`dtrain --help` said "ORPO + LoRA preference training on MLX" after DPO, SimPO and SFT came
    (objective.kind); and `data` "inspect preference data", though it checks SFT rows too."""
    from dtrain.engine import OBJECTIVES

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert all(kind.upper() in description.upper() for kind in OBJECTIVES), description
    assert "inspect preference data" not in out


def test_every_key_has_a_help_line():
    for section in dataclasses.fields(Config):
        for key, _, _, meta in describe_fields(type(getattr(Config(), section.name))):
            assert meta.get("help"), f"{section.name}.{key} has no help (use config.option)"


def test_dtrain_config_prints_every_key_with_default_and_help(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == to_dict(Config())  # a valid config: the defaults
    lines = out.splitlines()
    for section in dataclasses.fields(Config):
        for key, tp, _, meta in describe_fields(type(getattr(Config(), section.name))):
            line = next(l for l in lines if l.startswith(f"  {key}: ") and meta["help"] in l)
            assert line.endswith(f"# {meta['help']} [{allowed(tp, meta)}]"), line
    assert "  segment_layers: 0 " in out and "[int or 'auto', >= 0]" in out
    assert "  format: auto " in out and ("[auto | standard | conversational | transcript | openai | sharegpt | mapped | "
                                        "messages | prompt_completion | text]") in out


def test_dtrain_config_resolves_a_file_and_overrides(capsys):
    assert main(["config", "-c", str(ROOT / "configs" / "demo.yaml"), "--engine.segment_layers", "auto"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["engine"]["segment_layers"] == "auto" and resolved["data"]["demo_pairs"] == 600


def test_dtrain_config_names_a_key_the_run_would_not_read(capsys):
    """The command that checks a config said nothing of a key the run's notice says has no effect."""
    assert main(["config", "--engine.segment_layers", "4", "--engine.kind", "auto"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "'engine.segment_layers' is 4 but engine.kind auto (it sizes the ranges itself) does not read it: it has no "
        "effect"]


def test_allowed_values_come_from_their_owners():
    from dtrain.data.formats import FORMATS
    from dtrain.contract import BACKENDS
    from dtrain.models.load import DTYPES

    meta = {(s.name, k): m for s in dataclasses.fields(Config)
            for k, _, _, m in describe_fields(type(getattr(Config(), s.name)))}
    assert meta[("model", "dtype")]["choices"] == ("auto", *DTYPES)
    assert meta[("data", "format")]["choices"] == ("auto", *FORMATS)
    assert meta[("distributed", "backend")]["choices"] == ("any", *BACKENDS)


@pytest.mark.parametrize("value, result", [("auto", "auto"), (3, 3), (0, 0)])
def test_segment_layers_is_an_int_or_auto(value, result):
    assert load_config(None, ["data.demo_pairs=1", f"engine.segment_layers={value}"]).engine.segment_layers == result


@pytest.mark.parametrize("value, message", [
    ("fast", "key 'engine.segment_layers': expected int or 'auto', got 'fast'"),
    ("-1", "key 'engine.segment_layers' must be >= 0; got -1"),
    ("true", "key 'engine.segment_layers': expected int or 'auto', got True"),
    ("2.5", "key 'engine.segment_layers': expected int or 'auto', got 2.5"),
])
def test_segment_layers_rejects_other_values(value, message):
    with pytest.raises(ConfigError, match=re.escape(f"command line: {message}")):
        load_config(None, ["data.demo_pairs=1", f"engine.segment_layers={value}"])


def test_a_yaml_section_with_every_key_commented_out_is_empty(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  demo_pairs: 4\ndistributed:\n  # backend: any\n")
    assert load_config(str(f)).distributed == config.DistributedConfig()


def test_overrides_beat_yaml_and_parse_as_yaml_scalars(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\n  learning_rate: 1e-4\ndata:\n  demo_pairs: 4\n")
    cfg = load_config(str(f), ["train.steps=9", "orpo.lambda=0.5", "lora.keys=[self_attn.q_proj]", "train.resume=null"])
    assert (cfg.train.steps, cfg.train.learning_rate, cfg.orpo.lam) == (9, 1e-4, 0.5)
    assert cfg.lora.keys == ["self_attn.q_proj"] and cfg.train.resume is None
    assert to_dict(cfg)["orpo"]["lambda"] == 0.5


def test_unknown_key_names_the_key_and_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown key 'orpo.beta' \(it is 'objective.beta'; known in 'orpo': lambda, lambda_backoff, lambda_epsilon, lambda_kd, lambda_law, lambda_max, lambda_min, lambda_schedule, lambda_step, lambda_stop_drop, lambda_window, nll_scope\)"):
        load_config(None, ["data.demo_pairs=1", "orpo.beta=0.1"])


@pytest.mark.parametrize("override, hint", [
    ("data.max_lenght=5", "(did you mean 'data.max_length'? known in 'data': "),
    ("lora.rnak=4", "(did you mean 'lora.rank'? known in 'lora': "),
    ("train.max_length=5", "(it is 'data.max_length'; known in 'train': "),
    ("trian.steps=3", "unknown section 'trian' (did you mean 'train'? known: data, "),
    ("train.nope=1", "unknown key 'train.nope' (known in 'train': "),
])
def test_a_misspelt_or_misplaced_key_names_the_one_meant(override, hint):
    """A typo or a key under the wrong section listed every key of the section and left the user to find it."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert hint in str(err.value)


KNOWN = "known: data, distributed, engine, lora, model, objective, orpo, train)"


@pytest.mark.parametrize("text, message", [
    ("learning_rate: 1.0e-4\n", "unknown section 'learning_rate' (it is the key 'train.learning_rate': indent it "
                                "under its section; " + KNOWN),
    ("lambda: 0.2\n", "unknown section 'lambda' (it is the key 'orpo.lambda': indent it under its section; " + KNOWN),
    ("kind: dpo\n", "unknown section 'kind' (it is the key 'engine.kind' or 'objective.kind': indent it under its "
                    "section; " + KNOWN),
    ("learning_rat: 1.0e-4\n", "unknown section 'learning_rat' (did you mean 'train.learning_rate'? " + KNOWN),
    ("trainer: 3\n", "unknown section 'trainer' (did you mean 'train'? " + KNOWN),
    ("bogus: {a: 1}\n", "unknown section 'bogus' (" + KNOWN),
    ("data: {demo_pairs: 4}\ntrain: {resume: false}\n",  # it said only "got False"
     "key 'train.resume': expected str or null, got false (null: a new run; auto: the newest valid checkpoint "
     "in output_dir; or a checkpoint folder)"),
    ("data: {demo_pairs: 4, valid: 2026-12-06}\n",  # it said "got datetime.date(2026, 12, 6)"
     "key 'data.valid': expected str or null, got the date 2026-12-06 (YAML reads an unquoted date as one); "
     "quote it: '2026-12-06'"),
    ("train: {steps: 2026-12-06}\n",  # quoting does not make a number of one
     "key 'train.steps': expected int, got the date 2026-12-06 (YAML reads an unquoted date as one)"),
])
def test_a_yaml_mistake_is_named_with_its_fix(tmp_path, text, message):
    """A flat config (keys not under sections) was told "section 'learning_rate' must be a mapping of keys"."""
    f = tmp_path / "flat.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert str(err.value) == f"{f}: {message}"


@pytest.mark.parametrize("override, key", [("lora.keys=[self_attn.q_proj, 2026-12-06]", "lora.keys"),
                                           ("data.fields={prompt: 2026-12-06}", "data.fields"),
                                           ("data.fields={2026-12-06: question}", "data.fields")])
def test_a_date_inside_a_list_or_mapping_is_named_as_one_at_the_top(override, key):
    """Only a key's own value was checked for a date: one inside its list or mapping was kept as a date."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", override])
    assert str(err.value) == (f"command line: key '{key}': expected text inside, got the date 2026-12-06 (YAML reads "
                              f"an unquoted date as one); quote it: '2026-12-06'")


FIELDS_SYNTAX = ("e.g. --data.fields '{prompt: question, chosen: response_j, rejected: response_k}' on the command "
                 "line, or the same mapping under data: fields: in YAML")


@pytest.mark.parametrize("value, problem", [
    ("{bogus: x}", f"data.fields: unknown key 'bogus' (known: prompt, chosen, rejected, system, completion, messages, "
                   f"text); {FIELDS_SYNTAX}"),
    ("{1: prompt, foo: x}", f"data.fields: unknown key 1 (known: prompt, chosen, rejected, system, completion, "
                            f"messages, text); {FIELDS_SYNTAX}"),
    ("{prompt: 5}", f"data.fields.prompt: expected a column name, got 5; {FIELDS_SYNTAX}"),
    ("{chosen: a, completion: b}", "data.fields maps chosen, completion: a row is a preference pair (chosen, "
                                   "rejected) or one SFT completion (completion, messages or text), not both"),
])
def test_data_fields_own_keys_are_checked_with_the_config(tmp_path, value, problem):
    """data.fields' keys and column names were checked only as a data file's rows were read: with demo pairs a
    misspelt key trained without a word, dtrain config and ./launch --dry-run showed it, and {1: prompt, foo: x}
    ended the data load in TypeError's traceback (sorting 1 and 'foo')."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=8", f"data.fields={value}"])
    assert str(err.value) == f"command line: {problem}"
    f = tmp_path / "job.yaml"
    f.write_text(f"data:\n  train: pairs.jsonl\n  fields: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert str(err.value) == f"{f}: {problem}"
    assert load_config(None, ["data.demo_pairs=8", "data.fields={}"]).data.fields == {}


@pytest.mark.parametrize("value", ["[1, 2]", "[[self_attn.q_proj]]", "[]", "[self_attn.q_proj, '']"])
def test_lora_keys_that_name_no_module_path_are_refused_at_once(value):
    """lora.keys of numbers, nested lists or nothing passed the config and failed after the model loaded
    ("matched no linear layer")."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", f"lora.keys={value}"])
    assert str(err.value) == (f"command line: key 'lora.keys' must list module paths inside a decoder layer, e.g. "
                              f"[self_attn.q_proj, mlp.down_proj], or be null for every linear layer; got "
                              f"{yaml.safe_load(value)!r}")


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [l for l in block.strip().splitlines() if l.strip()]
    assert len(lines) == 2, lines
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[1] in ci
    assert lines[0] == "./setup && ./launch configs/demo.yaml"
    assert "./setup dev,mpi" in ci  # CI installs through the README's setup step


def test_data_file_and_demo_pairs_together_is_an_error():
    with pytest.raises(ConfigError, match=r"both 'data.train' \(x.jsonl\) and 'data.demo_pairs' \(600\) are set; "
                                          r"use one .*--data.demo_pairs 0"):
        load_config(str(ROOT / "configs" / "demo.yaml"), ["data.train=x.jsonl"])
    assert load_config(str(ROOT / "configs" / "demo.yaml"), ["data.train=x.jsonl", "data.demo_pairs=0"]).data.train == "x.jsonl"


@pytest.mark.parametrize("key, value", [("data.valid", "v.jsonl"), ("data.valid_split", "test")])
def test_held_out_data_with_demo_pairs_is_an_error(key, value):
    """configs/demo.yaml with --data.valid: the generated pairs were split by data.valid_fraction and the file
    was never read, silently."""
    with pytest.raises(ConfigError) as err:
        load_config(str(ROOT / "configs" / "demo.yaml"), [f"{key}={value}"])
    assert str(err.value) == (f"{ROOT / 'configs' / 'demo.yaml'} with the command line's overrides: '{key}' "
                              f"({value}) is set but 'data.demo_pairs' (600) generates the pairs, holding out "
                              f"data.valid_fraction of them; remove {key}, or set data.demo_pairs 0 and data.train")


def test_lora_num_layers_zero_is_refused_since_mlx_lm_would_adapt_every_layer(tmp_path):
    """0 passed the key's ">= -1" and trained every layer: mlx-lm slices model.layers[-0:]."""
    from conftest import make_tiny_model
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = make_tiny_model()
    linear_to_lora_layers(model, 0, {"rank": 2, "scale": 1.0, "dropout": 0.0})
    adapted = {re.search(r"layers\.(\d+)\.", name)[1] for name, module in model.named_modules()
               if type(module).__name__ == "LoRALinear"}
    assert adapted == {str(i) for i in range(len(model.layers))}  # why 0 is refused
    demo, own = ROOT / "configs" / "demo.yaml", tmp_path / "own.yaml"
    own.write_text((ROOT / "configs" / "demo.yaml").read_text().replace("num_layers: -1", "num_layers: 0"))
    rule = ("'lora.num_layers' is 0, which would adapt no layer, yet mlx-lm reads it as all of them; set -1 for "
            "every layer or N >= 1 for the last N")
    # a rule broken by an override named the file alone, which holds no 0 (dtrain config -c FILE --key VALUE)
    for path, overrides, where in ((demo, ["lora.num_layers=0"], f"{demo} with the command line's overrides"),
                                   (own, [], f"{own}")):
        with pytest.raises(ConfigError) as err:
            load_config(str(path), overrides)
        assert str(err.value) == f"{where}: {rule}"
    for n in (-1, 1):
        assert load_config(str(ROOT / "configs" / "demo.yaml"), [f"lora.num_layers={n}"]).lora.num_layers == n


@pytest.mark.parametrize("ratio, message", [(1.5, "must be in [0, 1]; got 1.5"), (-0.1, "must be in [0, 1]; got -0.1")])
def test_min_lr_ratio_above_one_is_refused(ratio, message):
    """A final rate above the peak made the cosine 'decay' climb to 1.5x train.learning_rate."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"train.min_lr_ratio={ratio}", "data.demo_pairs=8"])
    assert str(err.value) == f"command line: key 'train.min_lr_ratio' {message}"
    assert load_config(None, ["train.min_lr_ratio=1", "data.demo_pairs=8"]).train.min_lr_ratio == 1.0
    field = {f.name: f for f in dataclasses.fields(config.TrainConfig)}["min_lr_ratio"]
    assert allowed(float, field.metadata) == "in [0, 1]"


@pytest.mark.parametrize("override, message", [
    ("train.save_every=99999999999999999999", "key 'train.save_every' must fit in 64 bits (below 2**63); "
                                              "got 99999999999999999999"),
    ("data.demo_seed=-99999999999999999999", "key 'data.demo_seed' must fit in 64 bits (below 2**63); "
                                             "got -99999999999999999999"),
    ("train.seed=-1", "key 'train.seed' must be >= 0; got -1"),
])
def test_an_integer_numpy_and_mlx_cannot_hold_is_refused(override, message):
    """train.seed -1 and an integer of 2**63 or more passed the config and ended the run in a traceback: MLX's
    seed takes an unsigned 64-bit value, TensorBoard's hparams record runs np.isnan on every number."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=8", override])
    assert str(err.value) == f"command line: {message}"
    assert load_config(None, ["data.demo_pairs=8", f"train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


@pytest.mark.parametrize("key, value", [("lora.rank", 2**31), ("lora.rank", 2**63 - 1),
                                        ("engine.length_bucket", 2**62), ("engine.length_bucket", 2**31)])
def test_an_array_dimension_past_int32_is_refused(key, value):
    """lora.rank 2**31 passed the config and ended the run in OverflowError's traceback from mlx-lm's LoRALinear
    (mx.random.uniform's shape), engine.length_bucket 2**62 in ValueError's from numpy (a row padded to it) after
    the output folder got data_cache/ and tb/: both are array dimensions, which MLX holds as int32."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=8", f"{key}={value}"])
    assert str(err.value) == (f"command line: key '{key}' must be below 2**31 (an array dimension: MLX's shapes "
                              f"are int32); got {value}")
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, ["data.demo_pairs=8", f"{key}={2**31 - 1}"]), section), name) == 2**31 - 1


@pytest.mark.parametrize("key", ["train.output_dir", "model.path", "data.train", "data.chat_template",
                                 "train.resume", "data.fields"])
def test_a_nul_character_in_text_is_refused(tmp_path, key):
    """A YAML "\\0" (the command line cannot pass one) in train.output_dir ended the run in ValueError's traceback
    ('embedded null byte') as it made the folder, after the model and data loaded; in the other paths the message
    showed the path with the NUL in it ('a b: data file not found'). No path or name holds one."""
    section, name = key.split(".")
    value = {"prompt": "q\0"} if key == "data.fields" else "a\0b"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"data": {"demo_pairs": 4}, section: {name: value}} if section != "data" else
                                   {"data": {"train": "pairs.jsonl", name: value}}))
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == f"{path}: key '{key}' holds a NUL character (\\0), which no path or name can"


DEEP = "[" * 3000 + "]" * 3000
BIG = "1" + "0" * 5000


@pytest.mark.parametrize("text, message", [
    (f"train:\n  steps: {BIG}\n", "line 2 invalid YAML: an integer of more than 4300 digits"),
    ("data:\n  demo_pairs: 4\n  valid: 2024-02-30\n", "line 3 invalid YAML: 2024-02-30: day is out of range for month"),
    (f"lora:\n  keys: {DEEP}\n", "invalid YAML: nested too deep for Python's recursion limit"),
    ("lora: &a\n  keys: [*a]\n", "key 'lora.keys' nests lists or mappings more than 10 levels deep "
                                   "(a recursive YAML alias?)"),
    ("data: {fields: &f {prompt: *f}}\n", "key 'data.fields' nests lists or mappings more than 10 levels deep "
                                          "(a recursive YAML alias?)"),
    ("train:\n  seed: !!set 0\n", "line 2 invalid YAML: expected a mapping node, but found scalar"),
    ("train: !!map x\n", "line 1 invalid YAML: expected a mapping node, but found scalar"),
    ("train:\n  !!omap path: demo\n", "line 2 invalid YAML: found unhashable key"),
])
def test_yaml_python_cannot_build_is_one_error(tmp_path, text, message):
    """A 5000-digit integer and 2024-02-30 (PyYAML's int() and date() raise ValueError), flow lists nested
    thousands deep (RecursionError in PyYAML's parser) and a recursive alias (RecursionError in the check
    for dates inside a value) ended in tracebacks; so did a scalar tagged !!set or !!map (ValueError) and a
    key tagged !!omap (TypeError: unhashable), in the check for repeated keys."""
    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(f), need_data=False)
    assert str(err.value) == f"{f}: {message}"


DATA_FILE = "a data file? the config is a YAML file: give the data as data.train (--data.train FILE) or to " \
            "dtrain data check FILE"


@pytest.mark.parametrize("name, text, message", [
    ("job.yaml", "train:\n  steps: 3\n  # caf\x80\n", "line 3 invalid YAML: unacceptable character #x0080: special "
                                                       "characters are not allowed"),
    ("pairs.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n', "line 2 invalid YAML: expected '<document start>', but "
                                                          f"found '{{'; {DATA_FILE}"),
    ("pairs.jsonl", '{"prompt": "M\x80"}\n', f"line 1 invalid YAML: unacceptable character #x0080: special characters "
                                               f"are not allowed; {DATA_FILE}"),
    ("pairs.json", '[{"prompt": "a", "chosen": "b", "rejected": "c"}]', "expected a mapping of sections at the top "
                                                                        f"level, got list; {DATA_FILE}"),
    ("pairs.JSONL.gz", "\x1f\x8b\x08\x00\xff", f"not UTF-8 text (invalid start byte at byte 1); {DATA_FILE}"),
    # a file of one row reads as a mapping: its columns are no sections
    ("pairs.jsonl", '{"prompt": "a", "chosen": "b", "rejected": "c"}\n', "unknown section 'prompt' (known: data, "
                                                                      "distributed, engine, lora, model, objective, "
                                                                      f"orpo, train); {DATA_FILE}"),
    # rows under a key that is a section's name (json.dump({'data': rows})): a few shown, not the file
    ("pairs.json", json.dumps({"data": [{"prompt": "a" * 50}] * 1000}), "section 'data' must be a mapping of keys, "
                                                                        "got [" + "{'prompt': 'aaaaaaaaaaaa...aaaaaaaaaaaaa'}, " * 6
                                                                        + f"...]; {DATA_FILE}"),
])
def test_a_data_file_given_as_the_config_is_one_line_naming_it(tmp_path, name, text, message):
    """``dtrain data check -c pairs.jsonl CONFIG`` (the two swapped) said 'invalid YAML: unacceptable character
    #x0080: special characters are not allowed' and, on a second line, 'in "<unicode string>", position 453645'
    (orca_dpo_pairs_validation.jsonl): no line, and nothing said the file was data."""
    f = tmp_path / name
    f.write_bytes(text.encode("latin-1") if name.endswith(".gz") else text.encode())
    with pytest.raises(ConfigError) as err:
        load_config(str(f), need_data=False)
    assert str(err.value) == f"{f}: {message}".replace("FILE", str(f))


@pytest.mark.parametrize("override, message", [
    (f"train.steps={BIG}", "key 'train.steps': invalid YAML: an integer of more than 4300 digits"),
    (f"lora.keys={DEEP}", "key 'lora.keys': invalid YAML: nested too deep for Python's recursion limit"),
    ("lora.keys=&a [*a]", "key 'lora.keys' nests lists or mappings more than 10 levels deep (a recursive YAML alias?)"),
])
def test_an_override_python_cannot_build_is_one_error(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override], need_data=False)
    assert str(err.value) == f"command line: {message}"


@pytest.mark.parametrize("scale", [0, -2.5])
def test_lora_scale_at_or_below_zero_is_refused(scale):
    """Scale 0 makes every LoRA layer's update 0 and its gradient 0 (shown below): the run trained nothing."""
    import mlx.core as mx
    from conftest import make_tiny_model
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    with pytest.raises(ConfigError) as err:
        load_config(None, [f"lora.scale={scale}", "data.demo_pairs=8"])
    assert str(err.value) == f"command line: key 'lora.scale' must be > 0; got {float(scale)}"
    assert load_config(None, ["lora.scale=0.5", "data.demo_pairs=8"]).lora.scale == 0.5
    def largest_gradient(lora_scale: float) -> float:
        model = make_tiny_model()
        model.freeze()
        linear_to_lora_layers(model, -1, {"rank": 2, "scale": lora_scale, "dropout": 0.0})
        params = model.trainable_parameters()
        model.update(tree_unflatten([(k, mx.full(v.shape, 0.1) if k.endswith("lora_b") else v)
                                     for k, v in tree_flatten(params)]))  # lora_b starts at 0: give it a value

        def loss(p):
            model.update(p)
            return model(mx.array([[1, 2, 3]])).sum()

        return max(float(mx.abs(g).max()) for _, g in tree_flatten(mx.grad(loss)(model.trainable_parameters())))

    assert largest_gradient(0.0) == 0.0 and largest_gradient(1.0) > 0.0


@pytest.mark.parametrize("command, extra", [
    (["doctor"], ["--bogus"]), (["doctor"], ["--train.steps", "3"]),
    (["export", "a", "--base", "b", "--out", "c"], ["--bogus"]),
    (["convert", "a.gguf", "out"], ["--bogus"])])
def test_an_unknown_option_of_a_command_without_overrides_points_to_its_help(command, extra, capsys):
    """`dtrain doctor --bogus` said "overrides look like --section.key VALUE", which doctor does not take."""
    assert main([*command, *extra]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: unexpected argument(s) {' '.join(extra)}: dtrain {command[0]} "
                                       f"takes no config overrides; its options: dtrain {command[0]} --help\n")


@pytest.mark.parametrize("command", [["train"], ["config"], ["data", "check", "pairs.jsonl"]])
def test_a_bare_config_file_points_to_dash_c(command, capsys):
    """`./launch configs/demo.yaml` takes the config bare; `dtrain train configs/demo.yaml` said only
    "overrides look like --section.key VALUE"."""
    assert main([*command, "configs/demo.yaml"]) == 2
    assert capsys.readouterr().err == ("dtrain: error: unexpected argument 'configs/demo.yaml': a config file is "
                                       "given with -c (-c configs/demo.yaml)\n")
    assert main(["doctor", "x.yml"]) == 2  # doctor has no -c
    assert capsys.readouterr().err == ("dtrain: error: unexpected argument(s) x.yml: dtrain doctor takes no config "
                                       "overrides; its options: dtrain doctor --help\n")


@pytest.mark.parametrize("command", [["train"], ["config"], ["data", "check", "pairs.jsonl"]])
@pytest.mark.parametrize("first, second", [("-c", "-c"), ("--config", "-c"), ("-c", "--config=")])
def test_a_second_config_file_is_refused(command, first, second, capsys):
    """`dtrain train -c configs/sft.yaml -c configs/demo.yaml` trained demo.yaml's job: argparse keeps the last
    -c, and the first file's keys were dropped without a word (as YAML's repeated key, which is refused)."""
    two = [first, "configs/sft.yaml", *([f"{second}b.yaml"] if second.endswith("=") else [second, "b.yaml"])]
    assert main([*command, *two, "--train.steps", "1"]) == 2
    assert capsys.readouterr().err == ("dtrain: error: -c/--config given twice (configs/sft.yaml, then b.yaml): give "
                                       "one config file, and change its keys with --section.key VALUE\n")


@pytest.mark.parametrize("argv, fixed", [
    (["-c", "configs/demo.yaml", "train"], "dtrain train -c configs/demo.yaml"),
    (["--train.steps", "3", "train", "-c", "a.yaml"], "dtrain train -c a.yaml --train.steps 3"),
    (["-c", "a.yaml", "data", "check", "p.jsonl"], "dtrain data check p.jsonl -c a.yaml"),
])
def test_options_before_the_command_name_it(argv, fixed, capsys):
    """`dtrain -c configs/demo.yaml train` said "argument command: invalid choice: 'configs/demo.yaml'"."""
    assert main(argv) == 2
    assert capsys.readouterr().err == f"dtrain: error: options go after the command: {fixed}\n"
    from dtrain.cli import COMMANDS, _parser

    assert set(COMMANDS) == set(next(a for a in _parser()._actions if a.dest == "command").choices)


def test_dtrain_config_into_a_closed_pipe_exits_quietly():
    """``dtrain config | head``: the reader gone before the output is written is not an error
    (exit 0, no traceback), as for other command-line tools."""
    read, write = os.pipe()
    os.close(read)  # no reader: every write of the child gets EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "dtrain", "config"], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize("override", ["train.learning_rate=.nan", "train.learning_rate=.inf", "lora.scale=.nan",
                                      "lora.scale=-.inf", "train.grad_clip=nan", "train.weight_decay=1e400",
                                      "objective.beta=.inf"])
def test_a_non_finite_float_is_refused_naming_the_key(override):
    """NaN passes every bound check (``nan < 0`` is False), and trained an all-NaN adapter."""
    key, value = override.split("=")
    extra = ["objective.kind=dpo"] if key == "objective.beta" else []
    with pytest.raises(ConfigError, match=rf"command line: key '{re.escape(key)}' must be a finite number; got "):
        load_config(None, ["data.demo_pairs=1", *extra, override])


@pytest.mark.parametrize("override", ["orpo.lambda=1e300", "lora.scale=1e39", "train.learning_rate=-1e300",
                                      "objective.beta=3.5e38"])
def test_a_float_past_float32_is_refused_naming_the_key(override):
    """orpo.lambda 1e300 is finite to Python, and passed: as MLX's float32 it is inf, so every step was skipped
    ('non-finite loss or gradient') and the evaluation warned of the held-out pairs and the model's dtype; lora.scale
    1e300 trained an adapter whose outputs are NaN. float32's largest, 3.4e38, passes."""
    key, value = override.split("=")
    extra = ["objective.kind=dpo"] if key == "objective.beta" else []
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.demo_pairs=1", *extra, override])
    assert str(err.value) == (f"command line: key '{key}' must be a finite float32 number (MLX computes in float32, "
                              f"whose largest is 3.4e+38); got {float(value)}")
    cfg = load_config(None, ["data.demo_pairs=1", *extra, f"{key}=3.4e38"])
    assert getattr(getattr(cfg, key.split(".")[0]), config.ALIASES.get(key.split(".")[1], key.split(".")[1])) == 3.4e38


@pytest.mark.parametrize("override", ["distributed.collective_timeout_s=1e300", "engine.memory_budget_gb=1e39",
                                      "train.chosen_logps_drop_warn=1e39", "orpo.lambda_epsilon=1e39",
                                      "orpo.lambda_stop_drop=1e39"])
def test_a_float_only_python_reads_is_not_held_to_float32(override):
    """The float32 limit refused distributed.collective_timeout_s 1e300 ('MLX computes in float32'), a watchdog's
    seconds that a thread waits (no limit in practice: test_a_watchdog_longer_than_a_thread_can_wait_waits), and
    the other keys only Python reads: GiB, thresholds compared in Python. Past float32 they are no inf."""
    key, value = override.split("=")
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, ["data.demo_pairs=1", override]), section), name) == float(value)
    guard = load_config(None, ["data.demo_pairs=1", "train.eval_every=1", "train.keep_best=eval/loss",
                               "train.keep_best_guard=1e39"])
    assert guard.train.keep_best_guard == 1e39


def test_a_non_finite_float_in_a_yaml_file_is_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  demo_pairs: 4\ntrain:\n  learning_rate: .nan\n")
    with pytest.raises(ConfigError, match=re.escape(f"{f}: key 'train.learning_rate' must be a finite number; got nan")):
        load_config(str(f))


@pytest.mark.parametrize("override, section, key, value", [
    ("train.output_dir=runs/a #b", "train", "output_dir", "runs/a #b"),  # YAML would drop " #b" as a comment
    ("data.train=my #1.jsonl", "data", "train", "my #1.jsonl"),
    ("train.output_dir=2024", "train", "output_dir", "2024"),  # YAML: the int 2024
    ("model.path=models/x: v2", "model", "path", "models/x: v2"),  # YAML: a mapping
    ("data.valid=yes", "data", "valid", "yes"),  # YAML 1.1: True
    ("model.path=null", "model", "path", "null"),  # a required str: a file named null
    ("data.valid=null", "data", "valid", None), ("data.valid=~", "data", "valid", None),
    ("data.valid=", "data", "valid", None),
    ("train.steps=9", "train", "steps", 9), ("lora.keys=[self_attn.q_proj]", "lora", "keys", ["self_attn.q_proj"]),
    ("data.fields={prompt: q}", "data", "fields", {"prompt": "q"}), ("train.progress=false", "train", "progress", False),
])
def test_a_str_key_takes_the_override_text_as_given_and_other_keys_read_yaml(override, section, key, value):
    cfg = load_config(None, ["data.demo_pairs=0", "data.train=x.jsonl", override])
    assert getattr(getattr(cfg, section), key) == value


def test_an_empty_override_of_a_required_str_key_is_refused():
    with pytest.raises(ConfigError, match=r"^command line: key 'train.output_dir' is empty; give it a value$"):
        load_config(None, ["data.demo_pairs=1", "train.output_dir="])
    with pytest.raises(ConfigError, match=r"^command line: key 'train.steps' is empty; give it a value$"):
        load_config(None, ["data.demo_pairs=1", "train.steps="])


def test_an_empty_yaml_value_reads_as_an_empty_override(tmp_path):
    """YAML's '' was taken as given: train.output_dir '' trained into the working folder."""
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  demo_pairs: 4\ntrain:\n  output_dir: ''\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert str(err.value) == f"{f}: key 'train.output_dir' is empty; give it a value"
    f.write_text("data:\n  demo_pairs: 4\n  valid: ''\n  chat_template: ''\ntrain:\n  resume: ''\n")
    cfg = load_config(str(f))  # null where the key may be null, as --data.valid '' is
    assert (cfg.data.valid, cfg.data.chat_template, cfg.train.resume) == (None, None, None)


@pytest.mark.parametrize("text, message", [
    ("train:\n  steps: 5\ndata:\n  demo_pairs: 8\ntrain:\n  learning_rate: 0.001\n",
     "line 5: key 'train' repeated (first at line 1)"),  # PyYAML kept the second train:, dropping steps: 5
    ("data:\n  demo_pairs: 8\n  # a comment\n  demo_pairs: 9\n", "line 4: key 'demo_pairs' repeated (first at line 2)"),
    ("data: {demo_pairs: 8, demo_pairs: 8}\n", "line 1: key 'demo_pairs' repeated (first at line 1)"),
])
def test_a_repeated_section_or_key_in_yaml_is_refused_with_both_lines(tmp_path, text, message):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(f'{f}: {message}')}$"):
        load_config(str(f))


def test_yaml_merge_keys_are_not_repeats(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  demo_pairs: 8\ntrain:\n  <<: {steps: 4, seed: 2}\n  steps: 3\n")
    assert (load_config(str(f)).train.steps, load_config(str(f)).train.seed) == (3, 2)


def test_a_keys_python_name_is_not_a_second_spelling(tmp_path):
    """``orpo.lambda`` is the key (``lam`` is its Python name): ``lam`` is refused, so ``lambda`` and ``lam``
    in one section cannot repeat the key silently."""
    path = tmp_path / "dup.yaml"
    path.write_text("orpo:\n  lambda: 0.2\n  lam: 0.3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'orpo.lam' \(write 'orpo.lambda'\)"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="unknown key 'orpo.lam'"):
        load_config(None, ["orpo.lam=0.3", "data.demo_pairs=4"])
    assert load_config(None, ["orpo.lambda=0.3", "data.demo_pairs=4"]).orpo.lam == 0.3


def test_dtrain_config_lists_another_objectives_keep_best_metrics_without_data(capsys):
    """README: the metrics keep_best accepts depend on objective.kind (`dtrain config` lists them);
    `dtrain config --objective.kind sft` stopped at "set 'data.train'" instead, which only a run needs."""
    assert main(["config", "--objective.kind", "sft"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("  keep_best: "))
    assert line.endswith("[null | eval/loss | eval/nll_loss]")
    assert main(["train", "--objective.kind", "sft"]) == 2  # a run still needs its data
    assert "set 'data.train'" in capsys.readouterr().err


def test_a_config_path_under_tilde_is_read_from_the_home_folder(tmp_path, monkeypatch):
    """`dtrain train --config=~/job.yaml` (where the shell expands no ~) said the file was not found."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "job.yaml").write_text("data: {demo_pairs: 4}\ntrain: {steps: 7}\n")
    assert load_config("~/job.yaml").train.steps == 7


def test_a_folder_given_as_the_config_is_named_so(tmp_path, capsys):
    """It said "config file not found (it is a directory)"; a missing file keeps "config file not found"."""
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path))
    assert str(err.value) == f"{tmp_path}: is a directory, not a config file"
    assert main(["train", "-c", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {tmp_path}: is a directory, not a config file\n"
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "job.yaml"))
    assert str(err.value) == f"{tmp_path / 'job.yaml'}: config file not found"


@pytest.mark.parametrize("argv", [["config", "-c", ""], ["config", "--config="], ["train", "-c", ""],
                                  ["data", "check", "p.jsonl", "--config="], ["launch", "--dry-run", ""]])
def test_an_empty_config_path_is_named_so(argv, capsys):
    """`dtrain config -c ''` printed the defaults as if no -c were given, while `dtrain train -c ''` said
    ": is a directory, not a config file" (the empty path is the working folder)."""
    from dtrain.launch.main import main as launch

    assert (launch(argv[1:]) if argv[0] == "launch" else main(argv)) == 2
    captured = capsys.readouterr()
    prefix = "launch" if argv[0] == "launch" else "dtrain"
    assert (captured.out, captured.err) == ("", f"{prefix}: error: the config file path is empty (''); give a YAML file\n")


LONG = "x" * 300  # a file name past the file system's 255 bytes: stat() fails with ENAMETOOLONG


@pytest.mark.parametrize("argv", [["train", "-c", LONG], ["config", f"--config={LONG}"],
                                  ["data", "check", "p.jsonl", "-c", LONG], ["launch", "--dry-run", LONG]])
def test_a_config_path_too_long_for_the_file_system_is_one_line(argv, capsys):
    """`dtrain train -c <300 characters>` ended in OSError's traceback ("File name too long")."""
    from dtrain.launch.main import main as launch

    assert (launch(argv[1:]) if argv[0] == "launch" else main(argv)) == 2
    prefix = "launch" if argv[0] == "launch" else "dtrain"
    assert capsys.readouterr().err == f"{prefix}: error: {LONG[:80]}...: not a usable config file path: File name too long\n"


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """train.output_dir, train.resume and train.init_adapter '~/x' were read as a folder named '~' in the
    working folder (data.train and model.path expand it)."""
    from fixtures_launch import make_model_folder

    model = make_model_folder(tmp_path / "model")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    common = ["train", "--model.path", str(model), "--model.dtype", "float32", "--lora.rank", "2",
              "--data.demo_pairs", "8", "--data.max_length", "64", "--data.max_prompt_length", "32",
              "--train.global_batch_pairs", "2", "--train.micro_batch_pairs", "2", "--train.progress", "false"]
    assert main([*common, "--train.steps", "1", "--train.output_dir", "~/a"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*common, "--train.steps", "2", "--train.output_dir", "~/a",
                 "--train.resume", "~/a/checkpoints/step-0000001"]) == 0
    assert f"resumed from {tmp_path}/a/checkpoints/step-0000001 at step 2" in capsys.readouterr().err
    assert main([*common, "--train.steps", "1", "--train.output_dir", "~/b",
                 "--train.init_adapter", "~/a/adapters"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step-0000001", "step-0000002"]
    assert (tmp_path / "b" / "adapters" / "adapters.safetensors").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []
    for key in ("output_dir", "resume", "init_adapter"):
        assert main([*common, "--train.steps", "1", "--train.output_dir", "~/c", f"--train.{key}",
                     "~nosuchuser-dtrain/x"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"dtrain: error: train.{key} ~nosuchuser-dtrain/x: no home folder for ~nosuchuser-dtrain")


@pytest.mark.parametrize("command", [["train"], ["config"], ["data", "check", "pairs.jsonl"]])
@pytest.mark.parametrize("option", ["-c", "--config", "--config=a.yaml", "-h", "--help", "--conf", "-ca.yaml"])
def test_an_override_without_its_value_before_an_option_is_named(command, option, capsys):
    """Overrides are taken out before argparse: `dtrain train --train.steps -c a.yaml` gave train.steps the
    value '-c' and said "unexpected argument 'a.yaml': a config file is given with -c (-c a.yaml)", to a user
    who had given it with -c (before, as for the override at the end: "override --train.steps needs a value").
    argparse also reads --conf (a long option shortened) and -ca.yaml (a short one with its value) as -c."""
    assert main([*command, "--train.steps", option, "a.yaml"]) == 2
    assert capsys.readouterr().err == "dtrain: error: override --train.steps needs a value\n"
    from dtrain.cli import OPTIONS, _parser

    subs = _parser()._subparsers._group_actions[0].choices
    parsers = [subs["train"], subs["config"], subs["data"]._subparsers._group_actions[0].choices["check"]]
    assert {s for p in parsers for a in p._actions for s in a.option_strings} == set(OPTIONS)


@pytest.mark.parametrize("argv, named", [
    (["config", "--train.output_dir", "--train.steps=3"], "--train.output_dir"),
    (["config", "--train.output_dir", "--train.steps", "3"], "--train.output_dir"),
    (["train", "--train.steps", "--train.output_dir=runs/x", "-c", "a.yaml"], "--train.steps"),
    (["data", "check", "p.jsonl", "--data.valid", "--data.split", "test"], "--data.valid"),
])
def test_an_override_without_its_value_before_another_override_is_named(argv, named, capsys):
    """`dtrain config --train.output_dir --train.steps=3` printed train.output_dir '--train.steps=3' and
    train.steps 100: the next override was taken as the value, and its own setting dropped silently."""
    assert main(argv) == 2
    assert capsys.readouterr().err == f"dtrain: error: override {named} needs a value\n"


@pytest.mark.parametrize("overrides, lines", [
    # the segmented engine's keys under the reference engine
    (["engine.kind=reference", "engine.head_chunk_tokens=512", "engine.compile=true"],
     ["'engine.head_chunk_tokens' is 512 but engine.kind reference does not read it",
      "'engine.compile' is True but engine.kind reference does not read it"]),
    # kind auto sizes the ranges itself; under kind segmented the key is read
    (["engine.segment_layers=4"], ["'engine.segment_layers' is 4 but engine.kind auto (it sizes the ranges itself) "
                                   "does not read it"]),
    (["engine.kind=segmented", "engine.segment_layers=4", "engine.head_chunk_tokens=512"], []),
    # the controller's keys under a static schedule, lambda under an adaptive one, each law's own key
    (["orpo.lambda_max=0.3", "orpo.lambda_kd=1.0"],
     ["'orpo.lambda_max' is 0.3 but orpo.lambda_schedule static does not read it",
      "'orpo.lambda_kd' is 1.0 but orpo.lambda_schedule static does not read it"]),
    (["orpo.lambda_schedule=adaptive", "train.eval_every=5", "orpo.lambda=0.2", "orpo.lambda_kd=1.0",
      "orpo.lambda_max=0.3"],
     ["'orpo.lambda_kd' is 1.0 but orpo.lambda_law aimd does not read it",
      "'orpo.lambda' is 0.2 but orpo.lambda_schedule adaptive (lambda starts at orpo.lambda_min) does not read it"]),
    (["orpo.lambda_schedule=adaptive", "train.eval_every=5", "orpo.lambda_law=pd", "orpo.lambda_backoff=0.7",
      "orpo.lambda_kd=1.0"],
     ["'orpo.lambda_backoff' is 0.7 but orpo.lambda_law pd does not read it"]),
    # a constant learning rate decays to no floor
    (["train.schedule=constant", "train.min_lr_ratio=0.5"],
     ["'train.min_lr_ratio' is 0.5 but train.schedule constant does not read it"]),
    # generated demo pairs are standard rows of no split; a seed of no demo pairs generates nothing
    (["data.format=openai", "data.fields={prompt: q}", "data.split=test"],
     ["'data.format' is 'openai' but data.demo_pairs (generated standard rows) does not read it",
      "'data.fields' is {'prompt': 'q'} but data.demo_pairs (generated standard rows) does not read it",
      "'data.split' is 'test' but data.demo_pairs (generated standard rows) does not read it"]),
    (["data.demo_pairs=0", "data.train=x.jsonl", "data.demo_seed=3"],
     ["'data.demo_seed' is 3 but data.demo_pairs 0 does not read it"]),
    # values equal to the defaults say nothing
    (["engine.kind=reference", "engine.head_chunk_tokens=0", "orpo.lambda=0.1"], []),
])
def test_keys_another_key_leaves_unread_are_named(overrides, lines):
    """A key set away from its default that another key's value makes unread was silently ignored:
    engine.segment_layers 4 under the default engine.kind auto recomputed nothing the user asked for, nor did
    data.format openai or a data.fields mapping with demo pairs read their rows otherwise."""
    from dtrain.config_checks import unread_keys

    assert unread_keys(load_config(None, ["data.demo_pairs=1", *overrides])) == [f"{x}: it has no effect" for x in lines]


def test_shipped_configs_set_no_unread_key():
    from dtrain.config_checks import unread_keys

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert unread_keys(load_config(str(path), ["data.train=x.jsonl", "data.demo_pairs=0"])) == [], path.name


def test_data_template_date_is_a_day_from_yaml_or_the_command_line(tmp_path):
    """YAML reads ``2024-07-26`` as a date, the command line as text: both are the day; another text is refused."""
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  template_date: 2024-07-26\n")
    assert load_config(str(path), need_data=False).data.template_date == "2024-07-26"
    assert load_config(None, ["data.template_date=2024-07-26"], need_data=False).data.template_date == "2024-07-26"
    for bad in ("26 Jul 2024", "2024-7-26", "2024-02-30"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"data.template_date={bad}"], need_data=False)
        assert str(err.value) == ("command line: key 'data.template_date' must be a day written YYYY-MM-DD (e.g. "
                                  f"2024-07-26), got {bad!r}")
