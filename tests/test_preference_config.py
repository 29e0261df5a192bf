"""configs/preference.yaml: it loads, and every key not marked otherwise shows the true default."""

import re
from pathlib import Path

import yaml

from dtrain.config import Config, load_config, to_dict

PATH = Path(__file__).resolve().parents[1] / "configs" / "preference.yaml"


def marked_not_default() -> set:
    """``(section, key)`` of the lines whose comment says "not the default"."""
    out, section = set(), None
    for line in PATH.read_text(encoding="utf-8").splitlines():
        if re.match(r"^[a-z_]+:", line):
            section = line.split(":")[0]
        m = re.match(r"^  ([a-z_]+):", line)
        if m and "not the default" in line:
            out.add((section, m.group(1)))
    return out


def test_preference_config_loads_and_its_unmarked_values_are_the_defaults():
    cfg = load_config(str(PATH))
    assert cfg.data.train == "PATH/TO/pairs.jsonl" and cfg.train.learning_rate == 5e-4
    written, defaults = yaml.safe_load(PATH.read_text(encoding="utf-8")), to_dict(Config())
    differ = {(s, k) for s, keys in written.items() for k, v in keys.items() if defaults[s][k] != v}
    assert differ == marked_not_default() == {
        ("data", "train"), ("orpo", "lambda_schedule"),
        ("train", "eval_every"), ("train", "keep_best"), ("train", "keep_best_guard"), ("train", "output_dir")}
