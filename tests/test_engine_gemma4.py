"""Segmented engine = reference engine on mlx-lm's ``gemma4_text``.

Gemma 4 adds KV-shared layers (the last ``num_kv_shared_layers`` attend over
the rotated K/V of an earlier donor layer), per-layer inputs, sliding/full
layers with different head sizes and RoPE, soft-capped logits. Range sizes 2,
3 and 0 put both donor/sharer pairs across ranges, one across and one inside a
range, and both inside one range; every variant of test_engine_segmented.py
runs on each, for a dense, an untied K = V and an MoE configuration.
"""

from __future__ import annotations

import pytest

from dtrain.engine.arch import adapter_for
from dtrain.engine.plan import kv_exports, kv_imports
from dtrain.engine.segmented import SegmentedEngine

from conftest import add_random_lora, make_tiny_model
from test_engine_segmented import VOCAB, assert_parity, engine_for, make_pairs

# 6 layers [sliding, full] * 3; layers 4, 5 reuse the K/V of layers 2 (sliding) and 3 (full)
GEMMA4 = dict(model_type="gemma4_text", hidden_size=32, num_hidden_layers=6, intermediate_size=32,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
              num_kv_shared_layers=2, sliding_window=4, sliding_window_pattern=2, rms_norm_eps=1e-5)
CONFIGS = {
    "gemma4": GEMMA4,
    # untied head, K = V on full layers, no per-layer inputs, single-wide MLP
    "gemma4_untied_k_eq_v": dict(GEMMA4, tie_word_embeddings=False, attention_k_eq_v=True,
                                 hidden_size_per_layer_input=0, use_double_wide_mlp=False),
    # MoE block (dense MLP + routed experts) beside the MLP, as in the 26B model
    "gemma4_moe": dict(GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
}
VARIANTS = {
    "segmented": dict(),
    "prefix": dict(prefix_sharing=True),
    "prefix_chunked": dict(prefix_sharing=True, head_chunk_tokens=7),
}
# sequences up to 20 tokens, longer than the window of 4
PAIRS = dict(lengths=((6, 4, 5), (3, 9, 2), (8, 2, 6)))


def gemma4_model(config: str, seed: int = 0):
    """A tiny random gemma4_text with LoRA (rank 4) on all layers and random lora_b."""
    return add_random_lora(make_tiny_model("gemma4_text", seed=seed, **CONFIGS[config]), seed)


def test_donors_and_range_crossings():
    arch = adapter_for(gemma4_model("gemma4"))
    assert arch.donors == [None, None, None, None, 2, 3]
    assert arch.windows == [4, None] * 3
    assert [kv_exports(arch.donors, lo, hi) for lo, hi in ((0, 3), (3, 6))] == [[2], []]
    assert [kv_imports(arch.donors, lo, hi) for lo, hi in ((0, 3), (3, 6))] == [[], [2]]  # 3 -> 5 stays inside
    assert kv_exports(arch.donors, 2, 4) == [2, 3] and kv_imports(arch.donors, 4, 6) == [2, 3]


@pytest.mark.parametrize("size", [2, 3, 0])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_parity(config, variant, size):
    model = gemma4_model(config)
    assert_parity(model, engine_for(model, segment_layers=size, **VARIANTS[variant]), make_pairs(**PAIRS))


def test_parity_lambda_zero_and_fallback_pair():
    model = gemma4_model("gemma4")
    engine = engine_for(model, lam=0.0, segment_layers=1, prefix_sharing=True, head_chunk_tokens=5)
    out = assert_parity(model, engine, make_pairs(fallback=True, **PAIRS), lam=0.0)
    assert out.sums["fallback_pairs"] == 1


def test_from_config_picks_segmented(capsys):
    from dtrain.config import Config
    from dtrain.engine import make_engine
    from dtrain.engine import ORPO

    cfg = Config()
    cfg.engine.kind, cfg.engine.segment_layers, cfg.engine.prefix_sharing = "segmented", "auto", True
    engine = make_engine(cfg.engine, gemma4_model("gemma4"), ORPO(0.1))
    assert isinstance(engine, SegmentedEngine) and capsys.readouterr().err == ""
