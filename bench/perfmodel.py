"""A model of data-parallel step time: how much faster N ranks (Macs) train.

One optimizer step on ``N`` ranks (dtrain's trainer, no overlap):

    step = pair_seconds * pairs_per_rank + allreduce_seconds + host_seconds

where ``allreduce_seconds`` is the ring all-reduce of the LoRA gradients,
which dtrain sums as float32 in flat buckets of at most 32 MiB
(``Group.all_sum_tree``), one ``all_sum`` per bucket:

    per bucket of b bytes:  2 (N - 1) / N * b / bandwidth  +  2 (N - 1) * hop_latency

Sources: the ring all-reduce (reduce-scatter then all-gather, 2 (N - 1) steps,
each rank sending 2 (N - 1) / N of the buffer) is Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 69 (2009),
and the alpha-beta cost of Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 19 (2005). The same
2 (N - 1) / N factor turns a measured all-reduce time into the "bus bandwidth"
that NCCL's tests and MLX's ring backend PR (ml-explore/mlx#1784) report.

Units everywhere: seconds, bytes, bytes per second. Everything here is pure
arithmetic; ``bench/scaling.py`` measures the inputs and docs/scaling.md gives
the tables. Not part of dtrain: bench/ and tests/test_perfmodel.py use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import prelude  # noqa: F401  (the repository on sys.path)
from dtrain.models import DEMO_SHAPE

BUCKET_BYTES = 32 * 1024 * 1024  # dtrain.distributed.BUCKET_BYTES (kept equal by a test; no MLX import here)
FLOAT32_BYTES = 4  # all_sum_tree casts every gradient leaf to float32


@dataclass(frozen=True)
class ModelShape:
    """The decoder widths that fix a LoRA gradient's size.

    ``q_width`` = attention heads x head dim, ``kv_width`` = KV heads x head dim
    (grouped-query attention), as in the model's ``config.json``.
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    q_width: int
    kv_width: int

    @classmethod
    def from_config(cls, name: str, c: dict) -> "ModelShape":
        """The shape of an mlx-lm/HF ``config.json`` dict (head dim: ``hidden_size / num_attention_heads``)."""
        head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(name, c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"],
                   c["num_attention_heads"] * head, c["num_key_value_heads"] * head)

    def linears(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of every linear layer of one decoder layer, by mlx-lm key."""
        h, q, kv, m = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, m), "mlp.up_proj": (h, m), "mlp.down_proj": (m, h)}


# Shapes from each model's config.json on the Hugging Face hub.
SHAPES = {
    "smollm2-135m": ModelShape.from_config("SmolLM2-135M", DEMO_SHAPE),
    "llama3.2-1b": ModelShape("Llama-3.2-1B", 16, 2048, 8192, 32 * 64, 8 * 64),
    "llama3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 14336, 32 * 128, 8 * 128),
    "llama3.1-70b": ModelShape("Llama-3.1-70B", 80, 8192, 28672, 64 * 128, 8 * 128),
}


def lora_parameters(shape: ModelShape, rank: int, keys: Optional[Sequence[str]] = None, num_layers: int = -1) -> int:
    """Trainable LoRA parameters: ``rank * (in + out)`` per adapted linear layer.

    mlx-lm's ``LoRALinear`` adds ``lora_a`` (in, r) and ``lora_b`` (r, out);
    ``keys`` None = every linear layer of a decoder layer (``lora.keys: null``),
    ``num_layers`` -1 = all layers (as ``dtrain.lora.apply_lora``).

    Raises:
        KeyError: a key that is not one of :meth:`ModelShape.linears`.
    """
    linears = shape.linears()
    chosen = list(linears) if keys is None else list(keys)
    layers = shape.layers if num_layers < 0 else min(num_layers, shape.layers)
    return layers * sum(rank * sum(linears[k]) for k in chosen)


@dataclass(frozen=True)
class Link:
    """A network as the ring sees it.

    ``bandwidth``: bytes per second one rank sends around the ring (the bus
    bandwidth); ``hop_latency``: seconds per ring step; ``source``: where the
    figures come from.
    """

    name: str
    bandwidth: float
    hop_latency: float
    source: str = ""


def tcp_goodput(line_bits_per_s: float, mtu: int = 1500, frame_overhead: int = 38, headers: int = 52) -> float:
    """TCP payload bytes per second on a link of ``line_bits_per_s``.

    Each frame carries ``mtu - headers`` payload bytes (IPv4 20 + TCP 20 + the
    timestamp option 12, Linux and macOS defaults) and costs ``mtu +
    frame_overhead`` bytes of line time (Ethernet header 14 + FCS 4 + preamble 8
    + inter-frame gap 12 = 38; ``tc tbf`` on a veth counts only the 14-byte header).
    """
    return line_bits_per_s / 8 * (mtu - headers) / (mtu + frame_overhead)


def bus_bandwidth(nbytes: float, n: int, seconds: float) -> float:
    """The bandwidth a measured all-reduce implies: ``2 (n - 1) / n * nbytes / seconds``.

    The inverse of the ring's bandwidth term; MLX's ring PR (#1784) computes
    its plotted bandwidth the same way ("total bytes * 3/4 * 2 / time" at n = 4).
    """
    return 2 * (n - 1) / n * nbytes / seconds


def ring_allreduce_seconds(nbytes: float, n: int, link: Link, bucket_bytes: int = BUCKET_BYTES) -> float:
    """Seconds for dtrain's bucketed ring all-reduce of ``nbytes`` over ``n`` ranks.

    One ring all-reduce per bucket of at most ``bucket_bytes``, run one after
    the other: ``sum over buckets of 2 (n-1)/n * b / bandwidth + 2 (n-1) * hop_latency``.
    0 for one rank (dtrain does no collective there).
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    full, rest = divmod(int(nbytes), bucket_bytes)
    buckets = [bucket_bytes] * full + ([rest] if rest else [])
    return sum(2 * (n - 1) / n * b / link.bandwidth + 2 * (n - 1) * link.hop_latency for b in buckets)


def pairs_per_rank(global_batch_pairs: int, n: int) -> int:
    """Pairs on the busiest rank: the global batch dealt round-robin (``sampler.rank_shard``)."""
    return math.ceil(global_batch_pairs / n)


def step_seconds(pair_seconds: float, pairs: int, allreduce_seconds: float, host_seconds: float) -> float:
    """One optimizer step: compute of the busiest rank, then the all-reduce, then host work.

    ``host_seconds``: the per-step work that does not shrink with more ranks
    (AdamW update, clipping, metrics, batch layout, evaluation syncs).
    """
    return pair_seconds * pairs + allreduce_seconds + host_seconds


def speedup(pair_seconds: float, global_batch_pairs: int, n: int, allreduce_seconds: float,
            host_seconds: float) -> float:
    """Step time of one rank over step time of ``n`` ranks for the same global batch."""
    one = step_seconds(pair_seconds, global_batch_pairs, 0.0, host_seconds)
    return one / step_seconds(pair_seconds, pairs_per_rank(global_batch_pairs, n), allreduce_seconds, host_seconds)


def pairs_for_share(allreduce_seconds: float, pair_seconds: float, share: float) -> int:
    """Fewest pairs per rank per step for which the all-reduce is at most ``share`` of the step.

    From ``a / (p c + a) <= s``: ``p >= a (1 - s) / (s c)`` (host work left out,
    which only lowers the share). Gradient accumulation in dtrain is exactly
    this: more pairs per rank between two all-reduces (a larger
    ``global_batch_pairs``; ``micro_batch_pairs`` only bounds memory).
    """
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share}")
    return max(1, math.ceil(allreduce_seconds * (1 - share) / (share * pair_seconds) - 1e-9))


def overlap_saving(allreduce_seconds: float, last_bucket_seconds: float, backward_seconds: float) -> float:
    """Seconds an all-reduce overlapped with the backward pass would save per step.

    With buckets sent as soon as their layers' gradients exist, only the last
    bucket must wait for the backward pass to end; the rest hides behind the
    backward of the step's last micro-batch (earlier micro-batches only
    accumulate). The saving is the hidden part: ``min(allreduce - last_bucket,
    backward)``. dtrain does not overlap today; this says when it would pay.
    """
    return max(0.0, min(allreduce_seconds - last_bucket_seconds, backward_seconds))


def largest_worthwhile(pair_seconds: float, global_batch_pairs: int, nbytes: float, link: Link,
                       host_seconds: float, efficiency: float = 0.75, ranks: Sequence[int] = range(2, 17)) -> int:
    """The most ranks in ``ranks`` whose speed-up is still ``>= efficiency * n`` (1 when none is)."""
    best = 1
    for n in ranks:
        a = ring_allreduce_seconds(nbytes, n, link)
        if speedup(pair_seconds, global_batch_pairs, n, a, host_seconds) >= efficiency * n:
            best = n
    return best
