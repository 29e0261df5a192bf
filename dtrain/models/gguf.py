"""GGUF files → mlx-lm config and weights (llama and gemma3 architectures).

Files whose tensors are all F32, F16, BF16, Q4_0, Q4_1 or Q8_0 are read with
``mx.load(path, return_metadata=True)``, which returns F32/F16 tensors as they
are (BF16 ones, which it narrows to float16, are read again exactly by
gguf_bf16.py) and Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized triplets
(``name.weight`` uint32, ``name.scales``, ``name.biases``; group size 32). Files
with other tensor types (K-quants, Q5_0, ...) are read with ``gguf.GGUFReader``
and every tensor is dequantized to float32 with ``gguf.quants.dequantize``
(``mx.load`` reads some K-quants, but not exactly: :data:`_MX_LOAD_TYPES`).

Two conventions of llama.cpp's ``convert_hf_to_gguf.py`` are undone here so the
result is the plain Hugging Face layout that mlx-lm expects (and that
``dtrain convert`` writes):

* llama: the rows of ``attn_q`` / ``attn_k`` are permuted (``LlamaModel.permute``)
  from HF's half-split rotary layout to interleaved pairs. We apply the inverse
  permutation rather than setting ``rope_traditional``, so a converted folder is
  an ordinary HF-layout llama.
* gemma3: every ``*norm.weight`` is stored as ``w + 1`` (``norm_shift``); mlx-lm's
  ``gemma3_text.RMSNorm`` computes ``x * (1 + w)`` like HF, so we subtract 1.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ModelError
from ..files import lfs_pointer_problem
from .gguf_bf16 import BadAlignment, read_bf16_tensors, tensor_infos

GROUP_SIZE = 32  # every GGUF block quant that mx.load accepts has 32-value blocks
# GGML types mx.load reads right (MLX 0.32: F32, F16, Q4_0, Q4_1, Q8_0, and BF16 read again exactly); it also
# accepts Q2_K/Q4_K/Q6_K, but narrows them to float16 and decodes Q4_K wrongly, and drops TQ1_0/TQ2_0 tensors
_MX_LOAD_TYPES = {0, 1, 2, 3, 8, 30}

# GGUF tensor base names → HF/mlx-lm module paths, per architecture.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_LAYER_NAMES = {
    "llama": {**_LAYER_NAMES, "ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        **_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# config.json's architectures: transformers' model class, which llama.cpp's convert_hf_to_gguf.py requires
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs"}  # llama3 rope factors, turned into config["rope_scaling"] instead
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFModel:
    """A GGUF file translated to mlx-lm terms.

    ``config``: mlx-lm config dict (``model_type`` ``llama`` or ``gemma3_text``).
    ``weights``: HF-named arrays; quantized modules appear as ``.weight`` (uint32),
    ``.scales`` and ``.biases``. ``quantization``: module path → ``{"group_size",
    "bits"}`` for those modules. ``metadata``: the GGUF key/value pairs as Python
    values (lists, str, int, float, bool).
    """

    config: dict
    weights: dict
    quantization: dict
    metadata: dict


def read_gguf(path: Path) -> tuple[dict, dict]:
    """Read ``(metadata, tensors)`` from a GGUF file, GGUF tensor names kept.

    Raises:
        ModelError: the file is not a readable GGUF file.
    """
    try:
        header = tensor_infos(path)  # one walk of the header (its vocabulary arrays) for the types and BF16
        problem = next(filter(None, (_type_problem(name, ttype) for name, _, ttype, _ in header[0])), None)
        if problem:
            raise ModelError(f"{path}: {problem}")
        if {ttype for _, _, ttype, _ in header[0]} <= _MX_LOAD_TYPES:
            tensors, raw = mx.load(str(path), return_metadata=True)
            # mx.load narrows BF16 tensors to float16; read those again exactly
            tensors.update({k: mx.array(v) for k, v in read_bf16_tensors(path, header).items()})
            return {k: _plain(v) for k, v in raw.items()}, tensors
    except BadAlignment as err:  # gguf's reader would read the tensors at other offsets
        raise ModelError(f"{path}: {err}") from None
    except (RuntimeError, ValueError, struct.error, OSError):
        pass  # not GGUF at all, not one mx.load reads, or unreadable: gguf's reader says which
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        metadata = {
            name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")
        }
        tensors = {}
        for t in reader.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            tensors[t.name] = mx.array(np.ascontiguousarray(data, dtype=np.float32))
    except Exception as err:  # the reader raises ValueError, KeyError, struct errors...
        raise ModelError(lfs_pointer_problem(path) or f"{path}: not a readable GGUF file "
                         f"({_cut_short(path) or f'{type(err).__name__}: {err}'})") from None
    return metadata, tensors


def _type_problem(name: str, ttype: int) -> str | None:
    """Why tensor ``name`` of GGML type number ``ttype`` cannot be read, else None: a number gguf does not know, or
    a type its dequantization does not implement (Q8_1, Q8_K, I8..I64, F64); gguf's reader names neither the tensor
    nor, for the first, the type ('np.uint32(99) is not a valid GGMLQuantizationType')."""
    import gguf

    if ttype in _MX_LOAD_TYPES:
        return None
    try:
        qtype = gguf.GGMLQuantizationType(ttype)
    except ValueError:
        return f"tensor {name!r} has GGML type {ttype}, which the installed gguf package does not know"
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)  # one block
    except NotImplementedError:
        return f"tensor {name!r} is {qtype.name}, a type dtrain cannot read (the gguf package does not dequantize it)"
    return None


def _cut_short(path: Path) -> str | None:
    """How ``path`` ends before its header or its tensors do (an incomplete download), else None: gguf's reader
    then fails on the missing bytes in numpy's terms ('cannot reshape array of size 1496 into shape (64,32)')."""
    import gguf

    size = path.stat().st_size
    try:
        infos, start = tensor_infos(path)
        sizes = [gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)] for _, _, ttype, _ in infos]
    except struct.error:  # a fixed-size field past the end
        return f"cut short: its {size} bytes end inside the header; an incomplete download?"
    except (ValueError, KeyError, OSError):
        return None
    end = max((start + offset + math.prod(shape) // block * nbytes
               for (_, shape, _, offset), (block, nbytes) in zip(infos, sizes)), default=start)
    if size < end:
        return f"cut short: {size} bytes, but its tensors end at byte {end}; an incomplete download?"
    return None


def _plain(value):
    return value.tolist() if isinstance(value, mx.array) else value


def gguf_to_mlx(path: Path) -> GGUFModel:
    """Load a llama or gemma3 GGUF file as mlx-lm config and HF-named weights.

    Raises:
        ModelError: unreadable file, an architecture other than llama/gemma3, or model keys it cannot
            read as llama.cpp does (text, per-layer lists, 0, head counts that do not divide the rows).
    """
    metadata, tensors = read_gguf(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in _ARCH_LAYER_NAMES:  # a list would be 'unhashable'
        raise ModelError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: llama, gemma3); "
            "convert the original Hugging Face model with mlx_lm instead"
        )
    try:
        config = _config(arch, metadata, tensors)
        _check_model_keys(arch, metadata, config)
        _check_vocabulary_size(metadata, config)
        _check_sizes(arch, config, tensors)
        weights = _rename(arch, tensors)
        if arch == "llama":
            _unpermute_qk(weights, config)
    except KeyError as err:
        raise ModelError(f"{path}: GGUF file lacks {err.args[0]!r}, which a {arch} model needs") from None
    except ModelError as err:
        raise ModelError(f"{path}: {err}") from None
    if arch == "llama":
        _fill_biases(weights, config)
    else:
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = weights[name].astype(mx.float32) - 1.0
    quantization = {
        name[: -len(".scales")]: {"group_size": GROUP_SIZE, "bits": _bits(weights, name[: -len(".scales")])}
        for name in weights
        if name.endswith(".scales")
    }
    return GGUFModel(config=config, weights=weights, quantization=quantization, metadata=metadata)


def _bits(weights: dict, module: str) -> int:
    # (out, in * bits / 32) uint32 words against (out, in / 32) scales.
    return weights[f"{module}.weight"].shape[-1] // weights[f"{module}.scales"].shape[-1]


def hf_name(arch: str, name: str) -> str | None:
    """The HF/mlx-lm parameter name of GGUF tensor ``name`` (None for ``rope_freqs``).

    Raises:
        ModelError: a tensor name the architecture does not have.
    """
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "scales", "biases", "bias"):
        base, suffix = name, "weight"  # some writers omit ".weight"
    if base in _IGNORED:
        return None
    match = _BLOCK.fullmatch(base)
    if match and match.group(2) in _ARCH_LAYER_NAMES[arch]:
        return f"model.layers.{match.group(1)}.{_ARCH_LAYER_NAMES[arch][match.group(2)]}.{suffix}"
    if not match and base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ModelError(f"unexpected GGUF tensor {name!r} for architecture {arch}")


def _rename(arch: str, tensors: dict) -> dict:
    return {hf: value for name, value in tensors.items() if (hf := hf_name(arch, name)) is not None}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): HF half-split rotary rows → interleaved.

    ``w``: ``(rows, cols)`` with ``rows = n_head * head_dim``; returns the same shape.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_qk(weights: dict, config: dict) -> None:
    """Invert llama.cpp's ``permute(w, n_head, n_head_kv)`` on q_proj/k_proj rows.

    llama.cpp: ``w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)``;
    the inverse reshapes to ``(n_head, rows // n_head // 2, 2, ...)`` and swaps
    back. Rows of quantized triplets move the same way (groups run along columns).

    Raises:
        ModelError: rows that are not the head count's heads of an even size (naming the key).
    """
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in sorted(weights):  # the first layer named when the rows do not fit
        proj = name.split(".")[-2]
        if proj in heads:
            w = weights[name]
            n = heads[proj]
            rows = w.shape[0]
            if rows % (2 * n):
                key = "llama.attention.head_count" + ("_kv" if proj == "k_proj" else "")
                raise ModelError(f"GGUF key '{key}' = {n} does not fit {name}: its {rows} rows are not {n} heads "
                                 "of an even size")
            weights[name] = w.reshape(n, rows // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_BIASED = {"attention_bias": ("attn_q", "attn_k", "attn_v", "attn_output"),
           "mlp_bias": ("ffn_gate", "ffn_up", "ffn_down")}


def _fill_biases(weights: dict, config: dict) -> None:
    """Zero biases for the projections a biased llama file leaves without one: llama.cpp reads each
    bias tensor as optional, mlx-lm's ``attention_bias``/``mlp_bias`` give every projection of the group one."""
    for key, parts in _BIASED.items():
        projs = {_LAYER_NAMES[p].split(".")[-1] for p in parts}
        for name in [n for n in weights if config.get(key) and n.endswith(".weight") and n.split(".")[-2] in projs]:
            weights.setdefault(name[: -len("weight")] + "bias", mx.zeros((weights[name].shape[0],), mx.float32))


def _llama3_rope_scaling(factors: mx.array, head_dim: int, base: float) -> dict:
    """mlx-lm's ``llama3`` rope_scaling that reproduces llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores per-frequency factors (head_dim / 2,) instead of the HF
    parameters; Llama 3.1/3.2 use low/high_freq_factor 1/4 and an original
    context of 8192, and the largest factor is ``factor``. We check the guess
    against the tensor (``Llama3RoPE._freqs`` divided by the unscaled
    wavelengths) and refuse files it does not reproduce.
    """
    from mlx_lm.models.rope_utils import Llama3RoPE

    factors = factors.astype(mx.float32)
    scaling = {
        "rope_type": "llama3", "factor": factors.max().item(), "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    rope = Llama3RoPE(head_dim, base=base, scaling_config=scaling)
    implied = rope._freqs / base ** (mx.arange(0, head_dim, 2) / head_dim)
    if implied.shape != factors.shape or not mx.allclose(implied, factors, rtol=1e-3).item():
        raise ModelError("rope_freqs do not match llama3 rope scaling with default parameters; not supported")
    return scaling


def _swa_pattern(value, layers: int) -> int:
    """The period mlx-lm's gemma3_text takes (every period-th layer global) of the key's value.

    Newer writers store one flag per layer (true = sliding).

    Raises:
        ModelError: a list of another length than the layers, or one that does not repeat one period
            (mlx-lm's model would slide other layers than the file names).
    """
    if not isinstance(value, list):
        return int(value)
    period = value.index(False) + 1 if False in value else len(value) + 1
    odd = next((i for i in range(max(len(value), layers))
                if i >= len(value) or i >= layers or bool(value[i]) != ((i + 1) % period != 0)), None)
    if odd is not None:
        raise ModelError(f"GGUF key 'gemma3.attention.sliding_window_pattern' (one flag per layer, {len(value)} for "
                         f"{layers} layers) is not supported: layer {odd} breaks the repeating pattern of {period - 1} "
                         "sliding layers and a global one that mlx-lm's gemma3_text computes")
    return period


# {arch}.* keys read by _config, or checked by _check_model_keys to hold the value
# the model definition assumes. Any other {arch}.* key may change the model
# (softcapping, ALiBi, experts, partial rotary ...) and is refused by name.
_MODEL_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.finetuned",
    "expert_count", "expert_used_count",
}
_GEMMA3_KEYS = {"rope.freq_base_swa", "attention.sliding_window", "attention.sliding_window_pattern"}


def _is_number(value) -> bool:
    """A finite int or float (a float32 NaN or inf key would make a NaN model, or fail in int())."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_model_keys(arch: str, md: dict, config: dict) -> None:
    """Refuse metadata that changes the model in a way the mlx-lm config does not express.

    Raises:
        ModelError: an unknown ``{arch}.*`` key, or a known one whose value the
            model definition cannot reproduce, naming the key and value.
    """
    known = _MODEL_KEYS | (_GEMMA3_KEYS if arch == "gemma3" else set())
    for key in md:
        if key.startswith(f"{arch}.") and key[len(arch) + 1:] not in known:
            raise ModelError(f"GGUF key {key!r} is not supported (it may change the model)")
    head_dim = config["head_dim"]
    expected = {
        "rope.dimension_count": head_dim,  # partial rotary embeddings are not in mlx-lm's llama/gemma3
        "attention.value_length": head_dim,
        "vocab_size": config["vocab_size"],
        "expert_count": 0,
        "expert_used_count": 0,
    }
    for name, value in expected.items():
        got = md.get(f"{arch}.{name}")
        if got is not None and (not _is_number(got) or int(got) != value):
            raise ModelError(f"GGUF key '{arch}.{name}' = {got} is not supported (expected {value})")
    split = md.get("split.count", 1)
    if not _is_number(split):  # else int()'s traceback
        raise ModelError(f"GGUF key 'split.count' = {split!r} is not supported (expected 1)")
    if int(split) > 1:
        raise ModelError(f"split GGUF files (split.count = {split}) are not supported; merge them first")


def _check_vocabulary_size(md: dict, config: dict) -> None:
    """Refuse a vocabulary with more tokens than ``token_embd.weight`` has rows: MLX does not bounds-check an
    embedding lookup, so those ids would train on whatever memory lies past it (llama.cpp refuses the file).

    Raises:
        ModelError: naming both sizes.
    """
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > config["vocab_size"]:
        raise ModelError(f"tokenizer.ggml.tokens holds {len(tokens)} tokens but token_embd.weight has "
                         f"{config['vocab_size']} rows, so ids {config['vocab_size']} and above have no embedding")


def _check_sizes(arch: str, config: dict, tensors: dict) -> None:
    """Refuse a layer count, width, feed-forward size or (gemma3) head count other than the tensors have, before a
    model is built from them: a damaged 2**40 ended in MLX's OverflowError or a MemoryError (llama.cpp refuses such
    files too).

    Raises:
        ModelError: naming the key, its value and what the tensors hold.
    """
    layers = 1 + max((int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))), default=-1)
    width = (tensors["token_embd.scales"].shape[-1] * GROUP_SIZE if "token_embd.scales" in tensors
             else tensors["token_embd.weight"].shape[-1])  # mx.load's quantized triplet: 32 values per scale
    ffn = tensors.get("blk.0.ffn_up.weight")
    held = [("block_count", "num_hidden_layers", layers, "layers"),
            ("embedding_length", "hidden_size", width, "values in a row of token_embd.weight"),
            ("feed_forward_length", "intermediate_size", None if ffn is None else ffn.shape[0],
             "rows in blk.0.ffn_up.weight")]
    for key, name, value, what in held:
        if value is not None and config[name] != value:
            raise ModelError(f"GGUF key '{arch}.{key}' = {config[name]} does not fit the tensors, which hold {value} "
                             f"{what}")
    for proj, key, name in (("attn_q", "head_count", "num_attention_heads"),
                            ("attn_k", "head_count_kv", "num_key_value_heads")):
        weight = tensors.get(f"blk.0.{proj}.weight")
        if arch == "gemma3" and weight is not None and weight.shape[0] != config[name] * config["head_dim"]:
            raise ModelError(f"GGUF keys '{arch}.attention.{key}' = {config[name]} and '{arch}.attention.key_length' "
                             f"= {config['head_dim']} do not fit the tensors: blk.0.{proj}.weight has "
                             f"{weight.shape[0]} rows")  # llama's rows are checked as they are unpermuted


def _config(arch: str, md: dict, tensors: dict) -> dict:
    """mlx-lm ModelArgs for ``arch`` from GGUF keys (``{arch}.embedding_length`` ...)."""

    def key(name, default=None):
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise KeyError(f"{arch}.{name}")
        # counts, sizes, rope bases and epsilon: a text, a per-layer list or 0 would end in int()'s or a reshape's error
        if not _is_number(value) or value <= 0:
            raise ModelError(f"GGUF key '{arch}.{name}' = {value!r} is not supported (expected a number above 0)")
        return value

    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise KeyError("token_embd.weight")
    heads = int(key("attention.head_count"))
    config = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "hidden_size": int(key("embedding_length")),
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "vocab_size": int(embed.shape[0]),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    scaling = md.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        base = float(key("rope.freq_base", 10000.0))
        head_dim = int(key("attention.key_length", config["hidden_size"] // heads))
        config["rope_scaling"] = _llama3_rope_scaling(tensors["rope_freqs.weight"], head_dim, base)
    elif scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelError(f"GGUF rope scaling {scaling!r} is not supported (supported: none, linear)")
    if arch == "llama":
        config.update(
            model_type="llama",
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            head_dim=int(key("attention.key_length", config["hidden_size"] // heads)),
        )
        # llama.cpp's llama takes optional bias tensors (blk.N.attn_q.bias ...)
        biased = {name.split(".")[2] for name in tensors if name.startswith("blk.") and name.endswith(".bias")}
        config.update({key: True for key, parts in _BIASED.items() if biased & set(parts)})
        return config
    head_dim = int(key("attention.key_length", 256))
    layers = config["num_hidden_layers"]
    pattern = md.get("gemma3.attention.sliding_window_pattern")
    config.update(
        model_type="gemma3_text",
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=float(key("rope.freq_base_swa", 10_000.0)),
        sliding_window=int(key("attention.sliding_window", 512)),
        # llama.cpp hard-codes a 5:1 local:global pattern for gemma3 and, like HF,
        # scales queries by hidden/heads only for the 27B model (62 layers).
        sliding_window_pattern=_swa_pattern(pattern if isinstance(pattern, list) else  # one bool per layer
                                            key("attention.sliding_window_pattern", 6), layers),
        query_pre_attn_scalar=config["hidden_size"] // heads if layers == 62 else head_dim,
    )
    return config
