"""Helpers shared by the benchmarks that run MLX in their own process: model shapes,
synthetic pairs, the timing loop, and the machine line with MLX and the BLAS in it
(the rest, the repository's path and the results writer, is bench/prelude.py).

Import this module before MLX: it calls ``dtrain.blas.setup()`` first, which
loads the fastest correct BLAS on Linux, as ``dtrain train`` does (no
``LD_PRELOAD`` needed). Nothing here assumes a CPU: memory comes from
``mx.get_peak_memory`` and the machine line names the BLAS setup() chose.
"""

from __future__ import annotations

import importlib
import random
import statistics
import time
from pathlib import Path

import prelude  # bench/prelude.py: the repository on sys.path
from prelude import RESULTS

from dtrain.blas import setup  # noqa: E402

BLAS = setup()  # before MLX: the fastest correct BLAS, as `dtrain train` chooses it
import mlx.core as mx  # noqa: E402

from dtrain.models import DEMO_SHAPE  # noqa: E402
from dtrain.types import TokenizedPair  # noqa: E402

_LLAMA3 = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
               num_attention_heads=32, num_key_value_heads=8)
MODELS = {
    # SmolLM2-135M shape (llama, tied embeddings)
    "smollm2": ("llama", DEMO_SHAPE),
    # Gemma 3 270M widths and its 262,144-token vocabulary, few layers
    "gemma3-vocab": ("gemma3_text", dict(model_type="gemma3_text", hidden_size=640, num_hidden_layers=6,
                                         intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=256, vocab_size=262144, sliding_window=512,
                                         sliding_window_pattern=6, query_pre_attn_scalar=256)),
    # Llama-3.2-1B and Llama-3.1-8B shapes (no rope scaling: it does not change the FLOPs)
    "llama3.2-1b": ("llama", dict(_LLAMA3, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                                  tie_word_embeddings=True)),
    "llama3.1-8b": ("llama", dict(_LLAMA3, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                                  tie_word_embeddings=False)),
}
SHAPES = {"even": 0.5, "long-prompt": 0.8}  # prompt share of P + R; 0.8 gives P = 4 R
DTYPES = {name: getattr(mx, name) for name in prelude.FLAGS["dtype"]["choices"]}


def dtrain_engine(model, kind: str = "segmented", **keys):
    """dtrain's engine for ``model`` as a run with these ``engine`` config keys gets it
    (``dtrain.engine.make_engine``, ORPO with lambda 0.1); exact shapes unless
    ``length_bucket`` is given. ``EngineConfig``'s defaults hold for keys left out
    (``prefix_sharing`` is on by default)."""
    from dtrain.config import EngineConfig
    from dtrain.engine import make_engine
    from dtrain.engine import ORPO

    return make_engine(EngineConfig(kind=kind, **{"length_bucket": 0, **keys}), model, ORPO(0.1))


def build_model(name: str, layers: int | None = None, dtype=mx.float32, lora_scale: float = 2.0, rank: int = 8):
    """A randomly initialised model of shape ``MODELS[name]`` in ``dtype``, frozen,
    with LoRA (``rank``, ``lora_scale``, no dropout) on every linear layer of every
    decoder layer as a run adds it (``dtrain.lora.apply_lora``: mlx-lm's layers, the
    product in bfloat16 on a bfloat16 model). ``layers`` overrides the depth."""
    from dtrain.config import LoraConfig
    from dtrain.lora import apply_lora

    module, args = MODELS[name]
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    if layers:
        args = dict(args, num_hidden_layers=layers)
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(args))
    model.set_dtype(dtype)
    if module == "gemma3_text":
        model.sanitize({})  # no lm_head weight: tied embeddings, as Gemma 3 ships
    apply_lora(model, LoraConfig(rank=rank, scale=lora_scale))
    mx.eval(model.parameters())
    return model


def make_pairs(n: int, length: int, prompt_share: float, vocab: int, seed: int = 0) -> list[TokenizedPair]:
    """``n`` pairs of random token ids: a prompt of ``length * prompt_share`` tokens
    and chosen/rejected responses of the rest (P + R = ``length`` per side)."""
    rng = random.Random(seed)
    P = max(1, int(length * prompt_share))
    R = max(1, length - P)
    ids = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    return [TokenizedPair(ids(P), ids(R), ids(R)) for _ in range(n)]


def measure(engine, pairs, norm, steps: int, warmup: int) -> dict:
    """Peak memory (GB, and above the memory held before) and seconds per ``engine.step``
    (loss and gradients evaluated), median over ``steps`` after ``warmup`` untimed steps."""
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        out = engine.step(pairs, norm)
        mx.eval(out.loss, out.grads)
        if i >= warmup:
            times.append(time.perf_counter() - t)
        del out
    return {"peak_gb": mx.get_peak_memory() / 1e9, "peak_over_weights_gb": (mx.get_peak_memory() - base) / 1e9,
            "s_per_step": statistics.median(times), "times": times}


def spread(values: list[float]) -> dict:
    """Median, min, max and count of ``values`` (empty -> NaNs, count 0)."""
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def loaded_blas() -> str:
    """BLAS libraries mapped into this process (Linux), or '' when unknown."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    names = {Path(line.split()[-1]).name for line in maps.splitlines() if "blas" in line.lower() and "/" in line}
    return ", ".join(sorted(names))


def machine() -> dict:
    """The machine line (prelude's) with MLX's version and device and the BLAS loaded."""
    info = {**prelude.machine(), "mlx": mx.__version__, "device": str(mx.default_device()),
            "blas": BLAS.line(), "blas_loaded": loaded_blas()}
    if mx.default_device() == mx.gpu:
        try:
            info["gpu"] = mx.device_info().get("device_name", "")
        except Exception:  # device_info differs between backends
            pass
    return info


def write_results(prefix: str, payload: dict, out: str | Path = RESULTS, stamp: bool = True) -> Path:
    """``prelude.write_results`` with this process's machine line (MLX, the BLAS)."""
    return prelude.write_results(prefix, payload, out, machine(), stamp)
