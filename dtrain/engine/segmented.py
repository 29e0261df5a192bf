"""The segmented engine: layer ranges recomputed inside ``mx.vjp``.

Forward, the decoder layers run range by range and only the hidden state at
each range boundary is kept (evaluated, graph-free). The LM head runs in token
chunks (head.py) and gives ``dL/dh`` at the last boundary. Backward, each range
is recomputed inside ``mx.vjp`` with its input boundary and its LoRA
parameters as primals; that yields the range's LoRA gradients and ``dL/dh``
for the range below, evaluated before the next range so its graph is freed.
Peak memory is a few boundaries plus one range's activations, instead of
every layer's activations and the full ``(S, L, V)`` logits. One range with
an unchunked head has nothing to recompute and runs as a single
``mx.value_and_grad`` (``_step_whole``).

Gemma 4's KV-shared layers attend over an earlier donor layer's K/V. When a
donor's range is below its sharers' range, the K/V leave the donor's range as
extra outputs (kept with the boundaries) and enter the sharers' ranges as extra
vjp primals; their cotangents, summed over those ranges, are fed back into the
donor range's vjp. Per-layer inputs are constants of every range.

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
from .head import hidden_grad, target_logps, token_logps
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


def _kv_imports(donors: list, lo: int, hi: int) -> list[int]:
    """Donors below ``lo`` whose K/V layers in [lo, hi) reuse."""
    return sorted({d for d in donors[lo:hi] if d is not None and d < lo})


def _kv_exports(donors: list, lo: int, hi: int) -> list[int]:
    """Layers in [lo, hi) whose K/V layers at or above ``hi`` reuse."""
    return sorted({d for d in donors[hi:] if d is not None and lo <= d < hi})


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
        segment_layers: layers per range; 0 = one range of all layers (with
            ``head_chunk_tokens = 0``: a single pass, nothing recomputed).
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
        self.donors = arch.donors or [None] * n
        # per range, the donors whose K/V enter it from below / leave it for a later range
        self.kv_imports = [_kv_imports(self.donors, lo, hi) for lo, hi in self.ranges]
        self.kv_exports = [_kv_exports(self.donors, lo, hi) for lo, hi in self.ranges]
        self.range_fns = [self._make_range_fn(r) for r in range(len(self.ranges))]  # built once

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
        if (size <= 0 or size >= len(arch.layers)) and e.head_chunk_tokens > 0:
            _notice("one range of all layers with a chunked head recomputes every layer; "
                    "engine.head_chunk_tokens: 0 gives the single pass (faster, keeps the logits)")
        return cls(model, arch, cfg.orpo.lam, cfg.orpo.nll_scope, size, e.prefix_sharing, e.head_chunk_tokens)

    # -- ranges -------------------------------------------------------------

    def _make_range_fn(self, r: int):
        """``run(h (S, L, D), params (flat list), kv_in (flat list), masks, positions,
        layer_inputs) -> (h (S, L, D), kv_out (flat list))`` for range ``r``, layers [lo, hi).

        The LoRA parameters are set into the layer modules inside the function
        (as ``nn.value_and_grad`` does with ``model.update``), so under
        ``mx.vjp`` they are primals and get gradients. ``kv_in`` holds
        ``[k, v]`` of each donor in ``self.kv_imports[r]`` (K/V shared from an
        earlier range); ``kv_out`` those of ``self.kv_exports[r]``.
        """
        lo, hi = self.ranges[r]
        layers, names = self.arch.layers[lo:hi], self.param_names[lo:hi]
        windows, call = self.arch.windows[lo:hi], self.arch.layer_call
        donors = self.donors[lo:hi]
        imports, exports = self.kv_imports[r], self.kv_exports[r]

        def run(h, params, kv_in, masks, positions, layer_inputs):
            _set_params(layers, names, params)
            kv = {d: (kv_in[2 * j], kv_in[2 * j + 1]) for j, d in enumerate(imports)}
            for i, (layer, window, donor) in enumerate(zip(layers, windows, donors), start=lo):
                extra = None if layer_inputs is None else layer_inputs[:, :, i]  # (S, L, P)
                h, kv[i] = call(layer, h, masks[window], positions, extra, kv.get(donor))  # (S, L, D)
            return h, [x for d in exports for x in kv[d]]

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

    def _range_seeds(self) -> list:
        """One RNG seed per range, drawn from the global generator.

        Each range's forward and its recompute under ``mx.vjp`` start from the
        same seed, so random ops inside (LoRA dropout) draw the same masks and
        the gradient is that of the forward that was run.
        """
        base = int(mx.random.randint(0, 2**30, ()).item())
        return [base + r for r in range(len(self.ranges))]

    def _forward(self, layout: Layout, seeds: list, stop: int | None = None):
        """Boundary states ``[(S, L, D)] * (stop + 1)``, evaluated, after the
        first ``stop`` ranges (default: all), plus the range constants: masks,
        per-layer inputs and each exported donor's K/V."""
        # per window: an (S, 1, L, L) bool mask for sliding layers; without a window, MLX's
        # fused causal mode or a prefix-sharing plan of fused causal calls (no (L, L) mask)
        masks = {w: attention_plan(layout, w) for w in set(self.arch.windows)}
        h = self.arch.embed(layout.tokens)  # (S, L, D)
        # constants of every range: no LoRA outside the decoder layers
        layer_inputs = self.arch.layer_inputs(layout.tokens, h) if self.arch.layer_inputs else None  # (S, L, n, P)
        mx.eval(h, layer_inputs, [m for m in masks.values() if isinstance(m, mx.array)])
        bounds, kv = [h], {}  # kv: donor -> [k, v] (S, Hkv, L, Dh)
        for r, ((lo, hi), run) in enumerate(zip(self.ranges[:stop], self.range_fns[:stop])):
            kv_in = [x for d in self.kv_imports[r] for x in kv[d]]
            mx.random.seed(seeds[r])
            h, kv_out = run(h, self._params(lo, hi), kv_in, masks, layout.positions, layer_inputs)
            mx.eval(h, kv_out)
            kv.update({d: kv_out[2 * j : 2 * j + 2] for j, d in enumerate(self.kv_exports[r])})
            bounds.append(h)
        return bounds, (masks, layer_inputs, kv)

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
        seeds = self._range_seeds()
        if len(self.ranges) == 1 and self.head_chunk_tokens <= 0:
            return self._step_whole(layout, seeds[0], norm)
        bounds, (masks, layer_inputs, kv) = self._forward(layout, seeds)
        S, L, D = bounds[-1].shape
        logps, jac = self._head(layout, bounds[-1], with_jacobian=True)  # (N,), (N, D)
        loss_fn = lambda lp: loss_from_token_logps(lp, layout, self.lam, norm)  # noqa: E731
        (loss, sums), dl_dlogp = mx.value_and_grad(loss_fn)(logps)
        dh = hidden_grad(dl_dlogp, jac, layout.rows, S * L).reshape(S, L, D)  # (S, L, D)
        mx.eval(loss, sums, dh)
        del jac
        grads, dkv = {}, {}  # dkv: donor -> [dk, dv], summed over the ranges that reuse its K/V
        for r in reversed(range(len(self.ranges))):
            lo, hi = self.ranges[r]
            run, params, h_in = self.range_fns[r], self._params(lo, hi), bounds[r]
            imports, n_p = self.kv_imports[r], len(params)
            kv_in = [x for d in imports for x in kv[d]]
            bounds[r + 1] = None  # the range output is no longer needed
            cot_out = [dh] + [x for d in self.kv_exports[r] for x in dkv.pop(d)]
            lead = [h_in] if r > 0 else []  # dL/d(embedding) is not needed

            def f(*xs):  # [*lead, *params, *kv_in] -> [h_out, *kv_out]
                h, p, kv_x = (xs[0] if lead else h_in), xs[len(lead) : len(lead) + n_p], xs[len(lead) + n_p :]
                out, kv_out = run(h, list(p), list(kv_x), masks, layout.positions, layer_inputs)
                return [out, *kv_out]

            mx.random.seed(seeds[r])  # the same dropout masks as this range's forward
            _, cot = mx.vjp(f, lead + params + kv_in, cot_out)
            dh = cot[0] if lead else None  # dL/dh_in (S, L, D)
            pgrads, kv_cot = cot[len(lead) : len(lead) + n_p], cot[len(lead) + n_p :]  # LoRA grads, dL/d kv_in
            for j, d in enumerate(imports):  # summed over every range that reuses the donor's K/V
                g = kv_cot[2 * j : 2 * j + 2]
                dkv[d] = [a + b for a, b in zip(dkv[d], g)] if d in dkv else g
            mx.eval(dh, pgrads, list(dkv.values()))
            _set_params(self.arch.layers[lo:hi], self.param_names[lo:hi], params)  # drop the traced copies
            grads.update(self._named_grads(lo, hi, pgrads))
        return self._result(loss, sums, layout, grads)

    def _step_whole(self, layout: Layout, seed: int, norm: Norm) -> StepResult:
        """One range and an unchunked head: nothing to recompute, so one lazy
        ``mx.value_and_grad`` over layers, head and loss (as the reference
        engine, on this engine's layout: prefix sharing, explicit positions).
        Peak memory is every layer's activations plus the ``(N, V)`` logits."""
        bounds, (masks, layer_inputs, _) = self._forward(layout, [seed], stop=0)
        run, n = self.range_fns[0], len(self.arch.layers)

        def loss_of(params):
            h, _ = run(bounds[0], params, [], masks, layout.positions, layer_inputs)  # (S, L, D)
            S, L, D = h.shape
            logps = target_logps(self.arch.head, layout.targets)(h.reshape(S * L, D)[layout.rows])  # (N,)
            return loss_from_token_logps(logps, layout, self.lam, norm)

        params = self._params(0, n)
        mx.random.seed(seed)
        (loss, sums), pgrads = mx.value_and_grad(loss_of)(params)
        mx.eval(loss, sums, pgrads)
        _set_params(self.arch.layers, self.param_names, params)  # drop the traced copies
        return self._result(loss, sums, layout, self._named_grads(0, n, pgrads))

    def _named_grads(self, lo: int, hi: int, pgrads: list) -> dict:
        """``{"model.layers.i.<key>": grad}`` for layers [lo, hi) from the flat ``pgrads``
        (in ``self._params(lo, hi)`` order)."""
        flat = iter(pgrads)
        return {f"{path}.{k}": next(flat) for path, keys in zip(self.paths[lo:hi], self.param_names[lo:hi]) for k in keys}

    def _result(self, loss, sums: dict, layout: Layout, grads: dict) -> StepResult:
        """The step's ``StepResult``, ``grads`` (by dotted path) shaped like ``model.trainable_parameters()``."""
        tree = tree_map_with_path(lambda path, _: grads[path], self.model.trainable_parameters())
        return StepResult(loss, {**sums, **layout_counts(layout)}, tree)

    def evaluate(self, pairs: list[TokenizedPair], norm: Norm) -> StepResult:
        """Loss contribution and metric sums, without gradients."""
        layout = self._layout(pairs)
        bounds, _ = self._forward(layout, self._range_seeds())
        logps, _ = self._head(layout, bounds[-1], with_jacobian=False)
        loss, sums = loss_from_token_logps(logps, layout, self.lam, norm)
        return StepResult(loss, {**sums, **layout_counts(layout)})
