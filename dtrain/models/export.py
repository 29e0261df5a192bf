"""``dtrain export ADAPTER_DIR --base MODEL --out OUT [--gguf TYPE]``: the base with the adapter merged.

The adapter is applied and fused with mlx-lm's own machinery, as ``mlx_lm.fuse``
does (``tuner.utils.load_adapters``, then ``LoRALinear.fuse`` on every LoRA
layer: ``W + scale * (B^T A^T)``). The merged model is written as an mlx-lm
folder and, with ``--gguf``, as a GGUF file in the base GGUF's own layout: every
metadata key of the base is copied (tokenizer, chat template, rope and
architecture keys), tensors keep the base's names and order, llama Q/K rows are
permuted back to llama.cpp's interleaved rotary order and gemma3 norm weights
get llama.cpp's +1 again. Tensor types: 1-D tensors (norms, ``rope_freqs``) are
F32 as llama.cpp writes them; matrices take the requested type, and a matrix
whose rows are not a multiple of the 32-value quantization block is written F16.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ModelError
from ..files import storage
from .convert import check_new_folder, save_mlx_lm, write_folder
from .demo import demo_model_path
from .gguf import hf_name, permute_qk
from .load import DTYPES, LoadedModel, load_model

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


@dataclass
class ExportResult:
    """What :func:`export_adapter` wrote.

    ``folder``: the mlx-lm model folder. ``gguf``: the GGUF file inside it, or
    None. ``tensor_types``: GGML type name → number of tensors of that type in
    the GGUF. ``f16_fallback``: tensors written F16 instead of the requested
    block type because their rows are not a multiple of 32.
    """

    folder: Path
    gguf: Path | None = None
    tensor_types: dict = field(default_factory=dict)
    f16_fallback: list = field(default_factory=list)


def merge_adapter(adapter_dir: str, base: str) -> LoadedModel:
    """Load ``base`` in float32 and fuse the mlx-lm adapter in ``adapter_dir`` into it.

    Returns:
        The loaded base whose LoRA layers are replaced by fused ``nn.Linear``.

    Raises:
        ModelError: missing adapter files, or an adapter whose layers or shapes
            do not fit the base (names the adapter and the base).
    """
    from mlx_lm.tuner.utils import load_adapters

    folder = Path(adapter_dir)
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelError(f"{adapter_dir}: not an adapter folder (missing {', '.join(missing)})")
    loaded = load_model(base, dtype="float32")
    try:
        with storage(f"read the adapter {adapter_dir}"):
            load_adapters(loaded.model, str(folder))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
        detail = " ".join(str(err).split())[:400]
        raise ModelError(f"{adapter_dir}: this adapter does not fit the base model {base}: {detail}") from None
    fused = [(name, module.fuse()) for name, module in loaded.model.named_modules() if hasattr(module, "fuse")]
    loaded.model.update_modules(tree_unflatten(fused))
    mx.eval(loaded.model.parameters())
    return loaded


def export_adapter(adapter_dir: str, base: str, out_dir: str, gguf_type: str | None = None,
                   dtype: str = "bfloat16") -> ExportResult:
    """Write ``base`` with the adapter merged: an mlx-lm folder, and a GGUF file when asked.

    Args:
        adapter_dir: mlx-lm adapter folder (``adapters.safetensors``, ``adapter_config.json``).
        base: the model the adapter was trained on: ``demo``, a ``.gguf`` file, an
            mlx-lm/HF folder or a hub id.
        out_dir: new (or empty) folder; written atomically.
        gguf_type: one of :data:`GGUF_TYPES` to also write ``OUT/model-<TYPE>.gguf``
            (needs a GGUF base, whose layout and metadata are copied).
        dtype: float type of the mlx-lm folder's weights (float32, bfloat16, float16).

    Raises:
        ModelError: a bad adapter folder, a base that does not fit, a non-empty
            ``out_dir``, an unknown type, or ``gguf_type`` with a non-GGUF base.
    """
    if gguf_type is not None and gguf_type.lower() not in GGUF_TYPES:
        raise ModelError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    if dtype not in DTYPES:
        raise ModelError(f"export dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    check_new_folder(out_dir)
    base_gguf = None
    if gguf_type is not None:
        base_gguf = demo_model_path() if base == "demo" else Path(base).expanduser()
        if not base_gguf.is_file():
            raise ModelError(f"--gguf needs a GGUF base model (its layout and metadata are copied); {base} is not "
                             "a GGUF file. For an mlx-lm base, `mlx_lm.fuse --export-gguf` writes F16 llama GGUFs")
    loaded = merge_adapter(adapter_dir, base)
    merged = {name: np.array(value) for name, value in tree_flatten(loaded.model.parameters())}
    config = dict(loaded.config)
    config.setdefault("eos_token_id", sorted(loaded.tokenizer.eos_token_ids))
    loaded.model.set_dtype(DTYPES[dtype])
    result = ExportResult(folder=Path(out_dir))

    def fill(tmp: Path) -> None:
        save_mlx_lm(tmp, loaded.model, config, loaded.tokenizer)
        if base_gguf is not None:
            name = f"model-{gguf_type.upper()}.gguf"
            result.tensor_types, result.f16_fallback = write_gguf(base_gguf, merged, gguf_type.lower(), tmp / name)
            result.gguf = Path(out_dir) / name

    write_folder(out_dir, fill)
    return result


def write_gguf(base_gguf: Path, merged: dict, gguf_type: str, out_path: Path) -> tuple[dict, list]:
    """Write ``merged`` (HF names, float32 numpy) in the layout and with the metadata of ``base_gguf``.

    Returns:
        ``(tensor_types, f16_fallback)`` as in :class:`ExportResult`.
    """
    import gguf

    Q = gguf.GGMLQuantizationType
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[gguf_type]
    ftype = gguf.LlamaFileType
    file_type = {"f32": ftype.ALL_F32, "f16": ftype.MOSTLY_F16, "bf16": ftype.MOSTLY_BF16,
                 "q8_0": ftype.MOSTLY_Q8_0, "q4_0": ftype.MOSTLY_Q4_0}[gguf_type]
    reader = gguf.GGUFReader(str(base_gguf))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out_path), arch)
    for key, value in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                              "general.quantization_version"):
            continue
        array = value.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, value.contents(), value.types[0], value.types[-1] if array else None)
    writer.add_file_type(int(file_type))
    if qtype in (Q.Q8_0, Q.Q4_0):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    heads = {"attn_q": reader.fields[f"{arch}.attention.head_count"].contents()}
    heads["attn_k"] = reader.fields.get(f"{arch}.attention.head_count_kv", reader.fields[
        f"{arch}.attention.head_count"]).contents()
    counts, fallback = Counter(), []
    for tensor in reader.tensors:
        name = hf_name(arch, tensor.name)
        if name is None:  # rope_freqs: not a parameter of the model, copied as is
            data, kind = np.asarray(tensor.data, dtype=np.float32), Q.F32
        else:
            w = merged[name]
            part = tensor.name.split(".")[-2]
            if arch == "llama" and part in heads:
                w = permute_qk(w, heads[part])
            elif arch == "gemma3" and tensor.name.endswith("norm.weight"):
                w = w + np.float32(1.0)  # llama.cpp stores gemma norms as 1 + w
            kind = Q.F32 if w.ndim == 1 else qtype
            if kind in (Q.Q8_0, Q.Q4_0) and w.shape[-1] % 32:
                kind = Q.F16
                fallback.append(tensor.name)
            data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
        writer.add_tensor(tensor.name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
        counts[kind.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(counts), fallback
