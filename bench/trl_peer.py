"""TRL's ORPOTrainer (PyTorch, one GPU) on the same pairs and settings as dtrain: pairs/s and peak memory.

    python3 bench/trl_peer.py --data pairs.jsonl --model smollm2-f32/ --batch 8 --steps 30 --dtype float32
    python3 bench/trl_peer.py --data pairs.jsonl --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16

The side-by-side peer of ``bench/peer.py --trl-python`` (which runs this file in
the GPU machine's PyTorch Python); it runs alone too. It needs torch,
transformers, peft, datasets and TRL 1.16 (``trl.experimental.orpo``), imported
only after the arguments are read, so ``--help`` works without them.

- Pairs: dtrain's JSONL in the OpenAI preference format (``input.messages``,
  ``preferred_output``, ``non_preferred_output``), turned into TRL's
  conversational preference rows (``prompt`` messages, ``chosen`` and
  ``rejected`` assistant messages); TRL applies the tokenizer's chat template.
  TRL's ORPO has no prompt limit (a prompt that fills ``max_length`` leaves an
  empty completion and trains to NaN), so pairs whose templated prompt exceeds
  ``--max-prompt-length`` tokens are dropped and counted.
- Model: an HF/mlx-lm folder (``config.json`` + safetensors, e.g. ``dtrain
  convert``'s float32 SmolLM2), or a ``.gguf`` file (transformers dequantizes
  it; the plain model is rebuilt from its config, since the trainer refuses a
  model marked "quantized with GGUF"), in ``--dtype``. TF32 is off.
- LoRA (PEFT): ``--lora-rank``, ``--lora-alpha`` (PEFT scales by alpha / rank:
  mlx-lm's scale 20 at rank 8 is alpha 160), ``--target-modules`` (default:
  every linear of a Llama layer, as dtrain and mlx-lm-lora put LoRA on), no dropout.
- Training: ``--steps`` optimizer steps of ``--batch`` pairs (one device, no
  accumulation), constant learning rate, no warm-up, no gradient checkpointing
  (``--gradient-checkpointing`` turns it on), ``beta`` = ORPO's λ, no saving or evaluation.

Timing: each step's seconds are the wall time between consecutive step ends
(``torch.cuda.synchronize`` first), the first from the start of training;
``--skip-first`` steps are left out of the figures (CUDA warm-up). Peak memory:
``torch.cuda.max_memory_allocated``. Prints one JSON line (``{"trl": {...}}``)
with per-step seconds, pairs/s (median step and Σ pairs / Σ s) and the peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="pairs, JSONL in the OpenAI preference format (dtrain's bench data)")
    ap.add_argument("--model", required=True, help="an HF/mlx-lm model folder or a .gguf file")
    ap.add_argument("--max-length", type=int, default=1024, help="TRL max_length: prompt + response tokens per side")
    ap.add_argument("--max-prompt-length", type=int, default=512, help="drop pairs whose prompt is longer")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=160.0, help="PEFT lora_alpha (scale = alpha / rank)")
    ap.add_argument("--target-modules", nargs="+", default=LLAMA_LINEARS)
    ap.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--beta", type=float, default=0.1, help="ORPO λ (TRL's beta)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-first", type=int, default=1, help="steps left out of the figures (warm-up)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--out-dir", default=None, help="the trainer's output_dir (default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.steps <= a.skip_first:
        ap.error(f"--steps {a.steps} leaves no step after --skip-first {a.skip_first}")
    return a


def trl_row(row: dict) -> dict:
    """An OpenAI preference row -> TRL's conversational preference row."""
    return {"prompt": row["input"]["messages"], "chosen": [row["preferred_output"][-1]],
            "rejected": [row["non_preferred_output"][-1]]}


def load_model(path: str, dtype):
    """``(model, tokenizer)`` of a folder or a .gguf file, as a plain (unquantized) model in ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf":
        kw = dict(gguf_file=p.name)
        tokenizer = AutoTokenizer.from_pretrained(p.parent, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(p.parent, dtype=dtype, **kw)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(loaded.state_dict())
        del loaded
    else:
        tokenizer = AutoTokenizer.from_pretrained(p)
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def main(argv=None) -> int:
    a = parse_args(argv)
    import tempfile

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model, tokenizer = load_model(a.model, dtype)
    model.to("cuda")

    rows = [trl_row(json.loads(line)) for line in Path(a.data).read_text(encoding="utf-8").splitlines() if line.strip()]
    prompt_tokens = [len(tokenizer(tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False)["input_ids"]) for r in rows]
    kept = [r for r, n in zip(rows, prompt_tokens) if n <= a.max_prompt_length]
    if len(kept) < a.batch:
        raise SystemExit(f"trl_peer: {len(kept)} pairs of {a.data} fit --max-prompt-length, fewer than --batch {a.batch}")

    step_ends = []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

    out_dir = a.out_dir or tempfile.mkdtemp(prefix="trl-peer-")
    config = ORPOConfig(
        output_dir=out_dir, max_length=a.max_length, beta=a.beta, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1, max_steps=a.steps,
        bf16=a.dtype == "bfloat16", fp16=False, gradient_checkpointing=a.gradient_checkpointing, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="none", seed=a.seed, disable_dropout=True)
    peft = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=0.0, target_modules=a.target_modules,
                      task_type="CAUSAL_LM")
    trainer = ORPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(kept), processing_class=tokenizer,
                          peft_config=peft, callbacks=[Timer()])
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    seconds = [b - e for e, b in zip(step_ends, step_ends[1:])]
    timed = seconds[a.skip_first:]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"tool": "trl", "steps": [{"step": i + 1, "pair": -(i + 1), "seconds": s} for i, s in enumerate(seconds)],
              "pairs_per_step": a.batch, "s_per_step_median": statistics.median(timed),
              "pairs_per_s_median": a.batch / statistics.median(timed), "pairs_per_s_all": a.batch * len(timed) / sum(timed),
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "pairs": len(rows), "dropped_long_prompts": len(rows) - len(kept),
              "losses": losses, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "dtype": a.dtype, "argv": sys.argv[1:]}
    print(json.dumps({"trl": result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
