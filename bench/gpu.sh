#!/usr/bin/env bash
# GPU runs on the lent H200 machine (MLX CUDA build assembled into /tmp/site by
# ../shared/gpu/prepare-mlx-cuda's install.sh). Usage, from the repository root there:
#   bash bench/gpu.sh engines OUT   # matmul rate, parity smoke (full fp32), bench/engines.py in bfloat16
#   bash bench/gpu.sh mfu OUT       # bench/mfu.py in bfloat16
#   bash bench/gpu.sh dp OUT        # bench/dp_gpu.py: 1 vs 2 GPUs over nccl, bfloat16 (needs 2 GPUs)
#   bash bench/gpu.sh dpf32 OUT     # the same in float32 with TF32 off: 2-rank adapter vs 1-rank adapter
#   bash bench/gpu.sh peer OUT MODEL LENGTH...   # bench/peer.py, bfloat16, random weights, synthetic pairs
#       (mlx-lm-lora's wheel rides in .gpu-b with the others; bench/tok holds SmolLM2's tokenizer files)
#   bash bench/gpu.sh recommended OUT GGUF   # bench/peer.py --recommended: dtrain vs mlx-lm-lora vs TRL's
#       ORPOTrainer, SmolLM2 (the demo GGUF) in float32 (TF32 off everywhere) and bfloat16 (issue 26)
#   bash bench/gpu.sh objectives OUT GGUF [KIND...]   # bench/objectives.py run: each objective + TRL's
#       DPOTrainer on one held-out split of the orca pairs, float32 with TF32 off (issue 24)
#   bash bench/gpu.sh groups OUT SPANS   # fewer queries than keys on CUDA (fused attention and its vjp, bf16 and
#       fp32), grouped attention = one call on a tiny model (fp32, TF32 off), then bench/batch_steps.py at SPANS'
#       lengths (bench/padding.py --spans-out): engine.attention_groups 1 vs 4 in float32 and bfloat16
#   (trl==1.16.0, datasets, dill and multiprocess ride as wheels too; DTRAIN_CACHE holds the demo GGUF)
# MLX runs float32 matmuls as TF32 on NVIDIA GPUs unless MLX_ENABLE_TF32=0 (about 1e-3
# relative error per product): the float32 equivalence checks turn it off.
set -uo pipefail
stage=$1; out=$2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p "$out"
case $stage in
engines)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
  MLX_ENABLE_TF32=0 python3 - <<'PY' 2>&1 | tee "$out/smoke.txt"
# segmented engine on CUDA: same loss and LoRA gradients as the reference engine (float32, tiny llama)
import mlx.core as mx, numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from dtrain.config import EngineConfig, LoraConfig
from dtrain.lora import apply_lora
from dtrain.engine import ORPO, ReferenceEngine, batch_totals, make_engine
from dtrain.types import TokenizedPair
print("device", mx.default_device())
mx.random.seed(0)
m = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=5, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=True))
m.set_dtype(mx.float32); apply_lora(m, LoraConfig(rank=4, scale=2.0))
m.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), m.trainable_parameters()))
pairs = [TokenizedPair([1, 5, 6, 7, 8], [9, 10, 2], [11, 12, 13, 2]), TokenizedPair([1, 20], [21, 22, 23, 2], [24, 2])]
tot = batch_totals(pairs, "full")
ref = ReferenceEngine(m, ORPO(0.1)).step(pairs, tot)
seg = make_engine(EngineConfig(kind="segmented", segment_layers=2, head_chunk_tokens=4), m, ORPO(0.1)).step(pairs, tot)
print("loss ref", ref.loss.item(), "seg", seg.loss.item())
worst = max(float(np.linalg.norm(np.array(a) - np.array(b)) / np.linalg.norm(np.array(a)))
            for (_, a), (_, b) in zip(tree_flatten(ref.grads), tree_flatten(seg.grads)))
print("worst relative L2 gradient difference", worst)
if mx.default_device() == mx.gpu:  # the card's matmul rate (tests run this smoke on the CPU without it)
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16); mx.eval(a)
    import time
    for _ in range(2): mx.eval(a @ a)
    t = time.perf_counter(); [mx.eval(a @ a) for _ in range(10)]; dt = (time.perf_counter() - t) / 10
    print(f"bf16 8192^3 matmul {2 * 8192**3 / dt / 1e12:.0f} TFLOP/s")
PY
  timeout 420 python3 bench/engines.py --models llama3.2-1b llama3.1-8b --lengths 1024 4096 8192 --shapes even \
      --dtype bfloat16 --steps 3 --warmup 1 --segment 4 --chunk 2048 --out "$out" 2>&1 | tee "$out/engines.md"
  ;;
mfu)
  timeout 500 python3 bench/mfu.py --models llama3.2-1b llama3.1-8b --lengths 1024 4096 8192 --dtype bfloat16 \
      --steps 3 --warmup 1 --segment 4 --chunk 2048 --out "$out" 2>&1 | tee "$out/mfu.md"
  ;;
dp)
  d=/tmp/dp
  for len in 1024 4096; do
    python3 bench/dp_gpu.py setup $d-$len --shape llama-1b --dtype bfloat16 --length $len --pairs 64 >/dev/null
    timeout 200 python3 bench/dp_gpu.py run $d-$len --ranks 1 2 --steps 6 --global-batch 8 --micro 4 2>&1 | tail -8 | tee "$out/dp-$len.md"
  done
  for f in $d-*/dp.json; do cp "$f" "$out/$(basename $(dirname $f)).json"; done
  ;;
dpf32)
  d=/tmp/dp
  python3 bench/dp_gpu.py setup $d-f32 --shape llama-1b --dtype float32 --length 1024 --pairs 32 >/dev/null
  MLX_ENABLE_TF32=0 timeout 200 python3 bench/dp_gpu.py run $d-f32 --ranks 1 2 --steps 5 --global-batch 8 --micro 4 2>&1 | tail -8 | tee "$out/dp-f32.md"
  cp $d-f32/dp.json "$out/dp-f32.json"
  ;;
peer)
  model=$3; shift 3
  for len in "$@"; do
    timeout ${PEER_TIMEOUT:-400} python3 bench/peer.py --model "$model" --dtype bfloat16 --synthetic-length "$len" --max-length "$len" \
        --pairs-per-run ${PAIRS:-3} --rounds 1 --peer-python python3 --no-peer-fuse --tokenizer-dir bench/tok \
        --only "dtrain segmented+prefix+chunked" "dtrain one range+prefix" mlx-lm-lora --out "$out" 2>&1 \
        | tail -25 | tee "$out/peer-$model-$len.md"
  done
  ;;
recommended)
  gguf=$3; f32=$HOME/.cache/dtrain/smollm2-135m-instruct-f32; bf=$HOME/.cache/dtrain/smollm2-135m-instruct-bf16
  run() { timeout ${PEER_TIMEOUT:-280} python3 bench/peer.py --recommended --rounds 1 --no-peer-fuse --skip-first \
            --peer-python python3 --trl-python python3 --trl-model "$gguf" --keep --out "$out" "$@" 2>&1; }
  MLX_ENABLE_TF32=0 run --dtype float32 | tee "$out/recommended-float32.txt"
  [ -d "$bf" ] || python3 -m mlx_lm convert --hf-path "$f32" --mlx-path "$bf" --dtype bfloat16 >/dev/null
  run --dtype bfloat16 --model-dir "$bf" | tee "$out/recommended-bfloat16.txt"
  tar czf "$out/recommended-logs.tgz" /tmp/dtrain-peer-*/round*/*.log 2>/dev/null
  ;;
groups)
  spans=$3
  MLX_ENABLE_TF32=0 python3 - <<'PY' 2>&1 | tee "$out/groups-check.txt"
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from dtrain.config import EngineConfig
from dtrain.engine import ORPO, ReferenceEngine, batch_totals, make_engine
from dtrain.engine.arch import fused_causal
from dtrain.lora import apply_lora
from dtrain.config import LoraConfig
from dtrain.types import TokenizedPair
from mlx_lm.models import llama
rel = lambda a, b: (mx.linalg.norm((a - b).astype(mx.float32)) / mx.linalg.norm(b.astype(mx.float32))).item()
print("device", mx.default_device())
for dt in (mx.bfloat16, mx.float32):
    for L, q0 in ((256, 128), (384, 128), (200, 77)):
        q, k, v, w = (mx.random.normal((2, 4, L, 64)).astype(dt) for _ in range(4))
        k, v = k[:, :2], v[:, :2]
        f = lambda q, k, v: (w[:, :, q0:] * fused_causal(q[:, :, q0:], k, v, 0.125)).sum()
        g = lambda q, k, v: (w[:, :, q0:] * fused_causal(q, k, v, 0.125)[:, :, q0:]).sum()
        a, b = mx.grad(f, argnums=(0, 1, 2))(q, k, v), mx.grad(g, argnums=(0, 1, 2))(q, k, v)
        out = rel(fused_causal(q[:, :, q0:], k, v, 0.125), fused_causal(q, k, v, 0.125)[:, :, q0:])
        print(dt, L, q0, "output", f"{out:.2e}", "grads", " ".join(f"{rel(x, y):.2e}" for x, y in zip(a, b)))
mx.random.seed(0)
m = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=True))
m.set_dtype(mx.float32); m.freeze(); apply_lora(m, LoraConfig(rank=4, scale=2.0))
m.update(tree_map(lambda p: 0.1 * mx.random.normal(p.shape), m.trainable_parameters()))
ids = lambda n, s: [(7 * i + s) % 500 + 3 for i in range(n)]
pairs = [TokenizedPair(ids(300, 1), ids(20, 2), ids(250, 3)), TokenizedPair(ids(140, 4), ids(30, 5), ids(90, 6))]
tot = batch_totals(pairs, "full")
ref = ReferenceEngine(m, ORPO(0.1)).step(pairs, tot)
for groups in (1, 4):
    for bucket in (0, 128):
        e = make_engine(EngineConfig(kind="segmented", attention_groups=groups, length_bucket=bucket), m, ORPO(0.1))
        try:  # 2026-12-04: this tiny shape failed on CUDA (cudaGraphAddKernelNode) before and after that day's change
            r = e.step(pairs, tot)
            worst = max(rel(x, y) for (_, x), (_, y) in zip(tree_flatten(r.grads), tree_flatten(ref.grads)))
            print("groups", groups, "bucket", bucket, "loss", r.loss.item(), "ref", ref.loss.item(), "worst grad rel", f"{worst:.2e}")
        except RuntimeError as err:
            print("groups", groups, "bucket", bucket, "FAILED:", err)
PY
  for dt in float32 bfloat16; do
    MLX_ENABLE_TF32=0 timeout ${STEPS_TIMEOUT:-200} python3 bench/batch_steps.py "$spans" --dtype $dt --steps ${STEPS:-10} \
        --variant attention_groups=1 --variant attention_groups=4 --out "$out" 2>&1 | tail -8 | tee "$out/groups-$dt.md"
  done
  ;;
objectives)
  gguf=$3; shift 3; o=${OBJ_OUT:-/tmp/objectives}   # OBJ_OUT: another folder (holding data/) for a second set
  MLX_ENABLE_TF32=0 python3 bench/objectives.py run $o --trl-python python3 --trl-model "$gguf" \
      ${KINDS:+--kinds $KINDS} ${TRL_KINDS:+--trl-kinds $TRL_KINDS} "$@" 2>&1 | tee -a "$out/objectives.txt"
  cp $o/results.json "$out/objectives.json"
  tar czf "$out/objectives-logs.tgz" $o/*/*/log.txt $o/trl/*.log 2>/dev/null
  ;;
esac
