"""The segmented engine: layer ranges recomputed inside ``mx.vjp``.

Forward, the decoder layers run range by range and only the hidden state at
each range boundary is kept (evaluated, graph-free). The LM head runs in token
chunks (head.py) and gives ``dL/dh`` at the last boundary. Backward, each range
is recomputed inside ``mx.vjp`` with its input boundary and its LoRA
parameters as primals; that yields the range's LoRA gradients and ``dL/dh``
for the range below, evaluated before the next range so its graph is freed.
Peak memory is a few boundaries plus one range's activations, instead of
every layer's activations and the full ``(S, L, V)`` logits.

Masks and positions are explicit (layout.py), so prefix sharing — one
``[prompt; chosen; rejected]`` sequence per pair — needs no model changes.
This is gradient checkpointing at range granularity (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost").
"""

from __future__ import annotations

import math
import os
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from ..config import Config
from ..types import TokenizedPair
from .arch import Arch, adapter_for, module_name
from .common import Norm, StepResult, layout_counts, loss_from_token_logps
from .head import hidden_grad, token_logps
from .layout import Layout, attention_plan, shared_prefix_layout, two_sequence_layout
from .reference import ReferenceEngine

GIB = 1024**3


def _notice(msg: str) -> None:
    print(f"dtrain: {msg}", file=sys.stderr)


def estimate_range_bytes(args, seqs: int, length: int) -> tuple[float, float]:
    """Rough float32 bytes of one boundary state and of one layer's recompute.

    Per layer inside a vjp: ~``6 D + 3 I + 2 (q + 2 kv)`` floats per token plus
    two ``(S, H, L, L)`` attention-score arrays (CPU attention materialises them).
    Returns ``(boundary_bytes, layer_bytes)``.
    """
    D, I, H = args.hidden_size, args.intermediate_size, args.num_attention_heads
    kv = getattr(args, "num_key_value_heads", None) or H
    dh = getattr(args, "head_dim", None) or D // H
    tokens = seqs * length
    per_token = 6 * D + 3 * I + 2 * (H + 2 * kv) * dh
    return 4.0 * tokens * D, 4.0 * (tokens * per_token + 2 * seqs * H * length * length)


def auto_segment_layers(n_layers: int, boundary_bytes: float, layer_bytes: float, budget_bytes: float) -> int:
    """The largest range size whose estimated activation peak fits ``budget_bytes``.

    Peak(n) ~ (ceil(n_layers / n) + 1) boundaries + n layers of recompute.
    If none fits, the size with the smallest estimate (about sqrt(n_layers)).
    """
    peak = lambda n: (math.ceil(n_layers / n) + 1) * boundary_bytes + n * layer_bytes  # noqa: E731
    fitting = [n for n in range(1, n_layers + 1) if peak(n) <= budget_bytes]
    return max(fitting) if fitting else min(range(1, n_layers + 1), key=peak)


def _set_params(layers: list, names: list, params: list) -> None:
    """Put the flat ``params`` (in ``names`` order, layer by layer) into ``layers``."""
    i = 0
    for layer, keys in zip(layers, names):
        if keys:
            layer.update(tree_unflatten(list(zip(keys, params[i : i + len(keys)]))))
            i += len(keys)


def _layer_paths(model: nn.Module, layers: list) -> list[str]:
    """Dotted parameter paths of ``layers`` inside ``model`` (e.g. ``model.layers.3``)."""
    by_id = {id(m): name for name, m in model.named_modules()}
    return [by_id[id(layer)] for layer in layers]


class SegmentedEngine:
    """Loss, metrics and LoRA gradients by range-wise recompute (see module doc).

    Args:
        model: an mlx-lm model whose only trainable parameters are in decoder layers.
        arch: the model's adapter (``arch.adapter_for``).
        lam: ORPO lambda; nll_scope: ``full`` or ``response``.
        segment_layers: layers per range; 0 = one range of all layers.
        prefix_sharing: one ``[prompt; chosen; rejected]`` sequence per pair.
        head_chunk_tokens: target rows per LM-head chunk; 0 = all at once.

    Raises:
        ValueError: a trainable parameter outside the decoder layers (the
            segmented engine only differentiates the layers).
    """

    name = "segmented"

    def __init__(self, model: nn.Module, arch: Arch, lam: float, nll_scope: str = "full",
                 segment_layers: int = 0, prefix_sharing: bool = False, head_chunk_tokens: int = 0):
        self.model, self.arch = model, arch
        self.lam, self.nll_scope = lam, nll_scope
        self.prefix_sharing, self.head_chunk_tokens = prefix_sharing, head_chunk_tokens
        n = len(arch.layers)
        size = n if segment_layers <= 0 else min(segment_layers, n)
        self.ranges = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        self.paths = _layer_paths(model, arch.layers)
        # per layer, the flattened names of its trainable parameters (fixed order)
        self.param_names = [[k for k, _ in tree_flatten(layer.trainable_parameters())] for layer in arch.layers]
        inside = {f"{p}.{k}" for p, names in zip(self.paths, self.param_names) for k in names}
        outside = [k for k, _ in tree_flatten(model.trainable_parameters()) if k not in inside]
        if outside:
            raise ValueError(
                f"the segmented engine differentiates only decoder-layer parameters; "
                f"trainable outside them: {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}"
            )
        self.range_fns = [self._make_range_fn(lo, hi) for lo, hi in self.ranges]  # built once

    @classmethod
    def from_config(cls, cfg: Config, model: nn.Module):
        """Build from ``cfg.engine``; unsupported architectures get the reference engine.

        ``segment_layers: auto`` picks the range size from
        ``engine.memory_budget_gb`` (0 = 25% of physical RAM) for a worst-case
        micro-batch of ``train.micro_batch_pairs`` pairs of ``data.max_length`` tokens.
        """
        arch = adapter_for(model)
        if arch is None:
            _notice(f"the segmented engine does not support mlx-lm architecture "
                    f"'{module_name(model)}'; using the reference engine")
            return ReferenceEngine(model, cfg.orpo.lam, cfg.orpo.nll_scope)
        e = cfg.engine
        size = e.segment_layers
        if size == "auto":
            budget = e.memory_budget_gb * GIB or 0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            seqs = cfg.train.micro_batch_pairs * (1 if e.prefix_sharing else 2)
            length = cfg.data.max_length * (2 if e.prefix_sharing else 1)
            size = auto_segment_layers(len(arch.layers), *estimate_range_bytes(model.args, seqs, length), budget)
        if cfg.lora.dropout > 0:
            _notice("LoRA dropout > 0: the segmented recompute draws new dropout masks")
        return cls(model, arch, cfg.orpo.lam, cfg.orpo.nll_scope, size, e.prefix_sharing, e.head_chunk_tokens)

    # -- ranges -------------------------------------------------------------

    def _make_range_fn(self, lo: int, hi: int):
        """``run(h (S, L, D), params (flat list), masks, positions) -> (S, L, D)`` for layers [lo, hi).

        The LoRA parameters are set into the layer modules inside the function
        (as ``nn.value_and_grad`` does with ``model.update``), so under
        ``mx.vjp`` they are primals and get gradients.
        """
        layers, names = self.arch.layers[lo:hi], self.param_names[lo:hi]
        windows, call = self.arch.windows[lo:hi], self.arch.layer_call

        def run(h, params, masks, positions):
            _set_params(layers, names, params)
            for layer, window in zip(layers, windows):
                h = call(layer, h, masks[window], positions)  # (S, L, D)
            return h

        return run

    def _params(self, lo: int, hi: int) -> list:
        out = []
        for layer, keys in zip(self.arch.layers[lo:hi], self.param_names[lo:hi]):
            flat = dict(tree_flatten(layer.trainable_parameters()))
            out.extend(flat[k] for k in keys)
        return out

    # -- steps --------------------------------------------------------------

    def _layout(self, pairs: list[TokenizedPair]) -> Layout:
        build = shared_prefix_layout if self.prefix_sharing else two_sequence_layout
        return build(pairs, self.nll_scope)

    def _forward(self, layout: Layout):
        """Boundary states ``[(S, L, D)] * (ranges + 1)``, evaluated, plus masks."""
        # per window: an (S, 1, L, L) bool mask for sliding layers; without a window, MLX's
        # fused causal mode or a prefix-sharing plan of fused causal calls (no (L, L) mask)
        masks = {w: attention_plan(layout, w) for w in set(self.arch.windows)}
        h = self.arch.embed(layout.tokens)  # (S, L, D)
        mx.eval(h, [m for m in masks.values() if isinstance(m, mx.array)])
        bounds = [h]
        for (lo, hi), run in zip(self.ranges, self.range_fns):
            h = run(h, self._params(lo, hi), masks, layout.positions)
            mx.eval(h)
            bounds.append(h)
        return bounds, masks

    def _head(self, layout: Layout, h: mx.array, with_jacobian: bool):
        S, L, D = h.shape
        rows = h.reshape(S * L, D)[layout.rows]  # (N, D)
        return token_logps(self.arch.head, rows, layout.targets, self.head_chunk_tokens, with_jacobian)

    def step(self, pairs: list[TokenizedPair], norm: Norm) -> StepResult:
        """Loss contribution, metric sums and LoRA gradients of one micro-batch.

        Returns the same ``StepResult`` as ``ReferenceEngine.step``; ``grads``
        is shaped like ``model.trainable_parameters()``.
        """
        layout = self._layout(pairs)
        bounds, masks = self._forward(layout)
        S, L, D = bounds[-1].shape
        logps, jac = self._head(layout, bounds[-1], with_jacobian=True)  # (N,), (N, D)
        loss_fn = lambda lp: loss_from_token_logps(lp, layout, self.lam, norm)  # noqa: E731
        (loss, sums), dl_dlogp = mx.value_and_grad(loss_fn)(logps)
        dh = hidden_grad(dl_dlogp, jac, layout.rows, S * L).reshape(S, L, D)  # (S, L, D)
        mx.eval(loss, sums, dh)
        del jac
        grads = {}
        for r in reversed(range(len(self.ranges))):
            lo, hi = self.ranges[r]
            run, params, h_in = self.range_fns[r], self._params(lo, hi), bounds[r]
            bounds[r + 1] = None  # the range output is no longer needed
            if r > 0:
                _, cot = mx.vjp(lambda h, *p: run(h, list(p), masks, layout.positions), [h_in, *params], [dh])
                dh, pgrads = cot[0], cot[1:]  # dL/dh_in (S, L, D), LoRA grads
            else:  # dL/d(embedding) is not needed
                _, pgrads = mx.vjp(lambda *p: run(h_in, list(p), masks, layout.positions), params, [dh])
                dh = None
            mx.eval(dh, pgrads)
            _set_params(self.arch.layers[lo:hi], self.param_names[lo:hi], params)  # drop the traced copies
            i = 0
            for path, keys in zip(self.paths[lo:hi], self.param_names[lo:hi]):
                for k in keys:
                    grads[f"{path}.{k}"] = pgrads[i]
                    i += 1
        tree = tree_map_with_path(lambda path, _: grads[path], self.model.trainable_parameters())
        return StepResult(loss, {**sums, **layout_counts(layout)}, tree)

    def evaluate(self, pairs: list[TokenizedPair], norm: Norm) -> StepResult:
        """Loss contribution and metric sums, without gradients."""
        layout = self._layout(pairs)
        bounds, _ = self._forward(layout)
        logps, _ = self._head(layout, bounds[-1], with_jacobian=False)
        loss, sums = loss_from_token_logps(logps, layout, self.lam, norm)
        return StepResult(loss, {**sums, **layout_counts(layout)})
