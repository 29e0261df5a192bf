"""Pairs per second and peak memory against mlx-lm-lora's ORPO (and TRL's ORPOTrainer), on real pairs.

    python bench/peer.py --pairs-per-run 5 --rounds 2                      # CPU: SmolLM2, float32
    python bench/peer.py --model llama3.2-1b --dtype bfloat16 --synthetic-length 4096 --max-length 4096 \
        --no-peer-fuse --peer-python python3                              # GPU: random weights, synthetic pairs
    python bench/peer.py --recommended --rounds 1 --no-peer-fuse --skip-first \
        --peer-python python3 --trl-python python3 --trl-model SmolLM2-135M-Instruct.Q4_1.gguf   # GPU: side by side

``--recommended``: configs/preference.yaml's batch and settings (8 pairs per step, learning
rate 5e-4, at most 512 prompt tokens, 1,024 per side; 240 pairs = 30 steps per tool),
``dtrain preference`` (that config's engine) against mlx-lm-lora with ``--batch-size 8`` in
ORPO mode and, with ``--trl-python``, TRL's ORPOTrainer through ``bench/trl_peer.py`` (read its
docstring: it drops pairs whose prompt exceeds the prompt limit, which TRL's ORPO cannot cut).
With more than one pair per step every tool's figures are per step (pairs/s = pairs per step ÷
step seconds), and the "pair by pair" ratio compares step k of each tool.

By default both tools train the same float32 SmolLM2-135M-Instruct folder (``dtrain
convert`` of the demo GGUF, dequantized), on the same orca pairs, with LoRA
rank 8, scale 20 (mlx-lm's ``scale``; mlx-lm-lora passes ``lora_parameters``
to the same ``linear_to_lora_layers``, and has no separate alpha) on every
linear layer of all 30 layers, at most 1024 tokens per sequence, one pair per
step, learning rate 2e-4, ORPO lambda (mlx-lm-lora's ``beta``) 0.1.

Each round writes ``--pairs-per-run`` consecutive pairs to a temporary folder
(outside the repository) and runs, in alternating order (A B C, then C B A),
``dtrain train`` with each engine variant and ``mlx_lm_lora.train
--train-mode orpo``; each run trains one step per pair. Per-pair seconds:
dtrain's ``1 / pairs_per_second`` from TensorBoard (the step's wall time),
mlx-lm-lora's from its ``--steps-per-report 1`` lines, as the step's
response tokens (recorded) ÷ its printed ``tok/s`` (``1 / it/s`` has only
three decimals); it resets its timer after validation, so neither tool's
figure includes evaluation or saving. The
ratio is taken pair by pair: dtrain's step on a pair against mlx-lm-lora's
iterations on the same pair (it draws pairs at random with replacement, so
some pairs are drawn twice and some never).

mlx-lm-lora runs in its own venv (``--peer-python``), with OpenBLAS preloaded
as dtrain preloads it, through this file's ``--child`` mode, which (1) adds
``max_recommended_working_set_size`` to ``mx.device_info()`` when the backend
lacks it (5.10.2 reads it unconditionally; the Linux CPU build has no such
key), (2) records which pair each training iteration drew and (3) times the
fused-model save it does at the end (``fuse: true`` is its default). Nothing
else is changed.

``--model llama3.2-1b`` / ``llama3.1-8b`` (for a GPU) write a random-weight
mlx-lm folder of that shape in ``--dtype`` once (in dtrain's cache folder), with
SmolLM2's tokenizer (its ids fit the 128,256-row vocabulary), and both tools
train that folder. ``--synthetic-length L`` replaces the orca pairs (< 2k tokens) with pairs of
random common words of about L tokens per sequence, so long lengths are exercised. A tool
that fails (e.g. out of GPU memory) is recorded with its last lines and the benchmark goes
on; ``--skip-first`` leaves each run's first step (GPU kernel compilation) out of the figures.
Peak memory is ``mx.get_peak_memory`` as each tool logs it; max RSS comes from
``/usr/bin/time -v`` when it exists.

Prints a markdown table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prelude import ORCA, RESULTS, SMOLLM2_F32 as MODEL_DIR, add_flags, need_file

TRL_PEER = Path(__file__).with_name("trl_peer.py")  # run in TRL's own Python
# one range of all layers and an unchunked head: one pass, nothing recomputed (fastest when it fits)
SINGLE = {"kind": "segmented", "segment_layers": 0, "prefix_sharing": True, "head_chunk_tokens": 0}
VARIANTS = {
    "dtrain reference": {"kind": "reference"},
    # ranges of round(sqrt(layers)) layers (5 for SmolLM2); `auto` would pick one 30-layer range there
    "dtrain segmented+prefix+chunked": {"kind": "segmented", "segment_layers": "sqrt", "prefix_sharing": True,
                                        "head_chunk_tokens": 512},
    "dtrain one range+prefix": SINGLE,
    # the same with one attention call over both rows padded to the longer (engine.attention_groups auto on a GPU)
    "dtrain one range+prefix one attention call": {**SINGLE, "attention_groups": 1},
    # the same with MLX's softmax, sigmoid and fused attention (engine.kernels auto is dtrain's own on the CPU)
    "dtrain one range+prefix mlx kernels": {**SINGLE, "kernels": "mlx"},
    # the default: plan per length bucket from the memory model, buckets and mx.compile on a GPU
    "dtrain auto": {"kind": "auto", "prefix_sharing": True},
    "dtrain auto eager": {"kind": "auto", "prefix_sharing": True, "compile": False},
    # the single pass with exact shapes and no compile (the engine as it ran before buckets)
    "dtrain single exact": {**SINGLE, "length_bucket": 0, "compile": False},
    # buckets without compile (what the buckets alone give)
    "dtrain single bucketed": {**SINGLE, "length_bucket": 128, "compile": False},
    # configs/preference.yaml's engine (kind auto: the single pass where it fits engine.memory_budget_gb,
    # else recomputed ranges; packed micro-batches)
    "dtrain preference": {"kind": "auto", "prefix_sharing": True, "head_chunk_tokens": 0},
    # its single pass forced (the config's engine before 2026-12-03), and with each pair padded to the
    # longest of its micro-batch as before issue 26
    "dtrain preference single pass": SINGLE,
    "dtrain preference padded": {**SINGLE, "pack": False},
    # the single pass with dtrain's own attention, softmax and sigmoid (engine.kernels auto is MLX's on a GPU)
    "dtrain preference own kernels": {**SINGLE, "kernels": "dtrain"},
    # its attention as one call over every row padded to the longest (auto on a GPU), or in up to 4 calls over
    # rows grouped by length (auto on the CPU)
    "dtrain preference one attention call": {"kind": "auto", "prefix_sharing": True, "head_chunk_tokens": 0,
                                             "attention_groups": 1},
    "dtrain preference grouped attention": {"kind": "auto", "prefix_sharing": True, "head_chunk_tokens": 0,
                                            "attention_groups": 4},
    # configs/preference.yaml's engine with engine.compile (each layout shape traced once)
    "dtrain preference compiled": {"kind": "auto", "prefix_sharing": True, "head_chunk_tokens": 0, "compile": True},
}
PEER = "mlx-lm-lora"
TRL = "trl ORPOTrainer"
ITER_LINE = re.compile(r"Iter (\d+): loss ([-\d.naif]+),.*?it/s ([\d.]+), tok/s ([\d.]+), peak_mem ([\d.]+)GB")


# ---- the child: mlx-lm-lora, run inside its own venv ----

def child(config: str, record: str) -> None:
    import mlx.core as mx
    import numpy as np

    device_info = mx.device_info

    def with_working_set():  # 5.10.2 calls mx.set_wired_limit(info["max_recommended_working_set_size"])
        info = dict(device_info())
        info.setdefault("max_recommended_working_set_size",
                        info.get("memory_size") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        return info

    mx.device_info = with_working_set
    import mlx_lm_lora.train as cli
    import mlx_lm_lora.trainer.orpo_trainer as orpo

    out = {"drawn": [], "tokens": [], "fuse_s": None}
    batches = orpo.iterate_orpo_batches

    def recording(dataset, batch_size, max_seq_length, train=False):
        for batch in batches(dataset, batch_size, max_seq_length, train):
            if train:  # which pair: the dataset row whose chosen tokens start the batch's row
                row = np.array(batch[0][0]).tolist()
                out["drawn"].append(next((j for j in range(len(dataset))
                                          if list(dataset[j]["chosen"][: len(row)]) == row[: len(dataset[j]["chosen"])]),
                                         -1))
                # the tokens it counts for tok/s (response targets), to time the step from tok/s
                out["tokens"].append(int(np.array(batch[2][:, 1:]).sum() + np.array(batch[3][:, 1:]).sum()))
            yield batch

    orpo.iterate_orpo_batches = recording
    merged = cli.save_pretrained_merged

    def timed_merge(*args, **kwargs):
        t = time.perf_counter()
        result = merged(*args, **kwargs)
        out["fuse_s"] = time.perf_counter() - t
        return result

    cli.save_pretrained_merged = timed_merge
    sys.argv = ["mlx_lm_lora.train", "--config", config]
    try:
        cli.main()
    finally:
        Path(record).write_text(json.dumps(out))


# ---- the parent: this project's venv ----

def smollm2_dir() -> Path:
    """The demo GGUF as a float32 mlx-lm folder (``dtrain convert``, dequantized), converted once."""
    if not MODEL_DIR.exists():
        from dtrain.models import convert_gguf, demo_model_path

        convert_gguf(str(demo_model_path()), str(MODEL_DIR), dequantize=True)
    return MODEL_DIR


def random_model_dir(name: str, dtype: str, layers: int | None, tokenizer_dir: Path | None = None) -> Path:
    """An mlx-lm folder with random weights of ``MODELS[name]``'s shape in ``dtype``
    and SmolLM2's tokenizer files (from ``tokenizer_dir``, else the converted
    demo model), written once in dtrain's cache folder."""
    out = MODEL_DIR.parent / f"bench-{name}{f'-{layers}L' if layers else ''}-{dtype}-random"
    if out.exists():
        return out
    import importlib

    import mlx.core as mx
    from common import DTYPES, MODELS
    from mlx_lm.utils import save_config, save_model

    module, args = MODELS[name]
    args = dict(args, num_hidden_layers=layers or args["num_hidden_layers"])
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(args))
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    save_model(tmp, model)
    save_config(dict(args, eos_token_id=[2], torch_dtype=dtype), tmp / "config.json")
    src = tokenizer_dir or smollm2_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, tmp / f)
    tmp.rename(out)
    return out

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue side "
         "kind head house service friend father power hour game line end member law car city community name").split()


def synthetic_rows(model_dir: Path, n: int, length: int, seed: int) -> list[dict]:
    """``n`` pairs of random common words, about ``length`` tokens per sequence
    (prompt ~ half, each response ~ half, less 48 tokens for the chat template),
    in the OpenAI preference format: for random-weight models at long lengths."""
    import random

    tok = _tokenizer(model_dir)
    rng = random.Random(seed)

    def text(tokens: int) -> str:  # decode the first `tokens` ids of a long random word string
        ids = tok.encode(" ".join(rng.choice(WORDS) for _ in range(tokens + 16)), add_special_tokens=False)
        return tok.decode(ids[:tokens]).strip()

    half = (length - 48) // 2
    return [{"input": {"messages": [{"role": "user", "content": text(half)}]},
             "preferred_output": [{"role": "assistant", "content": text(half)}],
             "non_preferred_output": [{"role": "assistant", "content": text(half)}]} for _ in range(n)]


def orca_rows(path: str, start: int, n: int | None) -> list[dict]:
    """Rows ``start`` to ``start + n`` (None: to the end) of a JSONL file, blank lines skipped."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[start:] if n is None else rows[start: start + n]


def as_peer_row(row: dict) -> dict:
    """OpenAI preference row -> mlx-lm-lora's ORPO fields (system, prompt, chosen, rejected)."""
    messages = row["input"]["messages"]
    system = [m["content"] for m in messages if m["role"] == "system"]
    user = [m["content"] for m in messages if m["role"] == "user"]
    out = {"prompt": user[-1], "chosen": row["preferred_output"][-1]["content"],
           "rejected": row["non_preferred_output"][-1]["content"]}
    return {"system": system[0], **out} if system else out


class RunFailed(RuntimeError):
    """A tool's run exited non-zero (e.g. out of GPU memory): recorded, the benchmark goes on."""


def timed(cmd: list, env: dict, log: Path) -> tuple[float, float, str]:
    """Run ``cmd`` (under /usr/bin/time -v when it exists); returns (wall s, max RSS GB or NaN, stdout + stderr)."""
    t = time.perf_counter()
    wrap = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []
    proc = subprocess.run([*wrap, *cmd], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    text = proc.stdout + proc.stderr
    log.write_text(text)
    if proc.returncode != 0:
        own = text.split("\tCommand being timed:")[0].strip().splitlines()  # without /usr/bin/time's report
        raise RunFailed(f"{' '.join(map(str, cmd[-3:]))} failed ({proc.returncode}): {' | '.join(own[-3:])[-500:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return wall, int(rss.group(1)) / 1e6 if rss else float("nan"), text


def lora_b_change(path: Path) -> dict:
    """``lora_b`` starts at zero in mlx-lm's LoRA layers: changed = any non-zero entry."""
    import mlx.core as mx

    weights = mx.load(str(path))
    b = [v for k, v in weights.items() if k.endswith("lora_b")]
    norm = float(mx.sqrt(sum((x.astype(mx.float32) ** 2).sum() for x in b))) if b else 0.0
    nonzero = sum(int((x != 0).any()) for x in b)
    return {"lora_b_tensors": len(b), "lora_b_nonzero_tensors": nonzero, "lora_b_l2": norm, "changed": norm > 0}


def run_dtrain(variant: str, engine: dict, data_file: Path, steps: int, a, work: Path) -> dict:
    import yaml

    from dtrain import sampler
    from dtrain.config import load_config
    from dtrain.run.tracking import read_scalars

    out = work / variant.replace(" ", "_").replace("+", "_")
    if a.budget:
        engine = dict(engine, memory_budget_gb=a.budget)
    if engine.get("segment_layers") == "sqrt":
        engine = dict(engine, segment_layers=max(1, round(math.sqrt(a.n_layers))))
    cfg = {"model": {"path": str(a.model_dir), "dtype": a.dtype},
           "lora": {"rank": 8, "scale": 20.0, "dropout": 0.0, "num_layers": -1, "keys": None},
           "data": {"train": str(data_file), "valid_fraction": 0.0, "max_length": a.max_length,
                    "max_prompt_length": a.max_prompt_length or a.max_length},
           "orpo": {"lambda": 0.1}, "engine": engine,
           "train": {"steps": steps // a.pairs_per_step, "global_batch_pairs": a.pairs_per_step,
                     "micro_batch_pairs": a.micro or a.pairs_per_step, "learning_rate": a.lr,
                     "schedule": "constant", "warmup_steps": 0, "seed": 0, "output_dir": str(out), "progress": False}}
    cfg_path = work / f"{out.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    wall, rss, _ = timed([sys.executable, "-m", "dtrain", "train", "-c", str(cfg_path)], dict(os.environ),
                         work / f"{out.name}.log")
    run_dir = next((out / "tb").iterdir())
    scalars = read_scalars(run_dir)
    pps = dict(scalars["pairs_per_second"])
    tps = dict(scalars["tokens_per_second"])
    if a.pairs_per_step > 1:  # several pairs per step: per-step records only
        return {"tool": variant, "wall_s": wall, "max_rss_gb": rss, "pairs_per_step": a.pairs_per_step,
                "steps": [{"step": k, "pair": -k, "seconds": v} for k, v in sorted(scalars["perf/step_seconds"])],
                "peak_gb": max(v for _, v in scalars["peak_memory_gb"]),
                "adapter": lora_b_change(out / "adapters" / "adapters.safetensors")}
    # step -> pair: the same sampler the trainer uses, over the same tokenized pairs
    pairs = _dataset(load_config(str(cfg_path)), a.model_dir)
    steps_out = []
    for step in sorted(pps):
        (_, i), = sampler.global_batch(step, len(pairs), 1, 0)
        line = int(pairs[i].source.rsplit(":", 1)[1])
        steps_out.append({"step": step, "pair": line - 1, "seconds": 1 / pps[step], "tokens": round(tps[step] / pps[step]),
                          **{k: dict(scalars[k]).get(step) for k in ("loss", "grad_norm", "skipped_steps") if k in scalars},
                          "prompt": len(pairs[i].prompt), "chosen": len(pairs[i].chosen),
                          "rejected": len(pairs[i].rejected)})
    return {"tool": variant, "wall_s": wall, "max_rss_gb": rss, "steps": steps_out,
            "peak_gb": max(v for _, v in scalars["peak_memory_gb"]),
            "adapter": lora_b_change(out / "adapters" / "adapters.safetensors")}


_TOKENIZED = {}


def _dataset(cfg, model_dir):
    from dtrain.data import load_dataset

    key = cfg.data.train
    if key not in _TOKENIZED:
        _TOKENIZED[key] = load_dataset(cfg.data, _tokenizer(model_dir), cfg.train.seed, log=None).train
    return _TOKENIZED[key]


def _tokenizer(model_dir):
    """The folder's tokenizer as mlx-lm's load() builds it, without loading the weights (loaded once)."""
    if "tok" not in _TOKENIZED:
        from mlx_lm.utils import load_tokenizer

        eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
        _TOKENIZED["tok"] = load_tokenizer(Path(model_dir), eos_token_ids=eos)
    return _TOKENIZED["tok"]


def peer_iterations(text: str, drawn: dict, batch: int = 1) -> list[dict]:
    """mlx-lm-lora's ``--steps-per-report 1`` lines -> one record per iteration.

    ``seconds``: the recorded response tokens ÷ its ``tok/s`` (printed with more
    significant digits than ``it/s``). A step it printed at ``tok/s 0.000`` (a pair
    whose response tokens it did not count, e.g. one carrying no signal) gives no
    time: ``seconds`` is None and the line is kept (``zero_rate``); ``summarize``
    leaves such steps out of the figures and counts them. With ``batch > 1``
    a record is a step (``pair`` = -step), as dtrain's are.
    """
    out = []
    for m in ITER_LINE.finditer(text):
        it, it_s, tok_s = int(m.group(1)), float(m.group(3)), float(m.group(4))
        tokens = drawn["tokens"][it - 1]
        out.append({"step": it, "pair": drawn["drawn"][it - 1] if batch == 1 else -it, "seconds": tokens / tok_s if tok_s > 0 else None,
                    "seconds_from_it_s": 1 / it_s if it_s > 0 else None, "tokens": tokens,
                    "peak_gb": float(m.group(5)), "loss": float(m.group(2)), "zero_rate": tok_s == 0})
    return out


def run_peer(data_dir: Path, iters: int, a, work: Path) -> dict:
    import yaml

    out = work / "peer"
    cfg = {"model": str(a.model_dir), "train": True, "train_mode": "orpo", "train_type": "lora",
           "data": str(data_dir), "batch_size": a.pairs_per_step, "iters": iters // a.pairs_per_step, "val_batches": 1, "steps_per_report": 1,
           "steps_per_eval": 10**6, "save_every": 10**6, "adapter_path": str(out), "max_seq_length": a.max_length,
           "learning_rate": a.lr, "beta": 0.1, "seed": 0, "num_layers": a.n_layers,
           "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0}, "fuse": a.peer_fuse,
           "grad_checkpoint": a.peer_grad_checkpoint}
    cfg_path = work / "peer.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    record = work / "peer-record.json"
    from common import BLAS

    from dtrain.blas import blas_env

    env, _ = blas_env(dict(os.environ), BLAS)  # the BLAS (and core type) dtrain's own runs use
    wall, rss, text = timed([a.peer_python, str(Path(__file__).resolve()), "--child", str(cfg_path), str(record)],
                            env, work / "peer.log")
    drawn = json.loads(record.read_text())
    iters_out = peer_iterations(text, drawn, a.pairs_per_step)
    fused = sorted(p.name for p in out.glob("*.safetensors") if p.name != "adapters.safetensors")
    adapter = lora_b_change(out / "adapters.safetensors")
    for name in fused:  # a full model copy per run: measured, not kept (disk)
        (out / name).unlink()
    return {"tool": PEER, "wall_s": wall, "max_rss_gb": rss, "steps": iters_out, "pairs_per_step": a.pairs_per_step,
            "peak_gb": max(s["peak_gb"] for s in iters_out), "fuse_s": drawn["fuse_s"], "fused_files": fused,
            "adapter": adapter}


def run_trl(data_file: Path, pairs: int, a, work: Path) -> dict:
    """TRL's ORPOTrainer through ``trl_peer.py`` in ``--trl-python`` on the same pairs, lengths,
    LoRA (rank 8, alpha 160 = mlx-lm's scale 20 x rank 8, every linear), batch, learning rate and λ."""
    steps = pairs // a.pairs_per_step
    cmd = [a.trl_python, str(TRL_PEER), "--data", str(data_file), "--model", str(a.trl_model or a.model_dir),
           "--max-length", str(a.max_length), "--max-prompt-length", str(a.max_prompt_length or a.max_length),
           "--lora-rank", "8", "--lora-alpha", "160", "--batch", str(a.pairs_per_step), "--steps", str(steps),
           "--dtype", a.dtype, "--lr", str(a.lr), "--beta", "0.1", "--skip-first", "0",
           "--out-dir", str(work / "trl")]
    wall, rss, text = timed(cmd, dict(os.environ), work / "trl.log")
    lines = [line for line in text.splitlines() if line.startswith('{"trl": ')]
    if not lines:
        raise RunFailed(f"trl_peer.py printed no result (log: {work / 'trl.log'})")
    result = json.loads(lines[-1])["trl"]
    finite = all(math.isfinite(x) for x in result["losses"])
    return {"tool": TRL, "wall_s": wall, "max_rss_gb": rss, "steps": result["steps"], "pairs_per_step": a.pairs_per_step,
            "peak_gb": result["peak_gb"], "dropped_long_prompts": result["dropped_long_prompts"],
            "losses": result["losses"], "adapter": {"changed": None, "losses_finite": finite}}


def summarize(runs: list[dict], skip_first: bool = False) -> dict:
    """Per tool and pair-by-pair ratios; ``skip_first`` leaves out each run's
    first training step (on a GPU it includes compiling the kernels)."""
    from common import spread

    if skip_first:
        runs = [dict(r, steps=[s for s in r["steps"] if s["step"] != min(t["step"] for t in r["steps"])]) for r in runs]
    unmeasured = {}  # tool -> steps without a time (peer_iterations: tok/s 0.000)
    for r in runs:
        unmeasured[r["tool"]] = unmeasured.get(r["tool"], 0) + sum(s["seconds"] is None for s in r["steps"])
    runs = [dict(r, steps=[s for s in r["steps"] if s["seconds"] is not None]) for r in runs]

    tools = list(dict.fromkeys(r["tool"] for r in runs))
    per_tool = {}
    for tool in tools:
        mine = [r for r in runs if r["tool"] == tool]
        # (pairs, seconds) per step: a record is a pair's step, or a step of pairs_per_step pairs
        steps = [(r.get("pairs_per_step", 1), s["seconds"]) for r in mine for s in r["steps"]]
        per_tool[tool] = {"s_per_pair": spread([sec / n for n, sec in steps]),
                          "pairs_per_s": spread([n / sec for n, sec in steps]),
                          "all_pairs_per_s": sum(n for n, _ in steps) / sum(sec for _, sec in steps),
                          "peak_gb": max(r["peak_gb"] for r in mine), "max_rss_gb": max(r["max_rss_gb"] for r in mine),
                          "adapter_changed_runs": f"{sum(r['adapter']['changed'] is True for r in mine)}/{len(mine)}",
                          "adapters": [r["adapter"] for r in mine], "unmeasured_steps": unmeasured[tool]}
        if tool == PEER:
            per_tool[tool]["fuse_s"] = [r["fuse_s"] for r in mine]
    # pair by pair: (round, pair) -> seconds per tool (median over repeated draws)
    by_pair: dict = {}
    for r in runs:
        for s in r["steps"]:
            by_pair.setdefault((r["first_row"], s["pair"]), {}).setdefault(r["tool"], []).append(s["seconds"])
    ratios = {}
    for tool in tools:
        if tool == PEER:
            continue
        ratio = [statistics.median(t[PEER]) / statistics.median(t[tool]) for t in by_pair.values() if PEER in t and tool in t]
        ratios[tool] = spread(ratio)
    return {"per_tool": per_tool, "speedup_vs_peer": ratios}


def table(summary: dict) -> str:
    lines = ["| tool | steps | s/pair median (min–max) | pairs/s median | pairs/s, all (Σ pairs / Σ s) | peak GB (mx) "
             "| max RSS GB | adapter changed | pairs/s ÷ mlx-lm-lora's, pair by pair: median (min–max, n) |",
             "|" + "---|" * 9]
    for tool, t in summary["per_tool"].items():
        s, r = t["s_per_pair"], summary["speedup_vs_peer"].get(tool)
        ratio = f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}, {r['n']})" if r else "1"
        steps = f"{s['n']}" + (f" (+{t['unmeasured_steps']} at tok/s 0)" if t.get("unmeasured_steps") else "")
        lines.append(f"| {tool} | {steps} | {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) "
                     f"| {t['pairs_per_s']['median']:.3f} | {t['all_pairs_per_s']:.3f} | {t['peak_gb']:.2f} | {t['max_rss_gb']:.2f} "
                     f"| {t['adapter_changed_runs']} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "RECORD"), help=argparse.SUPPRESS)
    add_flags(ap, data=ORCA, help={"data": "orca pairs in OpenAI preference format (read in place)"})
    ap.add_argument("--start", type=int, default=0, help="first row of --data to use")
    ap.add_argument("--pairs-per-run", type=int, default=0, help="pairs each tool trains on per round (0 = 6; "
                                                                  "240 with --recommended: 30 steps)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (every dtrain variant, mlx-lm-lora)")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--max-prompt-length", type=int, default=0,
                    help="dtrain's data.max_prompt_length and TRL's prompt limit (0 = --max-length)")
    ap.add_argument("--pairs-per-step", type=int, default=1, help="dtrain's global batch (figures per step when > 1)")
    ap.add_argument("--budget", type=float, default=0.0, help="dtrain's engine.memory_budget_gb (0 = its default)")
    ap.add_argument("--micro", type=int, default=0, help="dtrain's micro-batch pairs (0 = --pairs-per-step)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "llama3.2-1b", "llama3.1-8b"],
                    help="smollm2: the demo GGUF converted to float32; others: random weights of that shape")
    add_flags(ap, dtype="float32", layers=None, help={"layers": "depth override of a random-weight model (smoke runs)"})
    ap.add_argument("--model-dir", type=Path, default=None, help="use this mlx-lm folder instead of --model")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="SmolLM2 tokenizer files for a random-weight model (a machine without the demo model)")
    ap.add_argument("--peer-python", default=os.environ.get("PEER_PYTHON", "python3"),
                    help="python of the mlx-lm-lora venv (default: $PEER_PYTHON, else python3)")
    ap.add_argument("--only", nargs="+", default=None, choices=[*VARIANTS, PEER, TRL], metavar="TOOL",
                    help=f"tools to run (default: all but TRL's): {', '.join([*VARIANTS, PEER, TRL])}")
    ap.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", ""),
                    help=f"a python with torch, peft, datasets and TRL 1.16 (default: $TRL_PYTHON): runs '{TRL}' "
                         "through bench/trl_peer.py (CUDA)")
    ap.add_argument("--trl-model", default=None, help="TRL's model: an HF folder or a .gguf file (default: the MLX folder)")
    ap.add_argument("--recommended", action="store_true",
                    help="the side by side at configs/preference.yaml's settings: 8 pairs per step, learning rate "
                         "5e-4, prompts of at most 512 tokens; dtrain preference vs mlx-lm-lora vs TRL (with --trl-python)")
    ap.add_argument("--synthetic-length", type=int, default=0,
                    help="random-word pairs of about this many tokens per sequence instead of --data")
    ap.add_argument("--no-peer-fuse", dest="peer_fuse", action="store_false",
                    help="mlx-lm-lora fuse: false (it writes a full model copy per run otherwise)")
    ap.add_argument("--skip-first", action="store_true", help="leave each run's first step out of the figures (warm-up)")
    ap.add_argument("--peer-grad-checkpoint", action="store_true", help="mlx-lm-lora grad_checkpoint: true")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, adapters, fused model)")
    add_flags(ap, out=str(RESULTS))
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier results files (merged) and exit")
    ap.add_argument("--peer-log", nargs=2, metavar=("LOG", "RECORD"),
                    help="print the iterations read from a kept mlx-lm-lora log (peer.log, peer-record.json) and exit")
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    if a.peer_log:
        iters = peer_iterations(Path(a.peer_log[0]).read_text(), json.loads(Path(a.peer_log[1]).read_text()))
        print(json.dumps(iters))
        return 0

    from common import write_results  # BLAS and MLX: the parent only

    if a.table:
        print(table(summarize([r for f in a.table for r in json.loads(Path(f).read_text())["runs"]], a.skip_first)))
        return 0

    if a.recommended:
        a.pairs_per_step, a.lr, a.max_prompt_length = 8, 5e-4, a.max_prompt_length or 512
        a.pairs_per_run = a.pairs_per_run or 240
        a.only = a.only or ["dtrain preference", PEER] + ([TRL] if a.trl_python else [])
    a.pairs_per_run = a.pairs_per_run or 6
    if a.pairs_per_run % a.pairs_per_step:
        ap.error(f"--pairs-per-run {a.pairs_per_run} is not a multiple of --pairs-per-step {a.pairs_per_step}")
    if a.only and TRL in a.only and not a.trl_python:
        ap.error(f"'{TRL}' needs --trl-python (or $TRL_PYTHON)")
    if a.model == "smollm2" and a.model_dir is None and a.tokenizer_dir is None and a.dtype != "float32":
        ap.error("--model smollm2 is the float32 folder both tools train; use --dtype float32 (or --model-dir)")
    if not a.synthetic_length:
        need_file(ap, a.data, "--data")
        rows, end = len(orca_rows(a.data, 0, None)), a.start + a.rounds * a.pairs_per_run
        if end > rows:
            ap.error(f"--start {a.start}, --pairs-per-run {a.pairs_per_run} and --rounds {a.rounds} need rows "
                     f"{a.start}–{end - 1} of {a.data}, which has {rows} (rows 0–{rows - 1})")
    if a.model_dir is None:
        real = a.model == "smollm2" and a.tokenizer_dir is None  # the demo model; else random weights of the shape
        a.model_dir = smollm2_dir() if real else random_model_dir(a.model, a.dtype, a.layers, a.tokenizer_dir)
    a.n_layers = json.loads((a.model_dir / "config.json").read_text())["num_hidden_layers"]  # LoRA on all of them
    tools = [t for t in [*VARIANTS, PEER, TRL] if (t in a.only if a.only else t != TRL)]
    root = Path(tempfile.mkdtemp(prefix="dtrain-peer-"))
    runs, failed = [], []
    try:
        for rnd in range(a.rounds):
            work = root / f"round{rnd}"
            (work / "peer-data").mkdir(parents=True)
            if a.synthetic_length:
                rows = synthetic_rows(a.model_dir, a.pairs_per_run, a.synthetic_length, seed=rnd)
            else:
                rows = orca_rows(a.data, a.start + rnd * a.pairs_per_run, a.pairs_per_run)
            data_file = work / "pairs.jsonl"
            data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
            peer_rows = "".join(json.dumps(as_peer_row(r)) + "\n" for r in rows)
            (work / "peer-data" / "train.jsonl").write_text(peer_rows)
            (work / "peer-data" / "valid.jsonl").write_text("".join(peer_rows.splitlines(True)[: a.pairs_per_step]))  # mlx-lm-lora wants >= batch_size rows
            for tool in (tools if rnd % 2 == 0 else tools[::-1]):
                try:
                    if tool == PEER:
                        r = run_peer(work / "peer-data", len(rows), a, work)
                    elif tool == TRL:
                        r = run_trl(data_file, len(rows), a, work)
                    else:
                        r = run_dtrain(tool, VARIANTS[tool], data_file, len(rows), a, work)
                except RunFailed as err:  # e.g. out of GPU memory: record it, go on
                    failed.append({"tool": tool, "round": rnd, "error": str(err)})
                    print(json.dumps({"failed": failed[-1]}), flush=True)
                    continue
                r.update(round=rnd, first_row=a.start + rnd * a.pairs_per_run)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
                print("  s/pair:", [s["seconds"] and round(s["seconds"], 2) for s in r["steps"]], "pairs:",
                      [s["pair"] for s in r["steps"]], flush=True)
    finally:
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(runs, a.skip_first)
    path = write_results("peer", {"runs": runs, "summary": summary, "failed": failed}, a.out)
    print(table(summary), "".join(f"\nfailed: {f['tool']} (round {f['round']}): {f['error']}" for f in failed),
          "\n", f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
