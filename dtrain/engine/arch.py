"""Per-architecture adapters: an mlx-lm model's embedding, decoder layers and
LM head as plain functions with explicit masks and positions.

The segmented engine cannot call ``model(tokens)``: it needs the hidden state
between layers, block-wise RoPE positions and its own boolean masks. Each
adapter calls the layer's *own* submodules (norms, LoRA-wrapped projections,
q/k norms, MLP) in the order the mlx-lm model file does, so the math is the
model's. Nothing here patches a class or keeps module-level state.

Mirrored files (mlx-lm 0.32): ``models/llama.py`` (also mistral, SmolLM2),
``qwen2.py``, ``qwen3.py``, ``gemma3_text.py``, ``minicpm.py``, ``gemma4_text.py``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

from . import kernels
from .head import mlx_logsumexp
from .attention import SharedAttention

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3_text", "minicpm", "gemma4_text")


@dataclass(frozen=True)
class Arch:
    """One model seen as ``embed -> layers -> head``.

    Attributes:
        name: the mlx-lm module name (``llama``, ``qwen3``, ...).
        embed: ``(S, L)`` int32 tokens -> ``(S, L, D)`` hidden state (with the
            model's embedding scaling).
        layers: the decoder layer modules, in order.
        layer_call: ``(layer, x (S, L, D), mask, positions (S, L) int32,
            layer_input, shared_kv) -> (x (S, L, D), kv)``; ``mask`` as in
            :func:`attention`; ``layer_input`` this layer's slice of
            ``layer_inputs`` (or None); ``shared_kv`` the donor's ``kv`` for a
            layer with a donor, else None; ``kv`` the layer's rotated
            ``(keys, values)`` ``(S, Hkv, L, Dh)`` (None without KV sharing).
        windows: per layer, the sliding window (tokens) or None for global.
        head: ``(n, D)`` final hidden rows -> ``(n, V)`` logits (final norm,
            output projection, any logit scaling or soft-capping).
        donors: per layer, the earlier layer whose ``kv`` it attends over
            instead of its own (Gemma 4 KV sharing), or None.
        layer_inputs: ``(tokens (S, L), embedded (S, L, D)) -> (S, L, layers, P)``
            constants fed to each layer (Gemma 4 per-layer inputs), or None.
        logsumexp: ``(..., V) -> (...)`` over the last axis, for the head's log-softmax
            (MLX's, or ``kernels.logsumexp`` with ``engine.kernels: dtrain``).
    """

    name: str
    embed: Callable
    layers: list
    layer_call: Callable
    windows: list
    head: Callable
    donors: Optional[list] = None
    layer_inputs: Optional[Callable] = None
    logsumexp: Callable = mlx_logsumexp


def module_name(model: nn.Module) -> str:
    """The mlx-lm module that defines ``model`` (``mistral`` models are ``llama``)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Apply ``rope`` to ``x`` ``(B, L, H, Dh)`` at per-token ``positions`` ``(B, L)``.

    ``mx.fast.rope`` (and mlx-lm's rope modules, which call it) accept an
    array offset of shape ``(batch,)``; folding tokens into the batch axis
    gives each token its own position. Equal to the scalar-offset rope bitwise
    (a dynamic NTK rope, which takes no array offset, to rounding: :func:`_dynamic_ntk_rope`).
    Returns ``(B, H, L, Dh)``.
    """
    B, L, H, Dh = x.shape
    if isinstance(rope, DynamicNTKScalingRoPE):
        y = _dynamic_ntk_rope(rope, x.reshape(B * L, H, 1, Dh), positions)
    else:
        y = rope(x.reshape(B * L, H, 1, Dh), offset=positions.reshape(-1))  # (B*L, H, 1, Dh)
    return y.reshape(B, L, H, Dh).transpose(0, 2, 1, 3)


def _dynamic_ntk_rope(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """mlx-lm's ``DynamicNTKScalingRoPE`` on ``x`` ``(B*L, H, 1, Dh)`` at ``positions`` ``(B, L)``.

    Its base grows with the sequence length past ``max_position_embeddings``; the module reads the
    length from ``x``, which the folded tokens hide (and it cannot take an array offset), so the length
    is the longest sequence's, the largest position + 1, as in the reference engine's unshared rows;
    the base enters ``mx.fast.rope`` as ``freqs`` (an array: no read-back to the host).
    """
    n = mx.maximum(positions.max() + 1, rope.max_position_embeddings).astype(mx.float32)
    grow = rope.factor * n / rope.max_position_embeddings - (rope.factor - 1)  # 1 up to max_position_embeddings
    base = rope.base * grow ** (rope.dims / (rope.dims - 2))
    freqs = base ** (mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims)
    return mx.fast.rope(x, rope.dims, traditional=rope.traditional, base=None, scale=1.0,
                        offset=positions.reshape(-1), freqs=freqs)


def _heads(attn) -> tuple[int, int]:
    n = getattr(attn, "n_heads", None) or attn.num_heads
    kv = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
    return n, kv


def fused_causal(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """MLX's fused causal attention: ``(B, H, L, Dh)`` queries over ``(B, Hkv, L, Dh)`` keys/values."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")


def shared_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, plan: SharedAttention,
                     causal: Callable = fused_causal) -> mx.array:
    """Prefix-shared attention as one batched causal call per group of rows (see ``SharedAttention``).

    ``q`` ``(S, H, L, Dh)``, ``k``/``v`` ``(S, Hkv, L, Dh)``. Each token's row is
    gathered into its group's ``(rows, M)`` attention rows (queries from the group's
    start slot on), attended with ``causal`` (:func:`fused_causal` or
    ``kernels.causal_attention``, both aligning fewer queries with the last keys) and
    gathered back (the gathers' vjps sum the prompt's key/value gradients over its two
    rows). Padded query rows get values nothing reads. Returns ``(S, L, H * Dh)``.
    """
    S, H, L, Dh = q.shape
    flat = [x.transpose(0, 2, 1, 3).reshape(S * L, x.shape[1], Dh) for x in (q, k, v)]  # (S*L, h, Dh)
    outs = []
    for gather, (rows, M), q0 in zip(plan.gathers, plan.shapes, plan.starts):
        qg, kg, vg = (x[g].transpose(0, 2, 1, 3) for x, g in zip(flat, (gather[:, q0:], gather, gather)))
        out = causal(qg, kg, vg, scale)  # (rows, H, M - q0, Dh)
        outs.append(out.transpose(0, 2, 1, 3).reshape(rows * (M - q0), H * Dh))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return out[plan.scatter].reshape(S, L, H * Dh)


def attention(attn, x: mx.array, mask, positions: mx.array, qk_norm: bool = False,
              causal: Callable = fused_causal) -> mx.array:
    """Self-attention of an mlx-lm ``Attention`` module with explicit mask/positions.

    Args:
        attn: the layer's attention module (``q_proj``..``o_proj``, ``rope``,
            ``scale``; ``q_norm``/``k_norm`` when ``qk_norm``).
        x: ``(B, L, D)`` normalised input.
        mask: ``(B, 1, L, L)`` bool, True where a query may attend; ``"causal"``
            (MLX's fused causal mode, no mask array); or a ``SharedAttention``
            plan (prefix sharing by one batched fused causal call, no mask array).
        positions: ``(B, L)`` int32 RoPE positions.
        causal: the causal attention of the ``"causal"`` and ``SharedAttention`` masks.
    Returns:
        ``(B, L, D)`` output of ``o_proj``.
    """
    B, L, _ = x.shape
    n_heads, n_kv = _heads(attn)
    q = attn.q_proj(x).reshape(B, L, n_heads, -1)  # (B, L, H, Dh)
    k = attn.k_proj(x).reshape(B, L, n_kv, -1)  # (B, L, Hkv, Dh)
    v = attn.v_proj(x).reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3)  # (B, Hkv, L, Dh)
    if qk_norm:  # RMSNorm over Dh: the same before or after the transpose
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope_at(attn.rope, q, positions), rope_at(attn.rope, k, positions)
    return attn.o_proj(attend(q, k, v, attn.scale, mask, causal))


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask, causal: Callable = fused_causal) -> mx.array:
    """``(B, H, L, Dh)`` queries over ``(B, Hkv, L, Dh)`` keys/values -> ``(B, L, H * Dh)``.

    ``mask`` and ``causal`` as in :func:`attention` (an explicit mask array always
    goes to MLX's attention).
    """
    B, _, L, _ = q.shape
    if isinstance(mask, SharedAttention):
        return shared_attention(q, k, v, scale, mask, causal)  # (B, L, H * Dh)
    if isinstance(mask, str) and mask == "causal":
        out = causal(q, k, v, scale)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # (B, H, L, Dh)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _llama_layer(qk_norm: bool, residual_scale: float = 1.0, own: bool = False):
    """Pre-norm block: ``h = x + s*attn(norm(x)); out = h + s*mlp(norm(h))``; ``own``:
    with ``kernels``' attention and SwiGLU (the MLP as the mlx-lm files write it)."""
    causal = kernels.causal_attention if own else fused_causal

    def mlp(m, x):
        return m.down_proj(kernels.swiglu(m.gate_proj(x), m.up_proj(x))) if own else m(x)

    def call(layer, x, mask, positions):
        r = attention(layer.self_attn, layer.input_layernorm(x), mask, positions, qk_norm, causal)
        h = x + r * residual_scale if residual_scale != 1.0 else x + r
        r = mlp(layer.mlp, layer.post_attention_layernorm(h))
        return h + r * residual_scale if residual_scale != 1.0 else h + r

    return call


def _gemma3_layer(own: bool = False):
    """Sandwich-norm block of ``gemma3_text.TransformerBlock``; ``own``: ``kernels``' causal attention."""
    clip_residual = importlib.import_module("mlx_lm.models.gemma3_text").clip_residual
    causal = kernels.causal_attention if own else fused_causal

    def call(layer, x, mask, positions):
        r = attention(layer.self_attn, layer.input_layernorm(x), mask, positions, True, causal)
        h = clip_residual(x, layer.post_attention_layernorm(r))
        r = layer.mlp(layer.pre_feedforward_layernorm(h))
        return clip_residual(h, layer.post_feedforward_layernorm(r))

    return call


def _gemma4_layer(layer, x, mask, positions, layer_input, shared_kv):
    """``gemma4_text.DecoderLayer``: K/V from ``shared_kv`` when the layer reuses
    its donor's, dense MLP (+ MoE block), per-layer input gating, ``layer_scalar``."""
    attn = layer.self_attn
    B, L, _ = x.shape
    y = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(y).reshape(B, L, attn.n_heads, attn.head_dim))  # (B, L, H, Dh)
    if shared_kv is None:
        k = attn.k_proj(y).reshape(B, L, attn.n_kv_heads, attn.head_dim)  # (B, L, Hkv, Dh)
        v = k if attn.use_k_eq_v else attn.v_proj(y).reshape(B, L, attn.n_kv_heads, attn.head_dim)
        k = rope_at(attn.rope, attn.k_norm(k), positions)  # (B, Hkv, L, Dh)
        v = attn.v_norm(v).transpose(0, 2, 1, 3)  # (B, Hkv, L, Dh)
    else:  # already normed and rotated by the donor, as mlx-lm reuses them
        k, v = shared_kv
    q = rope_at(attn.rope, q, positions)  # (B, H, L, Dh)
    h = x + layer.post_attention_layernorm(attn.o_proj(attend(q, k, v, attn.scale, mask)))
    r = layer.mlp(layer.pre_feedforward_layernorm(h))  # (B, L, D)
    if layer.enable_moe:  # dense MLP + routed experts, each with its own norms
        experts = layer.experts(layer.pre_feedforward_layernorm_2(h), *layer.router(h))
        r = layer.post_feedforward_layernorm_1(r) + layer.post_feedforward_layernorm_2(experts)
    h = h + layer.post_feedforward_layernorm(r)
    if layer.per_layer_input_gate is not None and layer_input is not None:
        g = nn.gelu_approx(layer.per_layer_input_gate(h)) * layer_input  # (B, L, P)
        h = h + layer.post_per_layer_input_norm(layer.per_layer_projection(g))
    return h * layer.layer_scalar, (k, v)


def _gemma4_layer_inputs(inner, args):
    """``Gemma4TextModel._get_per_layer_inputs`` then ``_project_per_layer_inputs``."""
    n, P = args.num_hidden_layers, args.hidden_size_per_layer_input

    def layer_inputs(tokens, h):  # (S, L), (S, L, D) -> (S, L, n, P)
        S, L = tokens.shape
        from_ids = (inner.embed_tokens_per_layer(tokens) * inner.embed_tokens_per_layer_scale).reshape(S, L, n, P)
        proj = (inner.per_layer_model_projection(h) * inner.per_layer_projection_scale).reshape(S, L, n, P)
        return (inner.per_layer_projection_norm(proj) + from_ids) * inner.per_layer_input_scale

    return layer_inputs


def _gemma4(model) -> Arch:
    inner, args = model.model, model.args
    layers = list(inner.layers)
    embed = lambda tokens: inner.embed_tokens(tokens) * inner.embed_scale  # noqa: E731
    windows = [args.sliding_window if layer.layer_type == "sliding_attention" else None for layer in layers]
    head = _linear_head(model, inner.norm, tied=model.tie_word_embeddings, softcap=args.final_logit_softcapping)
    donors = [None if d == i else d for i, d in enumerate(inner.previous_kvs)]  # mlx-lm's own routing
    layer_inputs = _gemma4_layer_inputs(inner, args) if args.hidden_size_per_layer_input else None
    return Arch("gemma4_text", embed, layers, _gemma4_layer, windows, head, donors, layer_inputs)


def _no_kv(call):
    """A ``(layer, x, mask, positions) -> x`` call in the :class:`Arch` signature."""
    return lambda layer, x, mask, positions, layer_input, shared_kv: (call(layer, x, mask, positions), None)


def _linear_head(model, norm, tied: bool, pre_scale: float = 1.0, softcap: Optional[float] = None):
    """``norm -> (optional / pre_scale) -> lm_head or tied embedding -> softcap``."""
    embed = model.model.embed_tokens

    def head(h):  # (n, D) -> (n, V)
        h = norm(h)
        if pre_scale != 1.0:
            h = h / pre_scale
        out = embed.as_linear(h) if tied else model.lm_head(h)
        if softcap:
            out = mx.tanh(out / softcap) * softcap
        return out

    return head


def adapter_for(model: nn.Module, own_kernels: bool = False) -> Optional[Arch]:
    """The :class:`Arch` of ``model``, or None when its architecture is not supported.

    Supported mlx-lm modules: see ``SUPPORTED``. ``own_kernels`` (``engine.kernels:
    dtrain``): causal attention, SwiGLU and the head's log-sum-exp from ``kernels``
    (Gemma 4 keeps MLX's attention; sliding-window masks always do).
    """
    name = module_name(model)
    if name not in SUPPORTED:
        return None
    lse = {"logsumexp": kernels.logsumexp} if own_kernels else {}
    if name == "gemma4_text":
        return replace(_gemma4(model), **lse)
    inner, args = model.model, model.args
    layers = list(inner.layers)
    windows = [None] * len(layers)
    if name in ("llama", "qwen2", "qwen3"):
        layer_call = _llama_layer(qk_norm=name == "qwen3", own=own_kernels)
        embed = inner.embed_tokens
        head = _linear_head(model, inner.norm, tied=args.tie_word_embeddings)
        if name == "llama":
            windows = [inner.sliding_window if layer.use_sliding else None for layer in layers]
    elif name == "minicpm":
        layer_call = _llama_layer(qk_norm=False, residual_scale=args.scale_depth / math.sqrt(args.num_hidden_layers),
                                  own=own_kernels)
        embed = lambda tokens: inner.embed_tokens(tokens) * args.scale_emb  # noqa: E731
        if args.tie_word_embeddings:  # minicpm.Model: no logit scaling when tied
            head = lambda h: inner.norm(h) @ inner.embed_tokens.weight.T  # noqa: E731
        else:
            head = _linear_head(model, inner.norm, tied=False, pre_scale=args.hidden_size / args.dim_model_base)
    else:  # gemma3_text
        layer_call = _gemma3_layer(own_kernels)
        scale = mx.array(args.hidden_size**0.5, mx.bfloat16)  # rounded to bf16 as in Gemma3Model

        def embed(tokens):
            h = inner.embed_tokens(tokens)
            return h * scale.astype(h.dtype)

        pattern = args.sliding_window_pattern
        windows = [None if i % pattern == pattern - 1 else args.sliding_window for i in range(len(layers))]
        head = _linear_head(
            model, inner.norm, tied=model.tie_word_embeddings or "lm_head" not in model,
            softcap=getattr(args, "final_logit_softcapping", None),
        )
    return Arch(name, embed, layers, _no_kv(layer_call), windows, head, **lse)
