"""Per-architecture adapters: an mlx-lm model's embedding, decoder layers and
LM head as plain functions with explicit masks and positions.

The segmented engine cannot call ``model(tokens)``: it needs the hidden state
between layers, block-wise RoPE positions and its own boolean masks. Each
adapter calls the layer's *own* submodules (norms, LoRA-wrapped projections,
q/k norms, MLP) in the order the mlx-lm model file does, so the math is the
model's. Nothing here patches a class or keeps module-level state.

Mirrored files (mlx-lm 0.32): ``models/llama.py`` (also mistral, SmolLM2),
``qwen2.py``, ``qwen3.py``, ``gemma3_text.py``, ``minicpm.py``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .layout import SharedAttention

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3_text", "minicpm")


@dataclass(frozen=True)
class Arch:
    """One model seen as ``embed -> layers -> head``.

    Attributes:
        name: the mlx-lm module name (``llama``, ``qwen3``, ...).
        embed: ``(S, L)`` int32 tokens -> ``(S, L, D)`` hidden state (with the
            model's embedding scaling).
        layers: the decoder layer modules, in order.
        layer_call: ``(layer, x (S, L, D), mask, positions (S, L) int32) -> (S, L, D)``;
            ``mask`` as in :func:`attention`.
        windows: per layer, the sliding window (tokens) or None for global.
        head: ``(n, D)`` final hidden rows -> ``(n, V)`` logits (final norm,
            output projection, any logit scaling or soft-capping).
    """

    name: str
    embed: Callable
    layers: list
    layer_call: Callable
    windows: list
    head: Callable


def module_name(model: nn.Module) -> str:
    """The mlx-lm module that defines ``model`` (``mistral`` models are ``llama``)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """Apply ``rope`` to ``x`` ``(B, L, H, Dh)`` at per-token ``positions`` ``(B, L)``.

    ``mx.fast.rope`` (and mlx-lm's rope modules, which call it) accept an
    array offset of shape ``(batch,)``; folding tokens into the batch axis
    gives each token its own position. Equal to the scalar-offset rope bitwise.
    Returns ``(B, H, L, Dh)``.
    """
    B, L, H, Dh = x.shape
    y = rope(x.reshape(B * L, H, 1, Dh), offset=positions.reshape(-1))  # (B*L, H, 1, Dh)
    return y.reshape(B, L, H, Dh).transpose(0, 2, 1, 3)


def _heads(attn) -> tuple[int, int]:
    n = getattr(attn, "n_heads", None) or attn.num_heads
    kv = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
    return n, kv


def shared_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, plan: SharedAttention) -> mx.array:
    """Prefix-shared attention by fused causal calls per sequence (see ``SharedAttention``).

    ``q`` ``(S, H, L, Dh)``, ``k``/``v`` ``(S, Hkv, L, Dh)``. Padded query rows
    get zeros: no real query attends to them, so nothing downstream reads them.
    Relies on MLX's bottom-right ``mask="causal"`` when ``Lq < Lk``.
    Returns ``(S, H, L, Dh)``.
    """
    sdpa = mx.fast.scaled_dot_product_attention
    rows = []
    for s, (P, C, R) in enumerate(plan.spans):
        n = P + C
        qs, ks, vs = q[s : s + 1], k[s : s + 1], v[s : s + 1]  # (1, H|Hkv, L, Dh)
        parts = [sdpa(qs[:, :, :n], ks[:, :, :n], vs[:, :, :n], scale=scale, mask="causal")]  # (1, H, P+C, Dh)
        if R:  # rejected queries over [prompt keys; rejected keys]: query i sees keys <= i + P
            kr = mx.concatenate([ks[:, :, :P], ks[:, :, n : n + R]], axis=2)  # (1, Hkv, P+R, Dh)
            vr = mx.concatenate([vs[:, :, :P], vs[:, :, n : n + R]], axis=2)
            parts.append(sdpa(qs[:, :, n : n + R], kr, vr, scale=scale, mask="causal"))  # (1, H, R, Dh)
        if n + R < plan.length:
            parts.append(mx.zeros((1, q.shape[1], plan.length - n - R, q.shape[3]), q.dtype))
        rows.append(mx.concatenate(parts, axis=2))  # (1, H, L, Dh)
    return mx.concatenate(rows, axis=0)


def attention(attn, x: mx.array, mask, positions: mx.array, qk_norm: bool = False) -> mx.array:
    """Self-attention of an mlx-lm ``Attention`` module with explicit mask/positions.

    Args:
        attn: the layer's attention module (``q_proj``..``o_proj``, ``rope``,
            ``scale``; ``q_norm``/``k_norm`` when ``qk_norm``).
        x: ``(B, L, D)`` normalised input.
        mask: ``(B, 1, L, L)`` bool, True where a query may attend; ``"causal"``
            (MLX's fused causal mode, no mask array); or a ``SharedAttention``
            plan (prefix sharing by fused causal calls, no mask array).
        positions: ``(B, L)`` int32 RoPE positions.
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
    if isinstance(mask, SharedAttention):
        out = shared_attention(q, k, v, attn.scale, mask)  # (B, H, L, Dh)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)  # (B, H, L, Dh)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _llama_layer(qk_norm: bool, residual_scale: float = 1.0):
    """Pre-norm block: ``h = x + s*attn(norm(x)); out = h + s*mlp(norm(h))``."""

    def call(layer, x, mask, positions):
        r = attention(layer.self_attn, layer.input_layernorm(x), mask, positions, qk_norm)
        h = x + r * residual_scale if residual_scale != 1.0 else x + r
        r = layer.mlp(layer.post_attention_layernorm(h))
        return h + r * residual_scale if residual_scale != 1.0 else h + r

    return call


def _gemma3_layer():
    """Sandwich-norm block of ``gemma3_text.TransformerBlock``."""
    clip_residual = importlib.import_module("mlx_lm.models.gemma3_text").clip_residual

    def call(layer, x, mask, positions):
        r = attention(layer.self_attn, layer.input_layernorm(x), mask, positions, qk_norm=True)
        h = clip_residual(x, layer.post_attention_layernorm(r))
        r = layer.mlp(layer.pre_feedforward_layernorm(h))
        return clip_residual(h, layer.post_feedforward_layernorm(r))

    return call


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


def adapter_for(model: nn.Module) -> Optional[Arch]:
    """The :class:`Arch` of ``model``, or None when its architecture is not supported.

    Supported mlx-lm modules: see ``SUPPORTED``.
    """
    name = module_name(model)
    if name not in SUPPORTED:
        return None
    inner, args = model.model, model.args
    layers = list(inner.layers)
    windows = [None] * len(layers)
    if name in ("llama", "qwen2", "qwen3"):
        layer_call = _llama_layer(qk_norm=name == "qwen3")
        embed = inner.embed_tokens
        head = _linear_head(model, inner.norm, tied=args.tie_word_embeddings)
        if name == "llama":
            windows = [inner.sliding_window if layer.use_sliding else None for layer in layers]
    elif name == "minicpm":
        layer_call = _llama_layer(qk_norm=False, residual_scale=args.scale_depth / math.sqrt(args.num_hidden_layers))
        embed = lambda tokens: inner.embed_tokens(tokens) * args.scale_emb  # noqa: E731
        if args.tie_word_embeddings:  # minicpm.Model: no logit scaling when tied
            head = lambda h: inner.norm(h) @ inner.embed_tokens.weight.T  # noqa: E731
        else:
            head = _linear_head(model, inner.norm, tied=False, pre_scale=args.hidden_size / args.dim_model_base)
    else:  # gemma3_text
        layer_call = _gemma3_layer()
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
    return Arch(name, embed, layers, layer_call, windows, head)
