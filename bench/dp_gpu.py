"""Data parallelism on GPUs (MLX CUDA, nccl backend): 1 rank vs N ranks.

    python bench/dp_gpu.py setup DIR --shape llama-1b --dtype bfloat16 --length 1024 --pairs 64
    python bench/dp_gpu.py run DIR --ranks 1 2 --steps 6 --global-batch 8 [--section.key VALUE ...]

``setup`` writes a random-weight model folder (mlx-lm format) of the named
shape, a word-level tokenizer (one token per word, so lengths are exact) and
``pairs.jsonl`` whose prompt and responses are long enough that
``data.max_length = length`` truncates every side to exactly ``length`` tokens
(half prompt, half response). ``run`` trains the same job through ``./launch``
with 1 rank and with N ranks (``--backend nccl``: one GPU per rank,
NCCL_NVLS_ENABLE=0), then reads each run's TensorBoard scalars and adapter
and prints a markdown table: pairs/s (median over steps after the first),
all-reduce share of step time, peak memory per GPU, and the relative L2
difference of the N-rank adapter from the 1-rank adapter. JSON goes to
``DIR/dp.json``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from prelude import ROOT, add_flags, write_results

SHAPES = {
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                     num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=True, head_dim=64),
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=4096,
                 rope_theta=10000.0, tie_word_embeddings=True),
}
WORDS = 2000  # word-level vocabulary size (ids 4 .. 4 + WORDS)


def setup(args) -> None:
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(args.dir)
    (out / "model").mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[args.shape])
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**config))
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    save_model(out / "model", model)
    save_config(config, config_path=out / "model" / "config.json")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": 4 + i for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    hf.save_pretrained(str(out / "model"))
    rng = random.Random(0)
    words = lambda n: " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))  # noqa: E731
    half = args.length // 2
    with open(out / "pairs.jsonl", "w") as f:
        for _ in range(args.pairs):
            f.write(json.dumps({"prompt": words(half + 8), "chosen": words(half + 8), "rejected": words(half + 8)}) + "\n")
    (out / "setup.json").write_text(json.dumps({"shape": args.shape, "dtype": args.dtype, "length": args.length}))
    print(f"wrote {out}/model ({args.shape}, {args.dtype}) and {args.pairs} pairs of {args.length} tokens per side")


def job_config(d: Path, meta: dict, args, out_dir: Path) -> Path:
    cfg = d / f"job-{out_dir.name}.yaml"
    cfg.write_text(
        f"model: {{path: {d / 'model'}, dtype: {meta['dtype']}}}\n"
        "lora: {rank: 16, scale: 20.0}\n"
        f"data: {{train: {d / 'pairs.jsonl'}, valid_fraction: 0.0, prompt_template: raw, append_eos: false,"
        f" max_length: {meta['length']}, max_prompt_length: {meta['length'] // 2}}}\n"
        f"engine: {{kind: {args.engine}, segment_layers: {args.segment_layers}, prefix_sharing: true,"
        f" head_chunk_tokens: {args.head_chunk}}}\n"
        f"train: {{steps: {args.steps}, global_batch_pairs: {args.global_batch}, micro_batch_pairs: {args.micro},"
        f" learning_rate: 1.0e-4, grad_clip: 0.0, output_dir: {out_dir}, progress: false, eval_every: 0}}\n"
        "distributed: {collective_timeout_s: 600}\n"
    )
    return cfg


def run(args, extra: list[str]) -> None:
    import numpy as np
    import mlx.core as mx

    from dtrain.run.tracking import read_scalars

    d = Path(args.dir)
    meta = json.loads((d / "setup.json").read_text())
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    rows, adapters = [], {}
    for n in args.ranks:
        out_dir = d / f"run-{n}rank"
        cfg = job_config(d, meta, args, out_dir)
        cmd = [sys.executable, str(ROOT / "launch"), str(cfg), *extra]
        if n > 1:
            cmd[2:2] = ["--backend", args.backend, "-n", str(n)]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env=env, cwd=ROOT)
        if proc.returncode != 0:
            rows.append({"ranks": n, "error": f"exit {proc.returncode}"})
            continue
        s = read_scalars(next((out_dir / "tb").iterdir()))
        later = lambda tag: [v for step, v in s[tag] if step > 1]  # noqa: E731  (step 1 compiles kernels)
        step_s = statistics.median(later("perf/step_seconds"))
        reduce_s = statistics.median(later("perf/allreduce_seconds"))
        rows.append({"ranks": n, "pairs_per_second": args.global_batch / step_s, "step_seconds": step_s,
                     "allreduce_seconds": reduce_s, "allreduce_share": reduce_s / step_s,
                     "peak_memory_gb_rank0": max(v for _, v in s["peak_memory_gb"]),
                     "losses": [v for _, v in s["loss"]]})
        adapters[n] = mx.load(str(out_dir / "adapters" / "adapters.safetensors"))
    base = adapters.get(min(adapters)) if adapters else None
    for row in rows:
        if base is not None and row["ranks"] in adapters:
            a = np.concatenate([np.array(adapters[row["ranks"]][k].astype(mx.float32)).ravel() for k in sorted(base)])
            b = np.concatenate([np.array(base[k].astype(mx.float32)).ravel() for k in sorted(base)])
            row["adapter_rel_l2_vs_1rank"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    one = next((r for r in rows if r["ranks"] == 1 and "error" not in r), None)
    print(f"\n{meta['shape']} {meta['dtype']}, {meta['length']} tokens per side, global batch {args.global_batch}, "
          f"engine {args.engine}\n")
    print("| ranks | pairs/s | speed-up | step s | all-reduce s | all-reduce share | peak GB (rank 0) | adapter rel. L2 vs 1 rank |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['ranks']} | {r['error']} |||||||")
            continue
        up = r["pairs_per_second"] / one["pairs_per_second"] if one else float("nan")
        print(f"| {r['ranks']} | {r['pairs_per_second']:.2f} | {up:.2f} | {r['step_seconds']:.3f} | "
              f"{r['allreduce_seconds']:.4f} | {100 * r['allreduce_share']:.1f}% | {r['peak_memory_gb_rank0']:.1f} | "
              f"{r.get('adapter_rel_l2_vs_1rank', float('nan')):.2e} |")
    write_results("dp", {"setup": meta, "args": vars(args), "rows": rows}, d, stamp=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup")
    s.add_argument("dir")
    s.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.add_argument("--length", type=int, default=1024)
    s.add_argument("--pairs", type=int, default=64)
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    r.add_argument("--backend", default="nccl", help="nccl on GPUs; ring to try it on a CPU")
    add_flags(r, steps=6)
    r.add_argument("--global-batch", type=int, default=8)
    r.add_argument("--micro", type=int, default=4)
    r.add_argument("--engine", default="segmented", choices=["segmented", "reference"])
    r.add_argument("--segment-layers", type=int, default=4)
    r.add_argument("--head-chunk", type=int, default=1024)
    args, extra = p.parse_known_args()
    if args.cmd == "setup":
        setup(args)
    else:
        run(args, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
