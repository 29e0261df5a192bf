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

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from ..lora import keyed_dropout
from ..types import TokenizedPair
from . import kernels
from .arch import Arch
from .common import StepResult, layout_counts, loss_from_token_logps, with_key
from .head import hidden_grad, target_logps, token_logps
from .attention import ATTENTION_GROUPS, SharedAttention, attention_plan
from .layout import Layout, shared_prefix_layout, two_sequence_layout
from .objective import Totals
from .plan import Plan, kv_exports, kv_imports, range_bounds


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


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` holds an active ``nn.Dropout`` (LoRA dropout > 0)."""
    return any(isinstance(m, nn.Dropout) and m._p_1 < 1.0 for _, m in model.named_modules())


def trainable_outside_layers(model: nn.Module, layers: list) -> list[str]:
    """Dotted names of trainable parameters of ``model`` outside ``layers`` (the segmented
    engine differentiates the decoder layers only)."""
    inside = {f"{p}.{k}" for p, layer in zip(_layer_paths(model, layers), layers)
              for k, _ in tree_flatten(layer.trainable_parameters())}
    return [k for k, _ in tree_flatten(model.trainable_parameters()) if k not in inside]


# -- what a compiled function may take: trees of arrays and hashable constants --

def _encode_mask(mask):
    """An attention plan as compile-friendly leaves (``"causal"``, an array, or a tuple)."""
    if isinstance(mask, SharedAttention):
        return (mask.gathers, mask.scatter, mask.shapes, mask.starts)
    return mask


def _decode_mask(x):
    return SharedAttention(*x) if isinstance(x, tuple) else x


def _attention_rows(masks: list):
    """The groups' ``(rows, M, first query)`` of the prefix-sharing attention among encoded
    ``masks``, or None."""
    return next((tuple((*s, q0) for s, q0 in zip(m[2], m[3])) for m in masks if isinstance(m, tuple)), None)


def _target_arrays(layout: Layout) -> dict:
    return {k: getattr(layout, k) for k in ("rows", "targets", "pair_of", "w_nll", "w_chosen", "w_rejected",
                                            "chosen_len", "rejected_len", "extra")}


class _Targets:
    """The target arrays of a layout, as ``loss_from_token_logps`` reads them."""

    def __init__(self, arrays: dict):
        self.__dict__.update(arrays)
        self.n_pairs = arrays["chosen_len"].shape[0]


class _RangeSet:
    """Layer ranges of one size: their bounds, K/V routing and range functions.

    ``run[r]`` is range ``r``'s eager function (see ``SegmentedEngine._make_range_fn``);
    ``fwd[r]`` and ``bwd[r]`` its forward and its recompute-and-vjp, compiled
    when the engine compiles (traced once per input shape, i.e. per length bucket).
    """

    def __init__(self, engine: "SegmentedEngine", size: int):
        self.ranges = range_bounds(len(engine.arch.layers), size)
        self.kv_imports = [kv_imports(engine.donors, lo, hi) for lo, hi in self.ranges]
        self.kv_exports = [kv_exports(engine.donors, lo, hi) for lo, hi in self.ranges]
        self.run = [engine._make_range_fn(lo, hi, i, e) for (lo, hi), i, e in
                    zip(self.ranges, self.kv_imports, self.kv_exports)]
        self.fwd = [engine._maybe_compile(engine._forward_fn(run)) for run in self.run]
        self.bwd = [engine._maybe_compile(engine._backward_fn(run, r > 0)) for r, run in enumerate(self.run)]


class SegmentedEngine:
    """Loss, metrics and LoRA gradients by range-wise recompute (see module doc).

    Args:
        model: an mlx-lm model whose only trainable parameters are in decoder layers.
        arch: the model's adapter (``arch.adapter_for``).
        objective: the training objective (``objective.Objective``).
        segment_layers: layers per range; 0 = one range of all layers (with
            ``head_chunk_tokens = 0``: a single pass, nothing recomputed);
            ``"auto"``: per length bucket, the single pass when its estimated
            peak fits ``memory_budget`` bytes, else the largest range size that
            fits (chunked head), chosen and logged once per shape (``plan.Plan``).
        prefix_sharing: one ``[prompt; chosen; rejected]`` sequence per pair.
        head_chunk_tokens: target rows per LM-head chunk; 0 = all at once
            (with ``"auto"``: the chunk used when recomputing; 0 = 1024).
        length_bucket: pad lengths and target counts to ``layout.bucket_length``
            with this quantum (0 = exact shapes).
        pack: a micro-batch's sequences in one row, padded only to the bucket of
            their total length (``layout`` module doc); the same loss and gradients.
        attention_groups: the most attention calls per layer over prefix-shared or
            packed rows (``attention.group_rows``); the same loss and gradients.
        compile: ``mx.compile`` the single pass and the range functions (traced
            once per bucket and attention-call shapes).
        memory_budget: bytes for ``"auto"`` (weights included).
        report: called with each plan choice of ``"auto"`` (None: silent).

    ``dtrain.engine.make_engine`` decides when this engine cannot be used (it
    falls back to the reference engine) and resolves the config's ``auto`` values.

    Raises:
        ValueError: a trainable parameter outside the decoder layers (the
            segmented engine only differentiates the layers), ``compile``
            with LoRA dropout (compiled ranges would replay one mask), or
            ``attention_groups`` < 1.
    """

    name = "segmented"

    def __init__(self, model: nn.Module, arch: Arch, objective, segment_layers=0, prefix_sharing: bool = False,
                 head_chunk_tokens: int = 0, length_bucket: int = 0, compile: bool = False, memory_budget: float = 0.0,
                 report=None, pack: bool = False, attention_groups: int = ATTENTION_GROUPS):
        self.model, self.arch, self.objective = model, arch, objective
        self.prefix_sharing, self.head_chunk_tokens = prefix_sharing, head_chunk_tokens
        if attention_groups < 1:
            raise ValueError(f"attention_groups must be >= 1, got {attention_groups}")
        self.length_bucket, self.pack, self.attention_groups = length_bucket, pack, attention_groups
        # LoRA dropout: each range's forward and its recompute draw from the key the
        # range started with (``dtrain.lora.DropoutKeys``); compiled ranges would replay one mask
        self.dropout_keys = keyed_dropout(model)
        if compile and self.dropout_keys is not None:
            raise ValueError("compile with LoRA dropout: compiled ranges would replay the traced masks")
        self.compile = compile
        n = len(arch.layers)
        self.plan = Plan(model, n, segment_layers, head_chunk_tokens, memory_budget, report,
                         kept_exp=arch.logsumexp is kernels.logsumexp)
        self.paths = _layer_paths(model, arch.layers)
        # per layer, the flattened names of its trainable parameters (fixed order)
        self.param_names = [[k for k, _ in tree_flatten(layer.trainable_parameters())] for layer in arch.layers]
        outside = trainable_outside_layers(model, arch.layers)
        if outside:
            raise ValueError(
                f"the segmented engine differentiates only decoder-layer parameters; "
                f"trainable outside them: {', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}"
            )
        self.donors = arch.donors or [None] * n
        self.windows = sorted(set(arch.windows), key=lambda w: -1 if w is None else w)
        self._sets = {}  # range size -> its functions, built once per size
        self._range_set(self.plan.size)
        self._whole = self._maybe_compile(self._whole_fn())
        self._head_vjp = self._maybe_compile(self._head_vjp_fn())

    @property
    def ranges(self) -> list:
        """``[(lo, hi)]`` of the configured range size (``auto``: the single range)."""
        return self._range_set(self.plan.size).ranges

    @property
    def range_fns(self) -> list:
        return self._range_set(self.plan.size).run

    def plan_of(self, layout: Layout, masks: list | None = None) -> tuple[_RangeSet, int]:
        """The ranges and LM-head chunk (0 = unchunked) this engine runs ``layout`` with."""
        masks = self._masks(layout) if masks is None else masks
        size, chunk = self.plan(layout, _attention_rows(masks))
        return self._range_set(size), chunk

    # -- ranges -------------------------------------------------------------

    def _maybe_compile(self, fn):
        return mx.compile(fn) if self.compile else fn

    def _range_set(self, size: int) -> _RangeSet:
        n = len(self.arch.layers)
        size = n if size <= 0 else min(size, n)
        if size not in self._sets:
            self._sets[size] = _RangeSet(self, size)
        return self._sets[size]

    def _make_range_fn(self, lo: int, hi: int, imports: list, exports: list):
        """``run(h (S, L, D), params (flat list), kv_in (flat list), masks, positions,
        layer_inputs) -> (h (S, L, D), kv_out (flat list))`` for layers [lo, hi).

        The LoRA parameters are set into the layer modules inside the function
        (as ``nn.value_and_grad`` does with ``model.update``), so under
        ``mx.vjp`` they are primals and get gradients. ``kv_in`` holds
        ``[k, v]`` of each donor in ``imports`` (K/V shared from an earlier
        range); ``kv_out`` those of ``exports``. ``masks``: per window, the
        encoded attention plan (``_encode_mask``).
        """
        layers, names = self.arch.layers[lo:hi], self.param_names[lo:hi]
        windows, call = self.arch.windows[lo:hi], self.arch.layer_call
        donors = self.donors[lo:hi]

        def run(h, params, kv_in, masks, positions, layer_inputs):
            _set_params(layers, names, params)
            plans = {w: _decode_mask(m) for w, m in zip(self.windows, masks)}
            kv = {d: (kv_in[2 * j], kv_in[2 * j + 1]) for j, d in enumerate(imports)}
            for i, (layer, window, donor) in enumerate(zip(layers, windows, donors), start=lo):
                extra = None if layer_inputs is None else layer_inputs[:, :, i]  # (S, L, P)
                h, kv[i] = call(layer, h, plans[window], positions, extra, kv.get(donor))  # (S, L, D)
            return h, [x for d in exports for x in kv[d]]

        return run

    @staticmethod
    def _forward_fn(run):
        return lambda h, params, kv_in, masks, positions, layer_inputs: run(h, params, kv_in, masks, positions,
                                                                            layer_inputs)

    @staticmethod
    def _backward_fn(run, lead: bool):
        """``(h_in, params, kv_in, cot_out, masks, positions, layer_inputs) -> (dh_in or None,
        LoRA grads, dL/d kv_in)``: the range recomputed inside ``mx.vjp``
        (``dL/dh_in`` only when ``lead``: not needed below the first range)."""

        def bwd(h_in, params, kv_in, cot_out, masks, positions, layer_inputs):
            n_p = len(params)

            def f(*xs):  # [h_in?, *params, *kv_in] -> [h_out, *kv_out]
                h = xs[0] if lead else h_in
                rest = xs[1:] if lead else xs
                out, kv_out = run(h, list(rest[:n_p]), list(rest[n_p:]), masks, positions, layer_inputs)
                return [out, *kv_out]

            _, cot = mx.vjp(f, ([h_in] if lead else []) + list(params) + list(kv_in), cot_out)
            dh = cot[0] if lead else None
            rest = cot[1:] if lead else cot
            return dh, rest[:n_p], rest[n_p:]

        return bwd

    def _params(self, lo: int, hi: int) -> list:
        out = []
        for layer, keys in zip(self.arch.layers[lo:hi], self.param_names[lo:hi]):
            flat = dict(tree_flatten(layer.trainable_parameters()))
            out.extend(flat[k] for k in keys)
        return out

    # -- layouts ------------------------------------------------------------

    def layout(self, pairs: list[TokenizedPair]) -> Layout:
        """The rows this engine runs for ``pairs`` (prefix sharing, buckets and packing as configured)."""
        build = shared_prefix_layout if self.prefix_sharing else two_sequence_layout
        return build(pairs, self.objective.nll_scope, self.length_bucket, self.pack)

    def _masks(self, layout: Layout) -> list:
        """Per window (``self.windows`` order): the encoded attention plan, built once per step
        (an ``(S, 1, L, L)`` mask for sliding layers, MLX's fused causal mode or a
        prefix-sharing plan otherwise)."""
        return [_encode_mask(attention_plan(layout, w, self.attention_groups)) for w in self.windows]

    # -- steps --------------------------------------------------------------

    def _embed(self, tokens: mx.array):
        h = self.arch.embed(tokens)  # (S, L, D)
        # constants of every range: no LoRA outside the decoder layers
        layer_inputs = self.arch.layer_inputs(tokens, h) if self.arch.layer_inputs else None  # (S, L, n, P)
        return h, layer_inputs

    def _forward(self, layout: Layout, masks: list, rs: _RangeSet, saved: list, key, eager: bool = False):
        """Boundary states ``[(S, L, D)] * (ranges + 1)``, evaluated (asynchronously), the
        per-layer inputs, each exported donor's K/V, and the dropout key each range started
        from (the stream runs on through the ranges, as through the reference's whole model).
        ``saved``: per range, its LoRA parameters, put back after it ran."""
        h, layer_inputs = self._embed(layout.tokens)
        mx.async_eval(h, layer_inputs, masks)
        bounds, kv, starts = [h], {}, []  # kv: donor -> [k, v] (S, Hkv, L, Dh)
        with_key(self.dropout_keys, key)
        for r, (lo, hi) in enumerate(rs.ranges):
            kv_in = [x for d in rs.kv_imports[r] for x in kv[d]]
            starts.append(self.dropout_keys.key if self.dropout_keys else None)
            fn = rs.run[r] if eager else rs.fwd[r]
            h, kv_out = fn(h, self._params(lo, hi), kv_in, masks, layout.positions, layer_inputs)
            mx.async_eval(h, kv_out)  # graph-free boundary; the host goes on building the next range
            _set_params(self.arch.layers[lo:hi], self.param_names[lo:hi], saved[r])
            kv.update({d: kv_out[2 * j : 2 * j + 2] for j, d in enumerate(rs.kv_exports[r])})
            bounds.append(h)
        with_key(self.dropout_keys, None)
        return bounds, layer_inputs, kv, starts

    def _head(self, layout: Layout, h: mx.array, chunk: int, with_jacobian: bool):
        S, L, D = h.shape
        rows = h.reshape(S * L, D)[layout.rows]  # (N, D)
        return token_logps(self.arch.head, rows, layout.targets, chunk, with_jacobian,
                           self._head_vjp if with_jacobian else None, self.arch.logsumexp)

    def _head_vjp_fn(self):
        def head_vjp(h_c, targets):  # (n, D), (n,) -> logp (n,), J (n, D)
            f = target_logps(self.arch.head, targets, self.arch.logsumexp)
            (lp,), (j,) = mx.vjp(f, [h_c], [mx.ones(targets.shape, mx.float32)])
            return lp, j

        return head_vjp

    def step(self, pairs: list[TokenizedPair], totals: Totals, key: mx.array | None = None,
             hyper: dict | None = None) -> StepResult:
        """Loss contribution, metric sums and LoRA gradients of one micro-batch.

        Returns the same ``StepResult`` as ``ReferenceEngine.step``; ``grads``
        is shaped like ``model.trainable_parameters()``. ``key``: LoRA dropout's
        (the reference engine's masks on the same layout). Nothing is read back
        to the host: the caller's ``mx.eval`` is the step's sync.
        """
        layout = self.layout(pairs)
        masks = self._masks(layout)
        rs, chunk = self.plan_of(layout, masks)
        hyper = hyper or self.objective.hyper()
        totals = Totals(mx.array(totals.nll_tokens, mx.float32), mx.array(totals.pairs, mx.float32))
        if len(rs.ranges) == 1 and chunk <= 0:
            return self._step_whole(layout, masks, key, totals, hyper)
        saved = [self._params(lo, hi) for lo, hi in rs.ranges]
        bounds, layer_inputs, kv, starts = self._forward(layout, masks, rs, saved, key)
        S, L, D = bounds[-1].shape
        logps, jac = self._head(layout, bounds[-1], chunk, with_jacobian=True)  # (N,), (N, D)
        targets = _Targets(_target_arrays(layout))
        loss_fn = lambda lp: loss_from_token_logps(lp, targets, self.objective, totals, hyper)  # noqa: E731
        (loss, sums), dl_dlogp = mx.value_and_grad(loss_fn)(logps)
        dh = hidden_grad(dl_dlogp, jac, layout.rows, S * L).reshape(S, L, D)  # (S, L, D)
        mx.async_eval(loss, sums, dh)
        del jac
        grads, dkv = {}, {}  # dkv: donor -> [dk, dv], summed over the ranges that reuse its K/V
        for r in reversed(range(len(rs.ranges))):
            lo, hi = rs.ranges[r]
            params, h_in = saved[r], bounds[r]
            imports = rs.kv_imports[r]
            kv_in = [x for d in imports for x in kv[d]]
            bounds[r + 1] = None  # the range output is no longer needed
            cot_out = [dh] + [x for d in rs.kv_exports[r] for x in dkv.pop(d)]
            with_key(self.dropout_keys, starts[r])  # the same dropout masks as this range's forward
            dh, pgrads, kv_cot = rs.bwd[r](h_in, params, kv_in, cot_out, masks, layout.positions, layer_inputs)
            for j, d in enumerate(imports):  # summed over every range that reuses the donor's K/V
                g = list(kv_cot[2 * j : 2 * j + 2])
                dkv[d] = [a + b for a, b in zip(dkv[d], g)] if d in dkv else g
            mx.async_eval(dh, pgrads, list(dkv.values()))
            _set_params(self.arch.layers[lo:hi], self.param_names[lo:hi], params)  # drop the traced copies
            grads.update(self._named_grads(lo, hi, pgrads))
        with_key(self.dropout_keys, None)
        return self._result(loss, sums, layout, grads)

    def _whole_fn(self):
        """``(params, tokens, positions, masks, targets, totals, hyper) -> (loss, sums, LoRA grads)``:
        one ``mx.value_and_grad`` over embedding, layers, head and loss (``totals``: a
        ``(nll_tokens, pairs)`` tuple of float32 scalars)."""
        n = len(self.arch.layers)

        def whole(params, tokens, positions, masks, targets, totals, hyper):
            run = self._range_set(n).run[0]
            h, layer_inputs = self._embed(tokens)
            t = _Targets(targets)

            def loss_of(params):
                out, _ = run(h, params, [], masks, positions, layer_inputs)  # (S, L, D)
                S, L, D = out.shape
                f = target_logps(self.arch.head, t.targets, self.arch.logsumexp)
                logps = f(out.reshape(S * L, D)[t.rows])  # (N,)
                return loss_from_token_logps(logps, t, self.objective, Totals(*totals), hyper)[0], logps

            # the metric sums from the returned log-probabilities, outside the vjp: MLX 0.32's
            # compile fails (IndexError _Map_base::at) on value_and_grad aux outputs that share
            # nodes with the loss
            (loss, logps), pgrads = mx.value_and_grad(loss_of)(params)
            sums = loss_from_token_logps(mx.stop_gradient(logps), t, self.objective, Totals(*totals), hyper)[1]
            return loss, sums, pgrads

        return whole

    def _step_whole(self, layout: Layout, masks: list, key, totals: Totals, hyper: dict) -> StepResult:
        """One range and an unchunked head: nothing to recompute, so one lazy
        ``mx.value_and_grad`` over layers, head and loss (as the reference
        engine, on this engine's layout: prefix sharing, explicit positions),
        compiled per length bucket when the engine compiles.
        Peak memory is every layer's activations plus the ``(N, V)`` logits."""
        n = len(self.arch.layers)
        params = self._params(0, n)
        with_key(self.dropout_keys, key)
        loss, sums, pgrads = self._whole(params, layout.tokens, layout.positions, masks, _target_arrays(layout),
                                         (totals.nll_tokens, totals.pairs), hyper)
        with_key(self.dropout_keys, None)
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

    def evaluate(self, pairs: list[TokenizedPair], totals: Totals, key: mx.array | None = None,
                 hyper: dict | None = None) -> StepResult:
        """Loss contribution and metric sums, without gradients (eager ranges)."""
        layout = self.layout(pairs)
        masks = self._masks(layout)
        rs, chunk = self.plan_of(layout, masks)
        saved = [self._params(lo, hi) for lo, hi in rs.ranges]
        bounds = self._forward(layout, masks, rs, saved, key, eager=True)[0]
        logps, _ = self._head(layout, bounds[-1], chunk, with_jacobian=False)
        loss, sums = loss_from_token_logps(logps, layout, self.objective, totals, hyper or self.objective.hyper())
        return StepResult(loss, {**sums, **layout_counts(layout)})
