"""The segmented engine's plan: which layer ranges, how K/V cross them, how much memory.

Pure functions of the model's shape and the layout's shape (nothing here runs a
layer): the range bounds of a range size, the Gemma 4 K/V each range imports
from below or exports above, the activation-memory model of a step, and
:class:`Plan`, which gives each layout shape its ``(layers per range, head
chunk)`` — fixed by the config, or (``segment_layers: auto``) the single pass
when its estimate fits the memory budget, else the largest range size that does.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.utils import tree_flatten

from ..device import on_gpu
from ..memory import GIB, default_budget_bytes, weight_bytes
from .layout import Layout

AUTO_HEAD_CHUNK = 1024  # target rows per head chunk when the plan recomputes and none is configured
# measured peak / estimate on an H200 (docs/gpu.md): 0.97-1.45; plans keep this headroom
ESTIMATE_MARGIN = 1.25


def fused_attention(dtype) -> bool:
    """Whether MLX runs attention fused (no ``(Lq, Lk)`` scores kept): its CUDA
    backend does for float16/bfloat16 through cuDNN; elsewhere the scores exist."""
    cuda = getattr(mx, "cuda", None)
    return on_gpu() and dtype in (mx.float16, mx.bfloat16) and bool(cuda and cuda.is_available())


def layer_bytes_per_token(args, itemsize: int) -> float:
    """Bytes one decoder layer keeps per token for its backward (LoRA on every linear).

    ~``16 D + 8 I + 2 (q + 2 kv)`` values: norms, projections and their LoRA
    branches, rotated q/k, the attention output, the gated MLP. An estimate,
    checked against measured peaks in docs/gpu.md.
    """
    D, I, H = args.hidden_size, args.intermediate_size, args.num_attention_heads
    kv = getattr(args, "num_key_value_heads", None) or H
    dh = getattr(args, "head_dim", None) or D // H
    return itemsize * (16 * D + 8 * I + 2 * (H + 2 * kv) * dh)


def head_bytes_per_logit(itemsize: int, chunked: bool, kept_exp: bool) -> int:
    """Bytes the LM head holds at its peak per target row and vocabulary entry: the logits and their
    gradient in the model's dtype and the float32 log-softmax and its gradient (``2 itemsize + 8``), and with
    ``kernels.logsumexp`` (``kept_exp``) the float32 ``exp(x - max)`` it keeps for its backward. A chunk's
    vjp (``chunked``: ``head.token_logps``, log-probabilities and Jacobian evaluated together) holds more:
    below float32 the logits' float32 copy (``loss.upcast``), and with ``kept_exp`` one more float32 array."""
    if not chunked:
        return 2 * itemsize + 8 + 4 * kept_exp
    return 2 * itemsize + 8 + 4 * (itemsize < 4) + 8 * kept_exp


def head_bytes(args, itemsize: int, targets: int, chunk: int, chunked: bool, kept_exp: bool) -> tuple[int, float]:
    """The LM head's rows that run at once (``chunk`` of the ``targets``; all of them where ``chunk`` is 0 or
    not below their count) and the bytes they hold at the peak (:func:`head_bytes_per_logit`)."""
    rows = min(chunk, targets) if chunk > 0 else targets  # fewer targets than a chunk: one chunk of N rows runs
    return rows, rows * args.vocab_size * head_bytes_per_logit(itemsize, chunked, kept_exp)


def estimate_step_bytes(args, itemsize: int, shape: dict, size: int, chunk: int, fused: bool,
                        kept_exp: bool = False) -> float:
    """Estimated activation peak (bytes, weights excluded) of one step.

    Args:
        args: the model's ``ModelArgs``.
        itemsize: bytes per activation value (the model dtype's).
        shape: ``tokens`` (S * L), ``targets`` (N), ``attention`` (the
            attention calls' ``(rows, length)`` or ``(rows, length, first
            query)``: scores for the queries from the first on), ``heads``.
        size: layers per range (0 or >= layers: one range).
        chunk: head rows per chunk (0: the whole head at once).
        fused: attention keeps no scores (see ``fused_attention``).
        kept_exp: the head's log-sum-exp keeps its exponentials (``head_bytes_per_logit``).
    Returns:
        bytes: kept boundaries + the layers alive at once + the head.
    """
    n = args.num_hidden_layers
    size = n if size <= 0 else min(size, n)
    T, N, D = shape["tokens"], shape["targets"], args.hidden_size
    slots = sum(rows * (length - start) * length for rows, length, start in ((*a, 0)[:3] for a in shape["attention"]))
    # one score array per layer alive is kept for the backward, and the layer in its backward makes two
    # more (its probabilities' and scores' gradients): two per layer, and three for a range of one
    scores = 0.0 if fused else max(2 * size, size + 2) * slots * shape["heads"] * itemsize
    layers = size * T * layer_bytes_per_token(args, itemsize) + scores
    _, head = head_bytes(args, itemsize, N, chunk, chunk > 0 or size < n, kept_exp)
    if size >= n and chunk <= 0:  # the single pass: nothing else kept
        return layers + head
    boundaries = (math.ceil(n / size) + 3) * T * D * itemsize  # + dL/dh, the cotangent, the jacobian rows
    return layers + head + boundaries + N * D * itemsize


def kv_imports(donors: list, lo: int, hi: int) -> list[int]:
    """Donors below ``lo`` whose K/V layers in [lo, hi) reuse."""
    return sorted({d for d in donors[lo:hi] if d is not None and d < lo})


def kv_exports(donors: list, lo: int, hi: int) -> list[int]:
    """Layers in [lo, hi) whose K/V layers at or above ``hi`` reuse."""
    return sorted({d for d in donors[hi:] if d is not None and lo <= d < hi})


def range_bounds(n_layers: int, size: int) -> list[tuple[int, int]]:
    """``[(lo, hi)]`` of ranges of ``size`` layers (0 or >= ``n_layers``: one range)."""
    size = n_layers if size <= 0 else min(size, n_layers)
    return [(lo, min(lo + size, n_layers)) for lo in range(0, n_layers, size)]


class Plan:
    """``(layers per range, head chunk)`` of each layout shape.

    Args:
        model: the mlx-lm model (its ``args``, dtype, weight and LoRA bytes).
        n_layers: decoder layers.
        segment_layers: layers per range (0: one range), or ``"auto"``.
        head_chunk_tokens: the configured head chunk (0: whole head; with
            ``"auto"``, the chunk used when recomputing, 0 = ``AUTO_HEAD_CHUNK``).
        memory_budget: bytes for ``"auto"``, weights included (0: ``dtrain.memory.default_budget_bytes``).
        kept_exp: the head's log-sum-exp keeps its exponentials (``kernels.logsumexp``; ``head_bytes_per_logit``).

    ``"auto"`` chooses once per shape and passes each change of choice to ``report``
    (the run's notices, shown on rank 0 only; None: silent). A fixed plan is
    estimated too, and the first shape whose estimate x ``ESTIMATE_MARGIN``
    exceeds the budget is reported once: the budget does not change a fixed plan.
    """

    def __init__(self, model, n_layers: int, segment_layers, head_chunk_tokens: int, memory_budget: float = 0.0,
                 report=None, kept_exp: bool = False):
        self.args, self.n_layers = model.args, n_layers
        self.auto = segment_layers == "auto"
        self.size = n_layers if self.auto or segment_layers <= 0 else min(segment_layers, n_layers)
        self.head_chunk_tokens, self.kept_exp = head_chunk_tokens, kept_exp
        weights = weight_bytes(model)
        self.memory_budget = memory_budget or default_budget_bytes(counted=weights)
        self.dtype = next(v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
        lora_bytes = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
        self.fixed_bytes = weights + 3 * lora_bytes  # + gradients and AdamW's two moments
        self._chosen = {}  # shape -> (range size, head chunk)
        self._reported = None  # the last choice reported
        self.report = report or (lambda _: None)

    def __call__(self, layout: Layout, attention_rows: tuple | None) -> tuple[int, int]:
        """The plan of ``layout``; ``attention_rows``: the ``(rows, length, first query)`` of each
        group of its prefix-sharing attention (``attention.SharedAttention``), None when it attends
        as ``(S, L)``."""
        S, L = layout.shape
        attention = tuple(attention_rows or ((S, L),))
        key = (S, L, int(layout.targets.shape[0]), attention)
        shape = dict(tokens=S * L, targets=key[2], attention=attention, heads=self.args.num_attention_heads)
        if not self.auto:
            if not self._reported:
                self._check_fixed(shape, key)
            return self.size, self.head_chunk_tokens
        if key not in self._chosen:
            self._chosen[key] = self._choose(shape, key)
        return self._chosen[key]

    def _check_fixed(self, shape: dict, key: tuple) -> None:
        est = self.fixed_bytes + estimate_step_bytes(self.args, self.dtype.size, shape, self.size,
                                                     self.head_chunk_tokens, fused_attention(self.dtype), self.kept_exp)
        if est * ESTIMATE_MARGIN > self.memory_budget:
            self._reported = True
            what = ("the single pass" if self.size >= self.n_layers and self.head_chunk_tokens <= 0 else
                    f"ranges of {self.size} layers, head chunks of {self.head_chunk_tokens or 'the whole head'}")
            self.report(f"engine plan for {key[0]} x {key[1]} tokens ({key[2]} targets): {what}, set by "
                        f"engine.segment_layers, is estimated at {est / GIB:.1f} GiB (with the x{ESTIMATE_MARGIN} margin, over "
                        f"the {self.memory_budget / GIB:.1f} GiB engine.memory_budget_gb, which only engine.kind auto "
                        f"or engine.segment_layers auto follow); if memory runs short, use engine.kind auto")

    def _choose(self, shape: dict, key: tuple) -> tuple[int, int]:
        chunk = self.head_chunk_tokens or AUTO_HEAD_CHUNK
        choice, est = choose(self.args, self.n_layers, self.dtype.size, fused_attention(self.dtype), shape,
                             self.fixed_bytes, self.memory_budget, chunk, self.kept_exp)
        layers = f"{choice[0]} layer{'s' if choice[0] != 1 else ''}"
        what = "single pass" if choice == (self.n_layers, 0) else f"ranges of {layers}, head chunks of {chunk}"
        if choice != self._reported:  # a notice when the plan changes, not per shape (exact shapes: every step)
            self._reported = choice
            fits = est * ESTIMATE_MARGIN <= self.memory_budget
            self.report(f"engine plan for {key[0]} x {key[1]} tokens ({key[2]} targets): {what} (estimated peak "
                        f"{est / GIB:.1f} GiB, x {ESTIMATE_MARGIN} "
                        + (f"within a {self.memory_budget / GIB:.1f} GiB budget)" if fits else
                           f"over the {self.memory_budget / GIB:.2f} GiB budget: no plan fits it, this one has the "
                           f"smallest estimate; {self._what_to_change(shape, chunk)})"))
        return choice

    def _what_to_change(self, shape: dict, chunk: int) -> str:
        """The advice of a shape no plan fits: the model when its fixed bytes alone are over the budget; the head
        chunk when one chunk of ``chunk`` rows takes over half the room left for a step; else the step."""
        if self.fixed_bytes * ESTIMATE_MARGIN > self.memory_budget:
            return (f"the weights, the LoRA, its gradients and AdamW's moments alone take {self.fixed_bytes / GIB:.2f} "
                    f"GiB: raise engine.memory_budget_gb or use a smaller model")
        step = "train.micro_batch_pairs or data.max_length, or raise engine.memory_budget_gb"
        rows, head = head_bytes(self.args, self.dtype.size, shape["targets"], chunk, True, self.kept_exp)
        if rows > 1 and 2 * head > self.memory_budget / ESTIMATE_MARGIN - self.fixed_bytes:
            return (f"lower engine.head_chunk_tokens (a chunk of {rows} rows of the LM head takes {head / GIB:.2f} "
                    f"GiB), {step}")
        return f"lower {step}"


def choose(args, n_layers: int, itemsize: int, fused: bool, shape: dict, fixed_bytes: float, memory_budget: float,
           chunk: int, kept_exp: bool = False) -> tuple[tuple[int, int], float]:
    """``auto``'s plan for one shape: the single pass when its estimate x ``ESTIMATE_MARGIN`` fits
    ``memory_budget``, else the largest range size that does (the fewest ranges: every plan that
    recomputes runs each layer twice), else the one with the smallest estimate, the single pass included.

    Args:
        shape: as :func:`estimate_step_bytes`.
        fixed_bytes: weights + LoRA, its gradients and AdamW moments (bytes).
        chunk: head rows per chunk when recomputing.
        kept_exp: as :func:`estimate_step_bytes`.
    Returns:
        ``((layers per range, head chunk), estimated peak bytes)``; the single pass is ``(n_layers, 0)``.
    """
    budget = memory_budget / ESTIMATE_MARGIN
    single = fixed_bytes + estimate_step_bytes(args, itemsize, shape, 0, 0, fused, kept_exp)
    if single <= budget:
        return (n_layers, 0), single
    sizes = {m: fixed_bytes + estimate_step_bytes(args, itemsize, shape, m, chunk, fused, kept_exp)
             for m in range(1, n_layers + 1)}
    fitting = [m for m, b in sizes.items() if b <= budget]
    if fitting:
        return (max(fitting), chunk), sizes[max(fitting)]
    m = min(sizes, key=sizes.get)  # a chunk's vjp holds more per row than the single pass: it may be the smallest
    return ((m, chunk), sizes[m]) if sizes[m] < single else ((n_layers, 0), single)
