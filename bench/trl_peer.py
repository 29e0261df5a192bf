"""TRL's ORPOTrainer or DPOTrainer (PyTorch, one GPU) on the same pairs and settings as dtrain: pairs/s and peak memory.

    python3 bench/trl_peer.py --data pairs.jsonl --model smollm2-f32/ --batch 8 --steps 30 --dtype float32
    python3 bench/trl_peer.py --data pairs.jsonl --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype bfloat16
    python3 bench/trl_peer.py --mode dpo --data train.jsonl --valid valid.jsonl --model M.gguf --steps 100 \
        --lr 5e-6 --beta 0.1 --schedule cosine --warmup-steps 10 --eval-every 20     # bench/objectives.py

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
  accumulation), constant learning rate and no warm-up unless ``--schedule cosine``
  (``cosine_with_min_lr`` to ``--min-lr-ratio`` of the peak after ``--warmup-steps``
  linear steps, as dtrain's cosine), no gradient checkpointing
  (``--gradient-checkpointing`` turns it on), ``beta`` = ORPO's λ (DPO's β), no saving.
- ``--mode dpo``: TRL's ``DPOTrainer`` (``loss_type`` ``--loss-type``) with
  ``precompute_ref_log_probs``: the reference log-probs (the model with the LoRA
  off) are computed once per pair before training, as dtrain's DPO does; the
  seconds that takes are ``reference_s`` (train and held-out pairs).
- ``--valid FILE``: held-out pairs (the same prompt filter), evaluated before the
  first step and every ``--eval-every`` steps and at the end (``evals``: step ->
  TRL's ``eval_*`` metrics); evaluation time is left out of the step seconds.

Timing: each step's seconds are the wall time between consecutive step ends
(``torch.cuda.synchronize`` first), the first from the start of training, less
any evaluation in between (a step is timed from the end of an evaluation);
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
    ap.add_argument("--beta", type=float, default=0.1, help="ORPO λ (TRL's beta); DPO's β")
    ap.add_argument("--mode", default="orpo", choices=["orpo", "dpo"], help="ORPOTrainer or DPOTrainer")
    ap.add_argument("--loss-type", default="sigmoid", help="DPO loss_type")
    ap.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                    help="cosine: cosine_with_min_lr to --min-lr-ratio after --warmup-steps (dtrain's cosine)")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--valid", default=None, help="held-out pairs (same format), evaluated at step 0 and every --eval-every")
    ap.add_argument("--eval-every", type=int, default=0, help="steps between evaluations of --valid (0 = start and end)")
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

    if a.mode == "dpo":
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model, tokenizer = load_model(a.model, dtype)
    model.to("cuda")

    def read(path):
        rows = [trl_row(json.loads(line)) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        prompt_tokens = [len(tokenizer(tokenizer.apply_chat_template(r["prompt"], tokenize=False,
                                                                     add_generation_prompt=True),
                                       add_special_tokens=False)["input_ids"]) for r in rows]
        return rows, [r for r, n in zip(rows, prompt_tokens) if n <= a.max_prompt_length]

    rows, kept = read(a.data)
    if len(kept) < a.batch:
        raise SystemExit(f"trl_peer: {len(kept)} pairs of {a.data} fit --max-prompt-length, fewer than --batch {a.batch}")
    valid_rows, valid = read(a.valid) if a.valid else ([], [])

    seconds, mark = [], [0.0]  # step seconds; mark: the end of the last step, evaluation or the start

    def now():
        torch.cuda.synchronize()
        return time.perf_counter()

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            mark[0] = now()

        def on_step_end(self, args, state, control, **kw):
            t = now()
            seconds.append(t - mark[0])
            mark[0] = t

    out_dir = a.out_dir or tempfile.mkdtemp(prefix="trl-peer-")
    schedule = ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": a.min_lr_ratio}}
                if a.schedule == "cosine" else {"lr_scheduler_type": "constant"})
    extra = {"loss_type": [a.loss_type], "precompute_ref_log_probs": True} if a.mode == "dpo" else {}
    evals_on = {"eval_strategy": "steps", "eval_steps": a.eval_every} if valid and a.eval_every else {"eval_strategy": "no"}
    config = Config(
        output_dir=out_dir, max_length=a.max_length, beta=a.beta, learning_rate=a.lr, **schedule,
        warmup_steps=a.warmup_steps, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
        gradient_accumulation_steps=1, max_steps=a.steps, bf16=a.dtype == "bfloat16", fp16=False,
        gradient_checkpointing=a.gradient_checkpointing, logging_steps=1, save_strategy="no", **evals_on,
        report_to="none", seed=a.seed, disable_dropout=True, **extra)
    peft = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=0.0, target_modules=a.target_modules,
                      task_type="CAUSAL_LM")
    reference_s = [0.0]
    if a.mode == "dpo":  # time the reference pass (TRL runs it in the trainer's constructor)
        precompute = Trainer._precompute_ref_logps

        def timed_precompute(self, *args, **kw):
            t = now()
            try:
                return precompute(self, *args, **kw)
            finally:
                reference_s[0] += now() - t

        Trainer._precompute_ref_logps = timed_precompute
    torch.cuda.reset_peak_memory_stats()
    t_build = now()
    trainer = Trainer(model=model, args=config, train_dataset=Dataset.from_list(kept),
                      eval_dataset=Dataset.from_list(valid) if valid else None, processing_class=tokenizer,
                      peft_config=peft, callbacks=[Timer()])
    build_s = now() - t_build
    evals, evaluate = {}, trainer.evaluate

    def timed_evaluate(*args, **kw):  # every evaluation: recorded by step, its time left out of the steps
        metrics = evaluate(*args, **kw)
        evals[str(trainer.state.global_step)] = metrics
        mark[0] = now()
        return metrics

    trainer.evaluate = timed_evaluate
    if valid:
        trainer.evaluate()  # step 0
    trainer.train()
    if valid and str(a.steps) not in evals:
        trainer.evaluate()
    timed = seconds[a.skip_first:]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {"tool": "trl", "mode": a.mode, "steps": [{"step": i + 1, "pair": -(i + 1), "seconds": s}
                                                       for i, s in enumerate(seconds)],
              "train_s": sum(seconds), "reference_s": reference_s[0], "trainer_build_s": build_s, "evals": evals,
              "valid_pairs": len(valid), "dropped_long_valid_prompts": len(valid_rows) - len(valid),
              "pairs_per_step": a.batch, "s_per_step_median": statistics.median(timed),
              "pairs_per_s_median": a.batch / statistics.median(timed), "pairs_per_s_all": a.batch * len(timed) / sum(timed),
              "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "pairs": len(rows), "dropped_long_prompts": len(rows) - len(kept),
              "losses": losses, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "dtype": a.dtype, "argv": sys.argv[1:]}
    print(json.dumps({"trl": result}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
