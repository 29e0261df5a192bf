"""End to end on real input: SmolLM2-135M-Instruct (the demo GGUF) trained with
ORPO on real preference pairs from ../shared/data, through `dtrain train`."""

import json
import math

import mlx.core as mx
import pytest

from dtrain.cli import main
from dtrain.run.tracking import read_scalars


@pytest.mark.parametrize("engine", ["reference", "segmented"])
def test_smollm2_on_real_pairs(tmp_path, shared_data, demo_path, capsys, engine):
    out = tmp_path / "run"
    status = main([
        "train", "--model.path", str(demo_path), "--data.train", str(shared_data / "orca_dpo_pairs_validation.jsonl"),
        "--data.max_length", "160", "--data.max_prompt_length", "96", "--data.valid_fraction", "0.01",
        "--train.steps", "3", "--train.global_batch_pairs", "2", "--train.micro_batch_pairs", "2",
        "--train.learning_rate", "5e-4", "--train.eval_pairs", "2", "--train.output_dir", str(out),
        "--train.progress", "false", "--engine.kind", engine, "--engine.segment_layers", "10",
        "--engine.prefix_sharing", "true", "--engine.head_chunk_tokens", "64",
    ])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "284 rows" in err or "train /" in err
    run_dir = next((out / "tb").iterdir())
    scalars = read_scalars(run_dir)
    losses = [v for _, v in scalars["loss"]]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for _, v in scalars["eval/loss"])
    weights = mx.load(str(out / "adapters" / "adapters.safetensors"))
    # lora_b starts at zero in mlx-lm: a non-zero one means training moved the adapter
    moved = [k for k, v in weights.items() if k.endswith("lora_b") and mx.abs(v).max().item() > 0]
    assert len(moved) == len([k for k in weights if k.endswith("lora_b")]) > 0
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 30


def test_demo_adapter_changes_generations_through_mlx_lm(tmp_path, demo_path):
    """Train the demo job briefly; the adapter, reloaded by mlx-lm into a fresh
    copy of the model, makes greedy decoding answer in the trained format."""
    from mlx_lm.generate import generate
    from mlx_lm.tuner.utils import load_adapters

    from dtrain.config import load_config
    from dtrain.models import load_model
    from dtrain.run.trainer import train

    cfg = load_config("configs/demo.yaml", [f"model.path={demo_path}", f"train.output_dir={tmp_path}",
                                            "train.steps=10", "train.eval_every=0", "train.progress=false",
                                            "data.valid_fraction=0.0", "data.demo_pairs=80"])
    result = train(cfg)
    fresh = load_model(str(demo_path))
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    prompt = fresh.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    before = generate(fresh.model, fresh.tokenizer, prompt, max_tokens=12)
    load_adapters(fresh.model, str(result.adapter_dir))
    after = generate(fresh.model, fresh.tokenizer, prompt, max_tokens=12)
    assert not before.startswith("ANSWER:"), before
    assert after.startswith("ANSWER:"), after
