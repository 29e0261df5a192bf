"""``dtrain export ADAPTER_DIR --base MODEL --out OUT [--gguf TYPE]``: the base with the adapter merged.

The adapter is fused into the base as ``mlx_lm.fuse`` does (merge.py). The merged
model is written as an mlx-lm folder and, with ``--gguf``, as a GGUF file in the
base GGUF's own layout (gguf_write.py).

Exports carry what training used. The chat template is the one recorded in
``adapter_config.json`` (``chat_template``: the text of the template the
training prompts were rendered with where it was not the base's own,
``templates.trained_template``; older adapters: ``data.chat_template`` of the
``config.yaml`` beside them), else the base's own: it is the GGUF's
``tokenizer.chat_template`` and the folder's ``chat_template.jinja`` (there with
BOS in front where the tokenizer adds it and the template writes none:
``convert.with_bos``). The end
tokens are the base's EOS ids plus the template's end-of-turn token
(``eos_token_id`` in ``config.json`` and ``generation_config.json``; in the GGUF,
``tokenizer.ggml.eot_token_id`` when llama.cpp would not stop at it by its
text). A folder or hub base's own ``generation_config.json`` (sampling defaults)
is kept with those end tokens, and its ``*.py`` files are copied, as
``mlx_lm.fuse`` does. ``general.name`` stays the base's (llama.cpp sets token
attributes by it: vocab_attrs.py); the adapter is ``general.finetune`` (after
the base's own label: ``"<label> + <adapter>"``) and the base
``general.base_model.0.name``. Beside the GGUF an Ollama ``Modelfile``
(modelfile.py) holds ``FROM``, the template as ``TEMPLATE`` and one
``PARAMETER stop`` per end token.

Block-quantized types (q8_0, q4_0) round every weight; per adapted matrix we
measure ``‖Q(W + ΔW) − (W + ΔW)‖ / ‖ΔW‖``, the rounding error against the
adapter's update ``ΔW``. When the error of all adapted matrices together is
more than :data:`QUANT_WARN_RATIO` times the update (q4_0 on the demo adapter),
the export warns with the ratio rather than refusing: the file is valid and
runs, and a norm ratio is a bound, not a verdict (rounding noise spread over
every direction does not cancel a low-rank update everywhere; q8_0 at about 1x
keeps llama.cpp's top-1 tokens nearly all equal to the merged model's, docs/llama-cpp.md);
the user decides, and a wider type is the remedy named in the warning.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import DataError, ModelError
from ..files import home_path, home_text
from .convert import check_new_folder, save_mlx_lm, with_bos, write_folder
from .demo import demo_model_path
from .gguf_write import write_gguf
from .load import DTYPES, LoadedModel, is_hub_id
from .merge import merge_adapter, overflow_text, training_template
from .modelfile import chat_parts, modelfile, trims_content

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
QUANT_WARN_RATIO = 4.0  # warn when the rounding error of the adapted matrices is over 4x their update (docs/llama-cpp.md)


@dataclass
class ExportResult:
    """What :func:`export_adapter` wrote.

    ``folder``: the mlx-lm model folder. ``gguf``: the GGUF file inside it, or
    None. ``tensor_types``: GGML type name → number of tensors of that type in
    the GGUF. ``f16_fallback``: tensors written F16 instead of the requested
    block type because their rows are not a multiple of 32. ``chat_template``:
    the template the exports carry; ``eos_token_ids``: their end tokens.
    ``modelfile``: the Ollama Modelfile beside the GGUF. ``quant_error``: GGUF
    tensor name → ``(‖Q(W+ΔW) − (W+ΔW)‖, ‖ΔW‖)`` (Frobenius norms) for each
    adapted matrix of a q8_0/q4_0 export.
    """

    folder: Path
    gguf: Path | None = None
    tensor_types: dict = field(default_factory=dict)
    f16_fallback: list = field(default_factory=list)
    chat_template: str | None = None
    eos_token_ids: list = field(default_factory=list)
    modelfile: Path | None = None
    quant_error: dict = field(default_factory=dict)

    def quant_ratio(self) -> float | None:
        """``sqrt(sum ‖Q(W+ΔW) − (W+ΔW)‖²) / sqrt(sum ‖ΔW‖²)`` over the adapted matrices (None: not quantized, or
        the adapter changes no weight: no fine-tune to lose)."""
        if not self.quant_error:
            return None
        err, upd = (float(np.sqrt(sum(v[i] ** 2 for v in self.quant_error.values()))) for i in (0, 1))
        return err / upd if upd > 0 else None

    def quant_warning(self) -> str | None:
        """The warning when the rounding error exceeds the update (:data:`QUANT_WARN_RATIO`), else None."""
        ratio = self.quant_ratio()
        if ratio is None or ratio <= QUANT_WARN_RATIO:
            return None
        over = sum(e > u for e, u in self.quant_error.values())
        kind = self.gguf.stem.rsplit("-", 1)[-1] if self.gguf else "quantized"
        return (f"{kind} rounding moves the adapted weights {ratio:.1f}x as far as the adapter's update does "
                f"(‖Q(W+ΔW) − (W+ΔW)‖ / ‖ΔW‖ over {len(self.quant_error)} adapted matrices, {over} of them above 1x): "
                "the quantized model may have lost much of the fine-tune; compare its output with the mlx-lm "
                f"folder's, or export a wider type ({'f16' if kind.lower() == 'q8_0' else 'q8_0, f16'})")


def adapter_label(adapter_dir: str) -> str:
    """How ``general.finetune`` names the adapter: its folder, with the run folder for the run's own
    ``adapters`` / ``adapters-last`` (``train.keep_best``) / ``step-N``."""
    folder = Path(adapter_dir).resolve()
    if folder.name in ("adapters", "adapters-last") or folder.name.startswith("step-"):
        run = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
        return f"{run.name}/{folder.name}"
    return folder.name


def end_tokens(loaded: LoadedModel, template: str | None) -> list:
    """The base's EOS ids plus the end-of-turn id of ``template`` (None: the tokenizer's own), sorted."""
    from ..data.templates import end_of_turn, has_chat_template, make_renderer

    ids = set(loaded.tokenizer.eos_token_ids)
    eos = loaded.config.get("eos_token_id")
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if template is not None or has_chat_template(loaded.tokenizer):
        try:
            ids |= set(end_of_turn(loaded.tokenizer, make_renderer(loaded.tokenizer, template, "export"))[1])
        except DataError:  # no end-of-turn token and no EOS: nothing to add
            pass
    return sorted(int(i) for i in ids if i is not None)


def base_folder(base: str) -> Path | None:
    """The folder of an mlx-lm/HF base: ``base`` itself, or a hub id's snapshot in the local cache (None: not found)."""
    if Path(base).expanduser().is_dir():
        return Path(base).expanduser()
    try:
        from mlx_lm.utils import hf_repo_to_path

        return hf_repo_to_path(base)
    except Exception:  # not in the cache, or not a hub id: nothing to carry over
        return None


def base_generation_config(folder: Path | None) -> dict:
    """The base folder's ``generation_config.json`` (sampling defaults ...), or {} when it has none or it is not
    a JSON object (mlx-lm ignores such a file too)."""
    path = folder / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def export_adapter(adapter_dir: str, base: str, out_dir: str, gguf_type: str | None = None,
                   dtype: str = "bfloat16", allow_base_mismatch: bool = False,
                   report: Callable[[str], None] | None = None) -> ExportResult:
    """Write ``base`` with the adapter merged: an mlx-lm folder, and a GGUF file when asked.

    Args:
        adapter_dir: mlx-lm adapter folder (``adapters.safetensors``, ``adapter_config.json``).
        base: the model the adapter was trained on: ``demo``, a ``.gguf`` file, an
            mlx-lm/HF folder or a hub id.
        out_dir: new (or empty) folder; written atomically.
        gguf_type: one of :data:`GGUF_TYPES` to also write ``OUT/model-<TYPE>.gguf``
            (needs a GGUF base, whose layout and metadata are copied).
        dtype: float type of the mlx-lm folder's weights (float32, bfloat16, float16).
        allow_base_mismatch: merge onto ``base`` even when it is not the GGUF file or
            model folder the adapter recorded (:func:`merge.check_base`).
        report: told of a base that cannot be compared with the recorded one (:func:`merge.check_base`), of an
            adapter that changes no weight, of end tokens the GGUF cannot mark (:func:`gguf_write.write_gguf`) and
            of each Modelfile value Ollama could not read back (left out), or None.

    Raises:
        ModelError: a bad adapter folder, a base that does not fit or is not the
            recorded one, a non-empty ``out_dir``, an unknown type, ``gguf_type``
            with a non-GGUF or missing base, or adapted weights that ``dtype`` or
            ``gguf_type`` would write as inf (:func:`merge.overflow_text`).
        UserError: a path opening ``~user`` of no user here.
    """
    # ~ as base reads it (the shell expands none in --out=~/x)
    adapter_dir, out_dir = home_text(adapter_dir, "adapter folder"), home_text(out_dir, "--out")
    if not adapter_dir:  # else the working folder: ': not an adapter folder'
        raise ModelError("the adapter folder path is empty text; give an adapter folder (a run's OUTPUT_DIR/adapters)")
    if gguf_type is not None and gguf_type.lower() not in GGUF_TYPES:
        raise ModelError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
    if dtype not in DTYPES:
        raise ModelError(f"export dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    check_new_folder(out_dir)
    base_gguf = None
    if gguf_type is not None:
        base_gguf = demo_model_path() if base == "demo" else home_path(base, "--base")
        if not base_gguf.exists() and not is_hub_id(base):  # a mistyped path: say so, not what a GGUF is for
            raise ModelError(f"no such GGUF file: {base}")
        if not base_gguf.is_file():
            raise ModelError(f"--gguf needs a GGUF base model (its layout and metadata are copied); {base} is not "
                             "a GGUF file. For an mlx-lm base, `mlx_lm.fuse --export-gguf` writes F16 llama GGUFs")
    loaded, updates = merge_adapter(adapter_dir, base, allow_base_mismatch, report)  # checks the adapter folder first
    if report is not None and updates and not any(updates.values()):  # lora_b all zero: nothing was learned
        report(f"{adapter_dir}: the adapter changes no weight (the LoRA updates of its {len(updates)} adapted matrices "
               "are all zero, as training starts them): the export is the base model")
    trained_with = training_template(adapter_dir, loaded.tokenizer)
    merged = {name: np.array(value) for name, value in tree_flatten(loaded.model.parameters())}
    hf = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)
    own = hf.chat_template  # a dict for a base with named templates (transformers renders its "default")
    named = isinstance(own, dict) and trained_with is None
    template = trained_with or (own.get("default") if isinstance(own, dict) else own)
    config = dict(loaded.config)
    config["eos_token_id"] = end_tokens(loaded, trained_with)
    # the folder's; the GGUF and Modelfile keep ``template``
    hf.chat_template = with_bos(loaded.tokenizer, own if named else template)
    loaded.model.set_dtype(DTYPES[dtype])
    params = dict(tree_flatten(loaded.model.parameters()))
    for name in updates:  # float16 writes what it cannot hold as inf
        if not mx.isfinite(params[name]).all().item():
            raise ModelError(overflow_text(name, merged[name], dtype))
    result = ExportResult(folder=Path(out_dir), chat_template=template, eos_token_ids=config["eos_token_id"])
    source = None if base == "demo" or Path(base).expanduser().is_file() else base_folder(base)  # folder, hub id

    def fill(tmp: Path) -> None:
        save_mlx_lm(tmp, loaded.model, config, loaded.tokenizer)
        generation = {**base_generation_config(source), "eos_token_id": config["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        for code in sorted(source.glob("*.py")) if source is not None else ():  # remote code, as mlx_lm.fuse copies
            shutil.copyfile(code, tmp / code.name)
        if isinstance(hf.chat_template, str):  # named templates: save_pretrained writes each one
            (tmp / "chat_template.jinja").write_text(hf.chat_template, encoding="utf-8")
        if base_gguf is not None:
            name = f"model-{gguf_type.upper()}.gguf"
            meta = {"chat_template": template, "eos_token_ids": config["eos_token_id"],
                    "adapter": adapter_label(adapter_dir), "updates": updates}
            result.tensor_types, result.f16_fallback, result.quant_error, model_name = write_gguf(
                base_gguf, merged, gguf_type.lower(), tmp / name, meta, report)
            result.gguf = Path(out_dir) / name
            result.modelfile = Path(out_dir) / "Modelfile"
            (tmp / "Modelfile").write_text(ollama_modelfile(loaded.tokenizer, template, name, config["eos_token_id"],
                                                            model_name, report), encoding="utf-8")

    write_folder(out_dir, fill)
    return result


def ollama_modelfile(tokenizer, template: str | None, gguf_name: str, eos_ids: list, model_name: str,
                     report: Callable[[str], None] | None = None) -> str:
    """The Modelfile for ``gguf_name``: ``TEMPLATE`` read off ``template`` (modelfile.py), stops = ``eos_ids``'s texts.

    The opening BOS text is left out of ``TEMPLATE`` when the GGUF tokenizer adds BOS itself.
    """
    from ..data.templates import Renderer

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    parts, trims = None, False
    if template is not None:
        renderer = Renderer(hf, template, name="export")
        render = lambda msgs, gen: renderer.render(msgs, add_generation_prompt=gen)  # noqa: E731
        parts, trims = chat_parts(render), trims_content(render)
    bos = hf.bos_token
    adds_bos = bool(bos) and hf("x")["input_ids"][:1] == [hf.convert_tokens_to_ids(bos)]
    if parts is not None and adds_bos and not parts.open and parts.default_system is not None \
            and parts.before["system"].startswith(bos):
        # every prompt opens with the system header then, so its BOS is the opening text the tokenizer adds
        parts = replace(parts, open=bos, before={**parts.before, "system": parts.before["system"][len(bos):]})
    if parts is not None and adds_bos and parts.open.startswith(bos):
        # the tokenizer adds the BOS the template opens with (training kept one, data/render.py): a "<s>" in the
        # TEMPLATE would be a second; any opening text after it stays
        parts = replace(parts, open=parts.open[len(bos):])
    stops = [hf.convert_ids_to_tokens(i) for i in eos_ids]
    return modelfile(gguf_name, parts, [s for s in stops if s], model_name, report, template is not None,
                     trims)
