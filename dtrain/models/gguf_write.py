"""A merged model written as a GGUF file in its base GGUF's own layout (``dtrain export --gguf``).

Every metadata key of the base is copied (tokenizer, chat template, rope and
architecture keys), tensors keep the base's names and order, llama Q/K rows are
permuted back to llama.cpp's interleaved rotary order and gemma3 norm weights
get llama.cpp's +1 again. Tensor types: 1-D tensors (norms, ``rope_freqs``) are
F32 as llama.cpp writes them; matrices take the requested type, and a matrix
whose rows are not a multiple of the 32-value quantization block is written F16.
Written with the ``gguf`` package (llama.cpp's own reader and writer).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import ModelError
from .gguf import hf_name, permute_qk
from .merge import overflow_text
from .vocab_attrs import token_attrs


def write_gguf(base_gguf: Path, merged: dict, gguf_type: str, out_path: Path, meta: dict | None = None,
               report: Callable[[str], None] | None = None) -> tuple:
    """Write ``merged`` (HF names, float32 numpy) in the layout and with the metadata of ``base_gguf``.

    ``meta`` (all optional): ``chat_template`` (replaces ``tokenizer.chat_template``, and the base's named
    templates when it is another one),
    ``eos_token_ids`` (the first not among llama.cpp's end-of-generation tokens becomes
    ``tokenizer.ggml.eot_token_id`` when the file names none; a GGUF holds one, so the others stay
    unknown to llama.cpp, and ``report`` is told so), ``adapter`` (its name, in
    ``general.finetune``), ``updates`` (as :func:`merge.merge_adapter` returns, for the
    quantization error). A base key holding an empty array is left out (gguf's writer cannot write one).
    ``general.name`` stays the base's (or absent): llama.cpp sets token attributes by it (vocab_attrs.py).

    Returns:
        ``(tensor_types, f16_fallback, quant_error, label)``, the first three as in :class:`export.ExportResult`;
        ``label``: ``"<base name> + <adapter>"``, the model's name for people.
    Raises:
        ModelError: an adapted matrix (in ``updates``) that the type writes as inf (:func:`merge.overflow_text`).
    """
    meta = meta or {}
    import gguf

    Q = gguf.GGMLQuantizationType
    qtype = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[gguf_type]
    ftype = gguf.LlamaFileType
    file_type = {"f32": ftype.ALL_F32, "f16": ftype.MOSTLY_F16, "bf16": ftype.MOSTLY_BF16,
                 "q8_0": ftype.MOSTLY_Q8_0, "q4_0": ftype.MOSTLY_Q4_0}[gguf_type]
    reader = gguf.GGUFReader(str(base_gguf))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out_path), arch)
    md = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    base_name = md.get("general.name") or base_gguf.stem
    model_name = f"{base_name} + {meta['adapter']}" if meta.get("adapter") else base_name
    # general.alignment: the writer pads tensor data to it only when set through add_custom_alignment
    replaced = {"general.architecture", "general.file_type", "general.quantization_version", "general.alignment"}
    if meta.get("adapter"):  # the fine-tune's label; llama.cpp reads no general.finetune
        replaced.add("general.finetune")
    if meta.get("chat_template") is not None:
        replaced.add("tokenizer.chat_template")
    if meta.get("chat_template") not in (None, md.get("tokenizer.chat_template")):  # the base's tool_use ... go too
        replaced |= {k for k in md if k == "tokenizer.chat_templates" or k.startswith("tokenizer.chat_template.")}
    replaced |= {k for k in md if k.startswith("general.base_model.")}
    # these weights are quantized here, without an importance matrix: the base's record of one would be untrue
    replaced |= {k for k in md if k.startswith("quantize.imatrix.")}
    for key, value in reader.fields.items():
        if key.startswith("GGUF.") or key in replaced:
            continue
        array = value.types[0] == gguf.GGUFValueType.ARRAY
        if array and not value.data:  # an empty array (llama.cpp writes them): gguf's writer refuses one, holds nothing
            continue
        writer.add_key_value(key, value.contents(), value.types[0], value.types[-1] if array else None)
    if "general.alignment" in md:
        writer.add_custom_alignment(int(md["general.alignment"]))
    if meta.get("adapter"):
        finetune = md.get("general.finetune")
        writer.add_finetune(f"{finetune} + {meta['adapter']}" if finetune else meta["adapter"])
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, base_name)
    if meta.get("chat_template") is not None:
        writer.add_chat_template(meta["chat_template"])
    _, eog = token_attrs(md)
    missing = [i for i in meta.get("eos_token_ids", []) if i not in eog]
    eot = md.get("tokenizer.ggml.eot_token_id")
    if missing and eot is None:
        eot = missing.pop(0)
        writer.add_eot_token_id(eot)
    if missing and report is not None:  # Ollama reads the Modelfile's stops; llama.cpp only the GGUF
        tokens = md.get("tokenizer.ggml.tokens") or []
        text = lambda i: repr(tokens[i]) if 0 <= i < len(tokens) else f"id {i}"  # noqa: E731
        them = "them" if len(missing) > 1 else "it"
        report(f"{out_path.name}: end token{'s' * (len(missing) > 1)} {', '.join(map(text, missing))} not marked: "
               f"a GGUF names one end-of-turn token (tokenizer.ggml.eot_token_id, here {text(int(eot))}), so "
               f"llama.cpp will not stop at {them}; the Modelfile's PARAMETER stop lines stop Ollama there")
    writer.add_file_type(int(file_type))
    if qtype in (Q.Q8_0, Q.Q4_0):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    heads = {"attn_q": reader.fields[f"{arch}.attention.head_count"].contents()}
    heads["attn_k"] = reader.fields.get(f"{arch}.attention.head_count_kv", reader.fields[
        f"{arch}.attention.head_count"]).contents()
    counts, fallback, quant_error, updates = Counter(), [], {}, meta.get("updates", {})
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
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is told below, in one line of ours
                data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
                back = gguf.quants.dequantize(data, kind).reshape(w.shape) if name in updates else None
            if back is not None:  # an adapted matrix: what the type holds of it
                if not np.isfinite(back).all():
                    raise ModelError(overflow_text(tensor.name, w, kind.name))
                if kind in (Q.Q8_0, Q.Q4_0):
                    quant_error[tensor.name] = (float(np.linalg.norm(back - w)), updates[name])
        writer.add_tensor(tensor.name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
        counts[kind.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(counts), fallback, quant_error, model_name
