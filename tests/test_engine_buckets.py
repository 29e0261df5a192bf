"""Length buckets, the compiled step and the ``auto`` plan.

Bucket padding (longer sequences, zero-weight targets, padded attention rows)
must leave the loss, the metric sums and the LoRA gradients those of the exact
shapes; a compiled step must train the adapter the eager one trains; the auto
plan picks the single pass when the memory model says it fits.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from dtrain.config import Config, load_config
from dtrain.engine import Totals, make_engine
from dtrain.engine.layout import bucket_length
from dtrain.engine.plan import GIB, Plan, estimate_step_bytes, fused_attention, layer_bytes_per_token
from dtrain.engine.segmented import SegmentedEngine
from dtrain.errors import ConfigError
from dtrain.types import TokenizedPair
from dtrain.engine import ORPO

from test_engine_segmented import NORM, assert_parity, engine_for, lora_model, make_pairs, rel


def test_bucket_length_worked_values():
    assert [bucket_length(n, 128) for n in (1, 128, 129, 1024, 1025, 2048, 2049, 5000)] == \
        [128, 128, 256, 1024, 1152, 2048, 2304, 5120]
    assert bucket_length(77, 0) == 77 and bucket_length(5, 4) == 8


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.sampled_from([1, 8, 64, 128]))
def test_bucket_length_bounds_padding(n, quantum):
    b = bucket_length(n, quantum)
    assert b >= n and b % quantum == 0
    assert b - n < quantum or (b - n) < n / 8  # under one quantum, or under 12.5%
    assert bucket_length(b, quantum) == b  # a bucket is its own bucket


def random_pairs(seed: int, n: int = 3, fallback: bool = False):
    rng = random.Random(seed)
    lengths = [(rng.randint(1, 9), rng.randint(1, 8), rng.randint(1, 8)) for _ in range(n)]
    return make_pairs(seed, n, fallback, lengths)


VARIANTS = {"single": dict(segment_layers=0), "ranges": dict(segment_layers=2, head_chunk_tokens=5)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("arch", ["llama", "llama_sliding", "qwen3", "gemma3"])
def test_bucket_padding_leaves_loss_sums_and_grads_unchanged(arch, prefix, variant):
    """In float64, so that only the padding could tell the two apart (float32 differs by
    ~1e-6 from the changed summation order alone)."""
    model = lora_model(arch)
    model.set_dtype(mx.float64)
    for seed in range(2):
        pairs = random_pairs(seed, fallback=prefix and seed == 1)
        kw = dict(VARIANTS[variant], prefix_sharing=prefix)
        exact = engine_for(model, **kw).step(pairs, NORM)
        padded_engine = engine_for(model, length_bucket=16, **kw)
        layout = padded_engine.layout(pairs)
        assert layout.shape[1] % 16 == 0 and layout.targets.shape[0] % 16 == 0  # really padded
        padded = padded_engine.step(pairs, NORM)
        mx.eval(exact.loss, exact.grads, padded.loss, padded.grads)
        assert rel(padded.loss, exact.loss) < 1e-12
        assert padded.sums["computed_tokens"] == layout.computed_tokens > exact.sums["computed_tokens"]
        for k, v in exact.sums.items():
            if k != "computed_tokens":  # the padding itself
                assert abs(float(padded.sums[k]) - float(v)) <= 1e-12 * max(1.0, abs(float(v))), k
        for (k, a), (_, b) in zip(tree_flatten(exact.grads), tree_flatten(padded.grads)):
            assert rel(b, a) < 1e-12, (k, rel(b, a))


def test_bucketed_engine_matches_reference():
    model = lora_model("qwen3")
    assert_parity(model, engine_for(model, segment_layers=0, prefix_sharing=True, length_bucket=8),
                  make_pairs(fallback=True))


def train_adapter(model, engine, steps: int = 3):
    opt = optim.AdamW(learning_rate=1e-2)
    opt.init(model.trainable_parameters())
    for seed in range(steps):
        pairs = random_pairs(seed + 10)
        norm = Totals(nll_tokens=float(sum(len(p.prompt) + len(p.chosen) - 1 for p in pairs)), pairs=3.0)
        out = engine.step(pairs, norm)
        opt.update(model, out.grads)
        mx.eval(model.trainable_parameters(), opt.state)
    return dict(tree_flatten(model.trainable_parameters()))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_step_trains_the_eager_adapter(variant):
    """Three AdamW steps on new pairs (two length buckets): compiled = eager within 1e-6 (float32)."""
    start = dict(tree_flatten(lora_model("llama").trainable_parameters()))
    adapters = []
    for compiled in (False, True):
        model = lora_model("llama")
        kw = dict(VARIANTS[variant], prefix_sharing=True, length_bucket=8, compile=compiled)
        adapters.append(train_adapter(model, engine_for(model, **kw)))
    eager, compiled = adapters
    assert any(rel(eager[k], start[k]) > 1e-3 for k in eager)  # the adapter moved
    for k in eager:
        assert rel(compiled[k], eager[k]) < 1e-6, (k, rel(compiled[k], eager[k]))


def test_layer_and_step_estimates_worked_numbers():
    args = lora_model("llama").args  # D 32, I 64, 4 heads, 2 kv heads, head dim 8, 5 layers, vocab 512
    assert layer_bytes_per_token(args, 4) == 4 * (16 * 32 + 8 * 64 + 2 * (4 + 4) * 8) == 4608
    shape = dict(tokens=30, targets=20, attention=((3, 12),), heads=4)
    scores = 2 * 3 * 4 * 12**2 * 4
    assert estimate_step_bytes(args, 4, shape, 0, 0, fused=False) == 5 * (30 * 4608 + scores) + 20 * 512 * 16
    assert estimate_step_bytes(args, 4, shape, 0, 0, fused=True) == 5 * 30 * 4608 + 20 * 512 * 16
    # a call whose queries start at 5 keeps the scores of its last 7 queries over 12 keys
    later = dict(shape, attention=((3, 12, 5),))
    assert estimate_step_bytes(args, 4, later, 0, 0, fused=False) == 5 * (30 * 4608 + 2 * 3 * 4 * 7 * 12 * 4) + 20 * 512 * 16
    # ranges of 2 layers, chunks of 8 rows: 2 layers alive, (3 + 3) boundaries, the jacobian rows
    assert estimate_step_bytes(args, 4, shape, 2, 8, fused=True) == \
        2 * 30 * 4608 + 8 * 512 * 16 + 6 * 30 * 32 * 4 + 20 * 32 * 4
    # chunks of 1,024 rows over 20 targets: one chunk of 20 rows runs (head.token_logps), not 1,024
    assert estimate_step_bytes(args, 4, shape, 2, 1024, fused=True) == \
        2 * 30 * 4608 + 20 * 512 * 16 + 6 * 30 * 32 * 4 + 20 * 32 * 4


def test_auto_plan_single_pass_when_it_fits_else_recompute():
    notices = []
    model = lora_model("llama")
    roomy = make_engine(load_config(overrides=["engine.memory_budget_gb=1", "data.demo_pairs=1"]).engine, model, ORPO(0.1),
                        report=notices.append)
    pairs = make_pairs()
    out = roomy.step(pairs, NORM)
    rs, chunk = roomy.plan_of(roomy.layout(pairs))
    assert rs.ranges == [(0, 5)] and chunk == 0
    roomy.step(make_pairs(1), NORM)  # other tokens, the same shape: no new choice, no new notice
    assert notices == ["engine plan for 1 x 41 tokens (38 targets): single pass "  # packed: 15 + 12 + 14
                               "(estimated peak 0.0 GiB, x 1.25 within a 1.0 GiB budget)"]
    roomy.step(random_pairs(3), NORM)  # another shape, the same choice: no new notice
    assert len(notices) == 1 and len(roomy.plan._chosen) == 2
    tight = make_engine(load_config(overrides=["engine.memory_budget_gb=0.000001", "data.demo_pairs=1"]).engine,
                        model, ORPO(0.1), report=notices.append)
    assert_parity(model, tight, pairs)
    rs, chunk = tight.plan_of(tight.layout(pairs))
    assert chunk == 1024 and len(rs.ranges) > 1
    assert "ranges of" in notices[-1]
    fixed = tight.plan.fixed_bytes  # the weights alone are over this budget: a smaller model, or more memory
    assert notices[-1].endswith(f"x 1.25 over the 0.00 GiB budget: no plan fits it, this one has the smallest estimate; "
                                f"the weights, the LoRA, its gradients and AdamW's moments alone take "
                                f"{fixed / GIB:.2f} GiB: raise engine.memory_budget_gb or use a smaller model)")
    mx.eval(out.loss)


def test_auto_over_budget_says_what_to_change():
    """The weights fit but no plan's activations do: the notice names the estimate, the budget and the
    keys that shrink a step (it used to stop at 'this one has the smallest estimate')."""
    notices, model = [], lora_model("llama")
    fixed = Plan(model, 5, "auto", 0, 1.0).fixed_bytes
    budget_gb = 1.3 * fixed / GIB  # room for the weights and a sliver of activations
    engine = make_engine(load_config(overrides=[f"engine.memory_budget_gb={budget_gb}", "data.demo_pairs=1"]).engine,
                         model, ORPO(0.1), report=notices.append)
    pairs = [TokenizedPair(list(range(5, 305)), list(range(5, 205)), list(range(5, 205)), "long")]
    rs, chunk = engine.plan_of(engine.layout(pairs))
    assert len(notices) == 1 and (len(rs.ranges), chunk) == (5, 1024)
    assert notices[0].startswith("engine plan for 1 x 700 tokens (699 targets): ranges of 1 layer, head chunks of 1024 "
                                 "(estimated peak ")
    assert notices[0].endswith("GiB budget: no plan fits it, this one has the smallest estimate; lower "
                               "engine.head_chunk_tokens (a chunk of 699 rows of the LM head takes 0.01 GiB), "
                               "train.micro_batch_pairs or data.max_length, or raise engine.memory_budget_gb)")


def test_a_fixed_plan_over_the_budget_is_reported_once_and_not_changed():
    """engine.kind segmented keeps its configured ranges whatever the budget; the user hears once
    that the estimate exceeds it (the estimate of the configured plan, by the same model)."""
    model, pairs = lora_model("llama"), make_pairs()
    for overrides, want in ((["engine.segment_layers=0"], "the single pass"),
                            (["engine.segment_layers=2", "engine.head_chunk_tokens=8"],
                             "ranges of 2 layers, head chunks of 8")):
        notices = []
        tight = make_engine(load_config(overrides=["engine.kind=segmented", "engine.memory_budget_gb=0.000001",
                                                   "data.demo_pairs=1", *overrides]).engine,
                            model, ORPO(0.1), report=notices.append)
        layout = tight.layout(pairs)
        rs, chunk = tight.plan_of(layout)
        assert (len(rs.ranges), chunk) == ((1, 0) if "single" in want else (3, 8))  # as configured
        assert_parity(model, tight, pairs)
        tight.step(random_pairs(3), NORM)  # another shape, still over: no second notice
        S, L = layout.shape
        assert len(notices) == 1, notices
        assert notices[0].startswith(f"engine plan for {S} x {L} tokens ({int(layout.targets.shape[0])} targets): "
                                     f"{want}, set by engine.segment_layers, is estimated at ")
        assert notices[0].endswith("over the 0.0 GiB engine.memory_budget_gb, which only engine.kind auto or "
                                   "engine.segment_layers auto follow); if memory runs short, use engine.kind auto")
    notices = []
    roomy = make_engine(load_config(overrides=["engine.kind=segmented", "engine.memory_budget_gb=1",
                                               "data.demo_pairs=1"]).engine, model, ORPO(0.1), report=notices.append)
    roomy.step(pairs, NORM)
    assert notices == []  # within the budget: nothing to say


def test_auto_is_the_default_and_bucket_keys_are_checked():
    cfg = Config()
    assert cfg.engine.kind == "auto" and cfg.engine.length_bucket == "auto" and cfg.engine.prefix_sharing
    assert isinstance(make_engine(cfg.engine, lora_model("llama"), ORPO(0.1)), SegmentedEngine)
    with pytest.raises(ConfigError, match="key 'engine.length_bucket' must be >= 0; got -1"):
        load_config(overrides=["engine.length_bucket=-1", "data.demo_pairs=1"])
    with pytest.raises(ConfigError, match="key 'engine.kind' must be one of auto, reference, segmented"):
        load_config(overrides=["engine.kind=fast", "data.demo_pairs=1"])


def test_engine_doc_describes_the_plan_plan_py_makes():
    """docs/engine.md's account of the auto plan names plan.py's estimate and its per-token formula, and
    says how auto chooses (it named an ``estimate_range_bytes`` that no longer exists, ``6D + 3I``
    floats per token, a worst-case micro-batch of ``data.max_length`` tokens and ~sqrt(layers) ranges)."""
    import re
    from pathlib import Path

    from dtrain.engine import plan

    text = (Path(__file__).resolve().parents[1] / "docs" / "engine.md").read_text()
    auto = text[text.index("`segment_layers: auto` ("):].split("\n\n")[0]
    for name in re.findall(r"`plan\.(\w+)`|`(estimate_\w+)`", auto):
        assert hasattr(plan, "".join(name)), name
    formula = re.search(r"``(16 D[^`]+)``", plan.layer_bytes_per_token.__doc__).group(1)
    assert formula.replace(" ", "") in auto.replace(" ", "")
    assert "estimate_step_bytes" in auto and "per layout shape" in auto and "ranges of one layer" in auto
    assert "estimate_range_bytes" not in text and "(≈ √layers)" not in text


def measured_and_estimated(model, kernels: str, segment_layers, head_chunk_tokens: int, pairs) -> tuple[float, float]:
    """MLX's peak of one step on the CPU and the plan's estimate of it (bytes; both count the weights once and
    the LoRA with its gradients; the step holds no AdamW moments, the estimate counts them)."""
    from dtrain.config import EngineConfig
    from dtrain.engine.plan import fused_attention
    from dtrain.engine.segmented import _attention_rows
    from dtrain.engine.layout import batch_totals
    from dtrain.memory import weight_bytes

    cfg = EngineConfig(kind="segmented", segment_layers=segment_layers, head_chunk_tokens=head_chunk_tokens,
                       kernels=kernels, memory_budget_gb=1000)
    engine = make_engine(cfg, model, ORPO(0.1), report=None)
    layout = engine.layout(pairs)
    masks = engine._masks(layout)
    rs, chunk = engine.plan_of(layout, masks)
    S, L = layout.shape
    shape = dict(tokens=S * L, targets=int(layout.targets.shape[0]), attention=_attention_rows(masks) or ((S, L),),
                 heads=model.args.num_attention_heads)
    plan = engine.plan
    est = plan.fixed_bytes + estimate_step_bytes(plan.args, plan.dtype.size, shape, rs.ranges[0][1], chunk,
                                                 fused_attention(plan.dtype), kept_exp=kernels == "dtrain")
    mx.eval(layout.tokens, masks)
    mx.clear_cache()
    others = mx.get_active_memory() - weight_bytes(model)  # the LoRA and what earlier tests left alive
    mx.reset_peak_memory()
    out = engine.step(pairs, batch_totals(pairs, "full"))
    mx.eval(out.loss, out.grads)
    return mx.get_peak_memory() - others + plan.fixed_bytes - weight_bytes(model), est


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", ["mlx", "dtrain"])
def test_the_estimate_bounds_the_measured_peak_of_a_head_heavy_step(dtype, kernels):
    """4 pairs of 1,116 targets over a 16,384-token vocabulary: the head dominates. The estimate counted
    ``2 itemsize + 8`` bytes per logit, but a chunk's vjp holds the logits' float32 copy in bfloat16 and,
    with kernels.logsumexp, the exp it keeps and its gradient: measured/estimated was 1.95 for ranges
    with a chunked head in bfloat16 (1.31 with MLX's kernels), beyond the x 1.25 margin, and auto's ranges
    under a budget took more memory than the single pass it refused."""
    model = lora_model("llama", vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    model.set_dtype(getattr(mx, dtype))
    rng = random.Random(0)
    pairs = [TokenizedPair([1] + [rng.randrange(5, 16384) for _ in range(39)],
                           [rng.randrange(5, 16384) for _ in range(119)] + [2],
                           [rng.randrange(5, 16384) for _ in range(119)] + [2], f"p{i}") for i in range(4)]
    for segment_layers, chunk in ((0, 0), (1, 1024), (2, 256)):
        peak, est = measured_and_estimated(model, kernels, segment_layers, chunk, pairs)
        assert peak <= est, (segment_layers, chunk, peak / est)


def head_heavy_pairs(vocab: int = 16384):
    rng = random.Random(0)
    return [TokenizedPair([1] + [rng.randrange(5, vocab) for _ in range(39)],
                          [rng.randrange(5, vocab) for _ in range(119)] + [2],
                          [rng.randrange(5, vocab) for _ in range(119)] + [2], f"p{i}") for i in range(4)]


@pytest.mark.parametrize("layers", [1, 4])
def test_when_no_plan_fits_auto_takes_the_smallest_estimate_the_single_pass_included(layers):
    """1,116 targets, a head chunk of 1,024 rows: the chunk's vjp holds more per row than the single pass,
    so recomputing saves nothing. With no plan within the budget, auto took ranges of one layer as 'the
    smallest estimate' although the single pass's was smaller (and so was its measured peak)."""
    model = lora_model("llama", vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=layers)
    model.set_dtype(mx.bfloat16)
    pairs, notices = head_heavy_pairs(), []
    fixed = Plan(model, layers, "auto", 0, 1.0).fixed_bytes
    engine = make_engine(load_config(overrides=[f"engine.memory_budget_gb={1.3 * fixed / GIB}", "data.demo_pairs=1",
                                                "engine.kernels=dtrain"]).engine, model, ORPO(0.1),
                         report=notices.append)
    rs, chunk = engine.plan_of(engine.layout(pairs))
    assert (rs.ranges, chunk) == ([(0, layers)], 0)
    assert notices[0].startswith("engine plan for 1 x 1120 tokens (1116 targets): single pass (estimated peak ")
    assert "no plan fits it, this one has the smallest estimate" in notices[0]
    single, _ = measured_and_estimated(model, "dtrain", 0, 0, pairs)
    ranges, _ = measured_and_estimated(model, "dtrain", 1, 1024, pairs)
    assert single < ranges


def test_over_budget_advice_names_the_head_chunk_when_the_head_takes_the_room(monkeypatch):
    """A 16,384-token vocabulary: one head chunk of 1,024 rows takes more than the room the budget leaves, and
    engine.head_chunk_tokens 64 makes ranges fit, but the notice named only micro_batch_pairs, max_length and
    the budget, which cut data or need memory."""
    model = lora_model("llama", vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    model.set_dtype(mx.bfloat16)
    shapes, choose_of = [], Plan._choose
    monkeypatch.setattr(Plan, "_choose", lambda self, shape, key: shapes.append(shape) or choose_of(self, shape, key))
    probe = make_engine(load_config(overrides=["data.demo_pairs=1", "engine.kernels=dtrain"]).engine, model, ORPO(0.1))
    probe.plan_of(probe.layout(head_heavy_pairs()))
    fits_64 = probe.plan.fixed_bytes + estimate_step_bytes(model.args, 2, shapes[0], 1, 64,
                                                           fused_attention(mx.bfloat16), True)
    budget_gb = 1.01 * fits_64 * 1.25 / GIB
    for chunk, ending in ((0, "lower engine.head_chunk_tokens (a chunk of 1024 rows of the LM head takes 0.38 GiB), "
                              "train.micro_batch_pairs or data.max_length, or raise engine.memory_budget_gb)"),
                          (64, f"within a {budget_gb:.1f} GiB budget)")):
        notices = []
        engine = make_engine(load_config(overrides=[f"engine.memory_budget_gb={budget_gb}", "data.demo_pairs=1",
                                                    "engine.kernels=dtrain", f"engine.head_chunk_tokens={chunk}"]).engine,
                             model, ORPO(0.1), report=notices.append)
        engine.plan_of(engine.layout(head_heavy_pairs()))
        assert notices[0].endswith(ending), notices


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_estimate_bounds_the_measured_peak_of_ranges_of_one_layer_under_mlx_s_attention(dtype):
    """One 1,200-token pair, 16 heads of 4 dimensions: the attention scores dominate. MLX's unfused attention
    (Metal's kernels, engine.kernels mlx) keeps one score array per layer for the backward and makes two more
    in it; the estimate counted two per layer, so ranges of one layer measured 1.40x their estimate."""
    model = lora_model("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=4)
    model.set_dtype(getattr(mx, dtype))
    rng = random.Random(0)
    pairs = [TokenizedPair([1] + [rng.randrange(5, 512) for _ in range(599)], [rng.randrange(5, 512) for _ in range(299)]
                           + [2], [rng.randrange(5, 512) for _ in range(299)] + [2], "long")]
    for segment_layers in (1, 2, 0):
        peak, est = measured_and_estimated(model, "mlx", segment_layers, 1024 if segment_layers else 0, pairs)
        assert peak <= est, (segment_layers, peak / est)
