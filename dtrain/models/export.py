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
``mlx_lm.fuse`` does. ``general.name`` is ``"<base name> + <adapter>"`` with the
base in ``general.base_model.0.name``. Beside the GGUF an Ollama ``Modelfile``
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
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import TOO_DEEP, ConfigError, DataError, ModelError
from ..lora import checked_adapter_value
from ..files import home_path, home_text, storage
from .convert import check_new_folder, save_mlx_lm, with_bos, write_folder
from .demo import demo_model_path
from .gguf import hf_name, permute_qk
from .load import DTYPES, LoadedModel, is_hub_id, load_model
from .modelfile import chat_parts, modelfile, trims_content
from .vocab_attrs import token_attrs

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
QUANT_WARN_RATIO = 4.0  # warn when the rounding error of the adapted matrices is over 4x their update (docs/llama-cpp.md)
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")


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
        """``sqrt(sum ‖Q(W+ΔW) − (W+ΔW)‖²) / sqrt(sum ‖ΔW‖²)`` over the adapted matrices (None: not quantized)."""
        if not self.quant_error:
            return None
        err, upd = (float(np.sqrt(sum(v[i] ** 2 for v in self.quant_error.values()))) for i in (0, 1))
        return err / upd if upd > 0 else float("inf")

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


# base_model's keys: (key, label, what the base is)
BASE_IDENTITIES = (("sha256", "sha256", "file"), ("fingerprint", "content fingerprint", "folder"))


def check_base(adapter_dir: str, base: str, loaded: LoadedModel,
               report: Callable[[str], None] | None = None) -> None:
    """Refuse a base other than the one the adapter was trained on.

    ``adapter_config.json``'s ``base_model`` (written by dtrain's trainer from
    ``LoadedModel.reference``) holds the training base's sha256 when it was a GGUF
    file, its content fingerprint (``folder_fingerprint``) when it was a model
    folder; a base whose value differs is another model, even with the same shapes.
    Nothing is compared when either side lacks the key (a hub id, a GGUF against a
    folder, an adapter from another tool or from dtrain before folder fingerprints);
    ``report`` is told so when the adapter recorded one (a merged export given as the base
    would get the adapter twice).

    Raises:
        ModelError: the two sha256 or fingerprints differ (names both), or ``base_model`` is not an object
            with text in these keys (the check would be skipped unsaid).
    """
    config = Path(adapter_dir) / "adapter_config.json"
    recorded = json.loads(config.read_text()).get("base_model", {})
    odd = ("base_model", recorded) if not isinstance(recorded, dict) else next(
        ((f"base_model.{key}", recorded[key]) for key, _, _ in BASE_IDENTITIES
         if key in recorded and not isinstance(recorded[key], str)), None)
    if odd is not None:
        raise ModelError(f"{config}: {odd[0]} is {json.dumps(odd[1])[:60]}, not "
                         f"{'an object' if odd[0] == 'base_model' else 'text'} (dtrain records the training base's "
                         "path and its sha256 or content fingerprint there); correct or remove it, or pass "
                         "--allow-base-mismatch to merge without the check")
    for key, label, kind in BASE_IDENTITIES:
        want, got = recorded.get(key), loaded.reference.get(key)
        if want is not None and got is not None and want != got:
            raise ModelError(f"{config}: the adapter was trained on {recorded.get('path', '?')} ({label} "
                             f"{want[:16]}...), but --base {base} is another {kind} ({label} {got[:16]}...); export "
                             "onto the base it was trained on, or pass --allow-base-mismatch to merge it anyway")
    recorded_by = [(key, label) for key, label, _ in BASE_IDENTITIES if key in recorded]
    if report is not None and recorded_by and all(loaded.reference.get(key) is None for key, _ in recorded_by):
        report(f"{config}: the adapter was trained on {recorded.get('path', '?')} (recorded by its "
               f"{recorded_by[0][1]}); --base {base} cannot be compared with it: make sure it is that model (not an "
               "export that already holds the adapter)")


def check_adapter_config(path: Path) -> None:
    """Refuse an ``adapter_config.json`` that mlx-lm's ``load_adapters`` would misread as an adapter that does not
    fit the base: not a JSON object, ``num_layers`` / ``lora_parameters`` ``rank``, ``scale`` and ``dropout`` of another
    type, ``lora_parameters.keys`` that is not a list of module names, or ``lora_parameters`` without ``rank``,
    ``scale`` or ``dropout``.

    Raises:
        ModelError: naming the file and the key.
    """
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ModelError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise ModelError(f"{path}: not valid JSON ({TOO_DEEP})") from None
    if not isinstance(meta, dict):
        raise ModelError(f"{path}: not a JSON object")
    params = meta.get("lora_parameters", {})
    values = [("num_layers", meta.get("num_layers", 0), int, "an integer"),
              ("lora_parameters", params, dict, "an object")]
    if isinstance(params, dict):
        values += [("lora_parameters.rank", params.get("rank", 0), int, "an integer"),
                   ("lora_parameters.scale", params.get("scale", 0.0), (int, float), "a number"),
                   ("lora_parameters.dropout", params.get("dropout", 0.0), (int, float), "a number")]
    for key, value, kind, what in values:
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ModelError(f"{path}: {key} is {json.dumps(value)}, not {what}")
    keys = params.get("keys")  # mlx-lm asks `name in keys`: a string would match its substrings
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ModelError(f"{path}: lora_parameters.keys is {json.dumps(keys)}, not a list of module names")
    missing = [k for k in ("rank", "scale", "dropout") if "lora_parameters" in meta and k not in params]
    if missing:
        hint = " (PEFT's alpha / rank is mlx-lm's scale)" if "scale" in missing and "alpha" in params else ""
        raise ModelError(f"{path}: lora_parameters has no {', '.join(missing)}, which mlx-lm's LoRA layers "
                         f"take{hint}")
    try:  # the bounds train.init_adapter reads them with
        for key, value in (("num_layers", meta.get("num_layers")), ("rank", params.get("rank")),
                           ("scale", params.get("scale"))):
            if value is not None:
                checked_adapter_value(key, value, f"{path}:")
    except ConfigError as err:
        raise ModelError(str(err)) from None


def merge_adapter(adapter_dir: str, base: str, allow_base_mismatch: bool = False,
                  report: Callable[[str], None] | None = None) -> tuple[LoadedModel, dict]:
    """Load ``base`` in float32 and fuse the mlx-lm adapter in ``adapter_dir`` into it
    (a base other than the recorded one only with ``allow_base_mismatch``: :func:`check_base`).

    Returns:
        ``(loaded, updates)``: the loaded base whose LoRA layers are replaced by
        fused ``nn.Linear``, and per fused weight name ``‖ΔW‖`` (Frobenius), ΔW the
        fused weight less the base's (``scale * lora_b.T @ lora_a.T`` as in mlx-lm's
        ``LoRALinear.fuse``; a DoRA adapter's magnitude rescaling included).

    Raises:
        ModelError: missing adapter files, an adapter whose layers or shapes
            do not fit the base (names the adapter and the base), or another base.
    """
    from mlx_lm.tuner.utils import load_adapters

    folder = Path(adapter_dir)
    if not folder.is_dir():  # a mistyped path: say so, not which files it lacks
        raise ModelError(f"{adapter_dir}: no such adapter folder" + (" (a file)" if folder.exists() else ""))
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelError(f"{adapter_dir}: not an adapter folder (missing {', '.join(missing)})")
    check_adapter_config(folder / "adapter_config.json")
    loaded = load_model(base, dtype="float32")
    try:
        with storage(f"read the adapter {adapter_dir}"):
            load_adapters(loaded.model, str(folder))
    except AttributeError as err:  # load_adapters reads num_layers and lora_parameters as attributes
        raise ModelError(f"{folder / 'adapter_config.json'}: no '{err.name}' (an mlx-lm LoRA adapter config has "
                         "fine_tune_type, num_layers and lora_parameters)") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
        detail = " ".join(str(err).split())[:400]
        raise ModelError(f"{adapter_dir}: this adapter does not fit the base model {base}: {detail}") from None
    if not allow_base_mismatch:
        check_base(adapter_dir, base, loaded, report)
    lora = [(name, module) for name, module in loaded.model.named_modules() if hasattr(module, "fuse")]
    # load_adapters loads non-strictly: a LoRA tensor the file lacks would keep its random
    # initialisation (lora_a) or zero (lora_b) and be fused as if it were trained
    expected = {k for k, _ in tree_flatten(loaded.model.parameters())
                if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "m")}  # mlx-lm's adapter leaves (DoRA: m)
    missing = sorted(expected - set(mx.load(str(folder / "adapters.safetensors"))))
    if missing:
        raise ModelError(f"{folder / 'adapters.safetensors'} lacks {len(missing)} of the {len(expected)} LoRA tensors "
                         f"its adapter_config.json sets up on {base} ({', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}); the adapter is incomplete or its config is not "
                         "the one it was trained with")
    fused = [(name, module.fuse()) for name, module in lora]
    # what the merge changes: scale * B^T A^T for LoRA, DoRA's magnitude rescaling included
    base_weight = lambda m: (m.linear if hasattr(m, "linear") else m.embedding).weight  # noqa: E731
    updates = {f"{name}.weight": float(mx.linalg.norm((new.weight - base_weight(module)).astype(mx.float32)))
               for (name, module), (_, new) in zip(lora, fused)}
    loaded.model.update_modules(tree_unflatten(fused))
    mx.eval(loaded.model.parameters())
    return loaded, updates


def training_template(adapter_dir: str, tokenizer=None) -> str | None:
    """The chat template an adapter was trained with when it replaced the base's (None: the base's own).

    ``adapter_config.json``'s ``chat_template`` (written by dtrain's trainer), else
    ``data.chat_template`` of the ``config.yaml`` in the same folder (checkpoints).
    With ``tokenizer``, the template is compiled as training compiled it (a hand-edited one may not).

    Raises:
        ModelError: a recorded ``chat_template`` that is not text or not valid Jinja, or a recorded
            ``data.chat_template`` that is no longer readable.
    """
    from ..data.formats import json_kind
    from ..data.templates import make_renderer, template_source

    folder = Path(adapter_dir)
    where = f"{folder / 'adapter_config.json'}: chat_template"
    text = json.loads((folder / "adapter_config.json").read_text()).get("chat_template")
    if text is not None and not isinstance(text, str):
        raise ModelError(f"{where}: a JSON {json_kind(text)}, not a Jinja template's text")
    config = folder / "config.yaml"
    name = _run_chat_template(config) if text is None and config.is_file() else None
    if name is not None:
        try:
            text = template_source(name)
        except DataError as err:
            raise ModelError(f"{config}: the run's {err}") from None
        where = f"{config}: the run's data.chat_template {name}"
    if text is not None and tokenizer is not None:
        try:
            make_renderer(tokenizer, text, where)
        except DataError as err:  # a Jinja syntax error, with its line
            raise ModelError(str(err)) from None
    return text


def _run_chat_template(config: Path) -> str | None:
    """``data.chat_template`` of a checkpoint's ``config.yaml`` (None: unset); read by hand, not as a config,
    so that a key an older dtrain wrote does not stop the export.

    Raises:
        ModelError: the file is not YAML, not a config's sections, or the key is not text.
    """
    import yaml

    try:
        raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise ModelError(f"{config}:{f' line {mark.line + 1}' if mark else ''} invalid YAML: "
                         f"{getattr(err, 'problem', err)}") from None
    except ValueError as err:  # not UTF-8, a scalar Python cannot build
        raise ModelError(f"{config}: invalid YAML: {err}") from None
    data = (raw.get("data") or {}) if isinstance(raw, dict) else None
    if not isinstance(data, dict):
        what = "not a mapping of config sections" if data is None else f"section 'data' is {data!r}, not a mapping"
        raise ModelError(f"{config}: data.chat_template unreadable: {what}")
    name = data.get("chat_template")
    if name is not None and not isinstance(name, str):
        raise ModelError(f"{config}: data.chat_template is {name!r}, not a template name or Jinja file")
    return name


def adapter_label(adapter_dir: str) -> str:
    """How ``general.name`` names the adapter: its folder, with the run folder for the run's own
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
            model folder the adapter recorded (:func:`check_base`).
        report: told of a base that cannot be compared with the recorded one (:func:`check_base`), of end
            tokens the GGUF cannot mark (:func:`write_gguf`) and of each Modelfile value Ollama could not
            read back (left out), or None.

    Raises:
        ModelError: a bad adapter folder, a base that does not fit or is not the
            recorded one, a non-empty ``out_dir``, an unknown type, or ``gguf_type``
            with a non-GGUF or missing base.
        UserError: a path opening ``~user`` of no user here.
    """
    # ~ as base reads it (the shell expands none in --out=~/x)
    adapter_dir, out_dir = home_text(adapter_dir, "adapter folder"), home_text(out_dir, "--out")
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
    drop_open = parts is not None and adds_bos and parts.open == bos
    stops = [hf.convert_ids_to_tokens(i) for i in eos_ids]
    return modelfile(gguf_name, parts, drop_open, [s for s in stops if s], model_name, report, template is not None,
                     trims)


def write_gguf(base_gguf: Path, merged: dict, gguf_type: str, out_path: Path, meta: dict | None = None,
               report: Callable[[str], None] | None = None) -> tuple:
    """Write ``merged`` (HF names, float32 numpy) in the layout and with the metadata of ``base_gguf``.

    ``meta`` (all optional): ``chat_template`` (replaces ``tokenizer.chat_template``, and the base's named
    templates when it is another one),
    ``eos_token_ids`` (the first not among llama.cpp's end-of-generation tokens becomes
    ``tokenizer.ggml.eot_token_id`` when the file names none; a GGUF holds one, so the others stay
    unknown to llama.cpp, and ``report`` is told so), ``adapter`` (its name in
    ``general.name``), ``updates`` (as :func:`merge_adapter` returns, for the
    quantization error). A base key holding an empty array is left out (gguf's writer cannot write one).

    Returns:
        ``(tensor_types, f16_fallback, quant_error, general_name)``, the first three as in :class:`ExportResult`.
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
    replaced = {"general.architecture", "general.file_type", "general.quantization_version", "general.name",
                "general.alignment"}
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
    writer.add_name(model_name)
    if meta.get("adapter"):
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
            data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
            if kind in (Q.Q8_0, Q.Q4_0) and name in updates:
                err = np.linalg.norm(gguf.quants.dequantize(data, kind).reshape(w.shape) - w)
                quant_error[tensor.name] = (float(err), updates[name])
        writer.add_tensor(tensor.name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
        counts[kind.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(counts), fallback, quant_error, model_name
