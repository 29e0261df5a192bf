"""bench/perfmodel.py on worked numbers, and its LoRA count against the LoRA layers themselves.

Worked numbers (by hand):

- SmolLM2-135M, rank 8 on all 7 linear layers: per layer r * (in + out) summed =
  8 * (1152 + 768 + 768 + 1152 + 2112 + 2112 + 2112) = 8 * 10176; x 30 layers = 2,442,240.
- Llama-3.2-1B, rank 16: (4096 + 2560 + 2560 + 4096 + 3 * 10240) = 44,032; x 16 x 16 = 11,272,192.
- Llama-3.1-8B, rank 16: (8192 + 5120 + 5120 + 8192 + 3 * 18432) = 81,920; x 16 x 32 = 41,943,040.
- Llama-3.1-70B, rank 64: (16384 + 9216 + 9216 + 16384 + 3 * 36864) = 161,792; x 64 x 80 = 828,375,040.
- Ring all-reduce of 1e8 bytes over 4 ranks, 1 GB/s, 0.1 ms per hop, 32 MiB buckets
  (33,554,432 B: two full buckets and 32,891,136 B): bandwidth 2*3/4 * 1e8 / 1e9 = 0.15 s,
  latency 3 buckets * 2*3 hops * 1e-4 = 0.0018 s; total 0.1518 s.
- Bus bandwidth of MLX's 2 GB 4-way all-reduce in 0.27 s: 1.5 * 2e9 / 0.27 = 11.111 GB/s.
- TCP payload rate of 1 GbE: 125e6 B/s * 1448 / 1538 = 117,685,305.6 B/s; counting only the
  14-byte Ethernet header (tc tbf on a veth): 125e6 * 1448 / 1514 = 119,550,858.6 B/s.
- Speed-up, 0.5 s per pair, global batch 8, 3 ranks (3 pairs on the busiest), all-reduce 0.2 s,
  host 0.1 s: (8 * 0.5 + 0.1) / (3 * 0.5 + 0.2 + 0.1) = 4.1 / 1.8 = 2.2778.
- Pairs per rank for an all-reduce of 1 s to be <= 10% of the step at 0.5 s per pair:
  1 * 0.9 / (0.1 * 0.5) = 18 (18 pairs: 1 / (9 + 1) = 10%; 17: 1 / 9.5 = 10.5%).
"""

from __future__ import annotations

import random

import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from dtrain.config import LoraConfig
from dtrain.distributed import BUCKET_BYTES
from dtrain.lora import apply_lora
import perfmodel as pm  # bench/perfmodel.py (conftest puts bench/ on the path)


@pytest.mark.parametrize("key,rank,expected", [("smollm2-135m", 8, 2_442_240), ("llama3.2-1b", 16, 11_272_192),
                                               ("llama3.1-8b", 16, 41_943_040), ("llama3.1-70b", 64, 828_375_040)])
def test_lora_parameters_of_the_table_shapes(key, rank, expected):
    assert pm.lora_parameters(pm.SHAPES[key], rank) == expected


def test_lora_parameters_with_keys_and_fewer_layers():
    smol = pm.SHAPES["smollm2-135m"]
    # q and v on the last 10 layers, rank 4: 10 * 4 * (1152 + 768)
    assert pm.lora_parameters(smol, 4, ["self_attn.q_proj", "self_attn.v_proj"], num_layers=10) == 76_800
    assert pm.lora_parameters(smol, 4, num_layers=99) == pm.lora_parameters(smol, 4)
    with pytest.raises(KeyError):
        pm.lora_parameters(smol, 4, ["self_attn.qkv"])


def test_lora_parameters_match_the_lora_layers_mlx_lm_builds():
    """The count from shapes equals the trainable parameters dtrain.lora.apply_lora creates."""
    rng = random.Random(7)
    keys = list(pm.ModelShape("x", 1, 1, 1, 1, 1).linears())
    for _ in range(6):
        head_dim, heads, kv_heads = rng.choice([4, 8]), rng.choice([2, 4]), rng.choice([1, 2])
        shape = pm.ModelShape("tiny", rng.randint(1, 4), heads * head_dim * rng.choice([1, 2]), rng.randint(8, 40),
                              heads * head_dim, kv_heads * head_dim)
        args = llama.ModelArgs(model_type="llama", hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                               intermediate_size=shape.intermediate, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, vocab_size=64)
        chosen = rng.sample(keys, rng.randint(1, len(keys))) if rng.random() < 0.7 else None
        num_layers, rank = rng.choice([-1, 1, shape.layers]), rng.randint(1, 8)
        model = llama.Model(args)
        count = apply_lora(model, LoraConfig(rank=rank, keys=chosen, num_layers=num_layers))
        assert count == sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
        assert count == pm.lora_parameters(shape, rank, chosen, num_layers), (shape, chosen, num_layers, rank)


def test_ring_allreduce_worked_example():
    link = pm.Link("test", 1e9, 1e-4)
    assert pm.ring_allreduce_seconds(1e8, 4, link) == pytest.approx(0.1518, rel=1e-12)
    # one bucket when it fits; the bandwidth term does not depend on the split
    assert pm.ring_allreduce_seconds(1e8, 4, link, bucket_bytes=10**9) == pytest.approx(0.15 + 6e-4, rel=1e-12)
    assert pm.ring_allreduce_seconds(1e8, 2, pm.Link("t", 1e9, 0.0)) == pytest.approx(0.1, rel=1e-12)
    assert pm.ring_allreduce_seconds(1e8, 1, link) == 0.0 and pm.ring_allreduce_seconds(0, 4, link) == 0.0
    assert pm.BUCKET_BYTES == BUCKET_BYTES


def test_bus_bandwidth_inverts_the_ring_bandwidth_term():
    assert pm.bus_bandwidth(2e9, 4, 0.27) == pytest.approx(11.111111e9, rel=1e-6)
    assert pm.bus_bandwidth(2e9, 4, 1.3) == pytest.approx(2.307692e9, rel=1e-6)
    rng = random.Random(3)
    for _ in range(20):
        nbytes, n, bw = rng.randint(10**6, 10**10), rng.randint(2, 16), rng.uniform(1e7, 1e11)
        t = pm.ring_allreduce_seconds(nbytes, n, pm.Link("t", bw, 0.0), bucket_bytes=2**62)
        assert pm.bus_bandwidth(nbytes, n, t) == pytest.approx(bw, rel=1e-9)


def test_tcp_goodput():
    assert pm.tcp_goodput(1e9) == pytest.approx(117_685_305.6, rel=1e-9)
    assert pm.tcp_goodput(1e9, frame_overhead=14) == pytest.approx(119_550_858.6, rel=1e-9)
    assert pm.tcp_goodput(10e9) == pytest.approx(10 * pm.tcp_goodput(1e9), rel=1e-12)


def test_step_and_speedup_worked_example():
    assert pm.pairs_per_rank(8, 3) == 3 and pm.pairs_per_rank(8, 4) == 2 and pm.pairs_per_rank(8, 16) == 1
    assert pm.step_seconds(0.5, 3, 0.2, 0.1) == pytest.approx(1.8)
    assert pm.speedup(0.5, 8, 3, 0.2, 0.1) == pytest.approx(4.1 / 1.8, rel=1e-12)
    assert pm.speedup(0.5, 8, 1, 0.0, 0.1) == pytest.approx(1.0)


def test_pairs_for_share():
    assert pm.pairs_for_share(1.0, 0.5, 0.1) == 18
    assert pm.pairs_for_share(1.0, 0.5, 0.2) == 8  # 0.8 / 0.1
    assert pm.pairs_for_share(0.001, 10.0, 0.1) == 1
    rng = random.Random(5)
    for _ in range(50):
        a, c, s = rng.uniform(0.01, 5), rng.uniform(0.01, 5), rng.uniform(0.01, 0.9)
        p = pm.pairs_for_share(a, c, s)
        assert a / (p * c + a) <= s + 1e-12
        assert p == 1 or a / ((p - 1) * c + a) > s
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="share must be in"):
            pm.pairs_for_share(1.0, 1.0, bad)


def test_overlap_saving():
    assert pm.overlap_saving(1.0, 0.3, 0.5) == pytest.approx(0.5)  # backward too short to hide it all
    assert pm.overlap_saving(1.0, 0.3, 2.0) == pytest.approx(0.7)  # all but the last bucket hidden
    assert pm.overlap_saving(0.2, 0.3, 1.0) == 0.0


def test_largest_worthwhile():
    # 1e8 bytes at 1e8 B/s, no latency, no host work, global batch 16: step_n = c * ceil(16/n) + 2(n-1)/n.
    link = pm.Link("t", 1e8, 0.0)
    # c = 1: n = 2 gives 16 / 9 = 1.78 >= 1.5; n = 3 gives 16 / 7.33 = 2.18 < 2.25, and larger n do worse
    assert pm.largest_worthwhile(1.0, 16, 1e8, link, 0.0) == 2
    # c = 10: n = 16 gives 160 / 11.875 = 13.5 >= 12
    assert pm.largest_worthwhile(10.0, 16, 1e8, link, 0.0) == 16
    assert pm.largest_worthwhile(0.01, 16, 1e8, link, 0.0) == 1
