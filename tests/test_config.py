"""Config loading, the demo config, and the README/CI contract."""

import re
from pathlib import Path

import pytest

from dtrain.config import load_config, to_dict
from dtrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_demo_config_loads_and_every_key_is_commented():
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"))
    assert cfg.model.path == "demo" and cfg.data.demo_pairs > 0 and cfg.orpo.lam == 0.1
    keyed = [l for l in (ROOT / "configs" / "demo.yaml").read_text().splitlines() if re.match(r"^\s+\w+:", l)]
    assert keyed and all("#" in l for l in keyed), [l for l in keyed if "#" not in l]


def test_overrides_beat_yaml_and_parse_as_yaml_scalars(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\n  learning_rate: 1e-4\ndata:\n  demo_pairs: 4\n")
    cfg = load_config(str(f), ["train.steps=9", "orpo.lambda=0.5", "lora.keys=[self_attn.q_proj]", "train.resume=null"])
    assert (cfg.train.steps, cfg.train.learning_rate, cfg.orpo.lam) == (9, 1e-4, 0.5)
    assert cfg.lora.keys == ["self_attn.q_proj"] and cfg.train.resume is None
    assert to_dict(cfg)["orpo"]["lambda"] == 0.5


def test_unknown_key_names_the_key_and_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown key 'orpo.beta' \(known in 'orpo': lambda, nll_scope\)"):
        load_config(None, ["data.demo_pairs=1", "orpo.beta=0.1"])


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [l for l in block.strip().splitlines() if l.strip()]
    assert len(lines) == 2, lines
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[1] in ci
    assert "configs/demo.yaml" in lines[0]


def test_data_file_and_demo_pairs_together_is_an_error():
    with pytest.raises(ConfigError, match=r"both 'data.train' \(x.jsonl\) and 'data.demo_pairs' \(600\) are set; "
                                          r"use one .*--data.demo_pairs 0"):
        load_config(str(ROOT / "configs" / "demo.yaml"), ["data.train=x.jsonl"])
    assert load_config(str(ROOT / "configs" / "demo.yaml"), ["data.train=x.jsonl", "data.demo_pairs=0"]).data.train == "x.jsonl"
