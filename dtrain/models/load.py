"""One entry point for every model source: ``load_model(path, dtype)``.

Sources: ``demo`` (the SmolLM2 GGUF, see demo.py), a ``.gguf`` file (gguf.py,
tokenizer.py), an mlx-lm/Hugging Face folder or a hub id (``mlx_lm.utils.load``).
Model definitions always come from mlx-lm.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..device import on_gpu
from ..errors import TOO_DEEP, ModelError
from ..files import HUB_ID, lfs_pointer_problem, sha256_file
from . import DTYPE_NAMES
from .demo import demo_model_path
from .gguf import GROUP_SIZE, GGUFModel, gguf_to_mlx
from .tokenizer import build_tokenizer, eos_token_ids

MODEL_FILE_SUFFIXES = (".gguf", ".ggml", ".safetensors", ".bin", ".json", ".pt", ".pth")
DTYPES = {name: getattr(mx, name) for name in DTYPE_NAMES}  # model.dtype's values (besides auto) -> MLX dtypes


@dataclass
class LoadedModel:
    """A model ready for training or generation.

    ``model``: mlx-lm ``nn.Module`` (e.g. ``mlx_lm.models.llama.Model``); called
    on token ids ``(B, T)`` it returns logits ``(B, T, vocab_size)``.
    ``tokenizer``: ``mlx_lm.tokenizer_utils.TokenizerWrapper``.
    ``config``: the mlx-lm config dict (``model_type``, ``hidden_size``, ...).
    ``identity``: short string that changes when the weights change, not when
    they move (GGUF: ``gguf-sha256:<hex>``; folder, or a hub id's download in the hub
    cache: ``mlx-lm-folder:<hex>`` of :func:`folder_fingerprint`).
    ``source``: human-readable description.
    ``reference``: where the weights are, for an adapter's ``base_model``:
    ``{"path", "sha256"}`` of a GGUF file (absolute; the demo's cached file
    too), ``{"path", "fingerprint"}`` of a model folder (:func:`folder_fingerprint`),
    or ``{"hub_id"}``; ``dtrain export`` compares the sha256 or fingerprint.
    ``aliases``: identities checkpoints of earlier dtrain versions recorded for the
    same model (a folder: ``mlx-lm:<resolved path>:<hash of the config>``, before
    2026-12-04; a hub id: ``mlx-lm:<id>:<hash of the config>``, before 2026-12-07), which a
    resume accepts as this one.
    """

    model: nn.Module
    tokenizer: Any
    config: dict
    identity: str
    source: str
    reference: dict = field(default_factory=dict)
    aliases: tuple = ()


def dtype_plan(dtype: str) -> tuple[bool, mx.Dtype]:
    """``(keep_quantized, float_dtype)`` for a ``model.dtype`` value.

    ``auto``: GPU → keep quantized weights, bfloat16 elsewhere; CPU → dequantize,
    float32 (MLX's CPU quantized matmul is far slower than float32; docs/benchmarks.md).
    ``float32`` always dequantizes. ``bfloat16``/``float16`` keep quantized
    weights on a GPU and dequantize on the CPU.

    Raises:
        ModelError: an unknown dtype.
    """
    if dtype == "auto":
        return (True, mx.bfloat16) if on_gpu() else (False, mx.float32)
    if dtype not in DTYPES:
        raise ModelError(f"model dtype {dtype!r} must be one of auto, {', '.join(DTYPES)}")
    return dtype != "float32" and on_gpu(), DTYPES[dtype]


def load_model(path: str = "demo", dtype: str = "auto") -> LoadedModel:
    """Load a model and its tokenizer from ``path``.

    Args:
        path: ``demo``, a ``.gguf`` file (llama or gemma3 architecture), an
            mlx-lm/HF model folder with ``config.json``, or a hub id ``org/name``.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``; see
            :func:`dtype_plan` for when quantized weights are kept.

    Raises:
        ModelError: one sentence naming ``path``: missing path, a folder without
            config.json, an unreadable or unsupported GGUF file, a failed download.
    """
    keep_quantized, float_dtype = dtype_plan(dtype)
    if not path:  # else the working folder: ': folder has no config.json'
        raise ModelError("the model path is empty text; give demo, a .gguf file, a model folder or a hub id")
    if path == "demo":
        return _load_gguf(demo_model_path(), keep_quantized, float_dtype, source="demo (SmolLM2-135M-Instruct Q4_1)")
    try:
        p = Path(path).expanduser()
    except RuntimeError:  # ~user of no user here
        raise ModelError(f"{path}: no such file or directory: no home folder for {path.split('/')[0]}") from None
    if p.is_file():
        if p.suffix.lower() != ".gguf" and (p.parent / "config.json").is_file() and not _gguf_magic(p):
            raise ModelError(f"{path}: a file of the model folder {p.parent}, not a GGUF file; set model.path to "
                             "the folder")
        return _load_gguf(p, keep_quantized, float_dtype, source=f"GGUF file {p}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{path}: folder has no config.json, so it is not an mlx-lm/Hugging Face model "
                             f"folder{gguf_files_hint(p) or _adapter_hint(p)}")
        if "model_type" not in read_json_object(p / "config.json"):  # else mlx-lm's bare KeyError: 'model_type'
            raise ModelError(f"{p / 'config.json'}: no model_type, the key mlx-lm picks the architecture by")
        if (p / "tokenizer_config.json").is_file():
            read_json_object(p / "tokenizer_config.json")
        return _load_mlx_lm(str(p), keep_quantized, float_dtype)
    if p.exists():  # a pipe, a socket or a device
        raise ModelError(f"{path}: not a regular file (a pipe, a socket or a device); expected demo, a .gguf file, a "
                         f"model folder or a hub id")
    if is_hub_id(path):
        return _load_mlx_lm(path, keep_quantized, float_dtype)
    raise ModelError(f"{path}: no such file or directory (expected demo, a .gguf file, a model folder or a hub id)")


def gguf_files_hint(folder: Path) -> str:
    """``'; it holds the GGUF file a.gguf: give that file'`` (several: the first three, ``give one of them``) for a
    folder holding ``*.gguf`` files (a GGUF repository's download), else ``''``."""
    names = sorted(f.name for f in folder.glob("*.gguf") if f.is_file())
    if not names:
        return ""
    if len(names) == 1:
        return f"; it holds the GGUF file {names[0]}: give that file"
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"; it holds the GGUF files {shown}: give one of them"


def _adapter_hint(folder: Path) -> str:
    """``'; it holds an mlx-lm adapter, not a model: ...'`` for an adapter folder or a run's output folder given as a
    model, else ``''``."""
    from ..files import OutputDir
    from ..lora import ADAPTER_WEIGHTS

    if (folder / ADAPTER_WEIGHTS).is_file():
        return "; it holds an mlx-lm adapter, not a model: give the model the adapter was trained on"
    if (OutputDir(folder).adapters / ADAPTER_WEIGHTS).is_file():
        return (f"; it is a run's output folder, not a model: give the model the run trained (its adapter is "
                f"{OutputDir(folder).adapters})")
    return ""


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path`` (a model folder's config.json, an adapter_config.json): mlx-lm's and
    transformers' JSONDecodeError, 'Expecting value: line 1 column 1 (char 0)', names no file.

    Raises:
        ModelError: not valid JSON (naming the file, with the error's line and column) or not an object.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ModelError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise ModelError(f"{path}: not valid JSON ({TOO_DEEP})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: not a JSON object")
    return value


def is_hub_id(path: str) -> bool:
    """``path`` (naming nothing here) reads as a hub model id ``owner/name``: not ``./`` or ``../``, ``/``, ``~``,
    and no model file suffix (``.gguf``, ``.safetensors`` ..., any case), which marks a missing file."""
    return (bool(HUB_ID.fullmatch(path)) and not path.startswith(".")
            and Path(path).suffix.lower() not in MODEL_FILE_SUFFIXES)


def _gguf_magic(path: Path) -> bool:
    """``path`` opens with GGUF's magic (or cannot be read: gguf.py's reader then says why)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return True


def _load_gguf(path: Path, keep_quantized: bool, float_dtype, source: str) -> LoadedModel:
    gm = gguf_to_mlx(path)
    try:
        hf = build_tokenizer(gm.metadata)
    except (ValueError, KeyError) as err:
        raise ModelError(f"{path}: cannot build the tokenizer from GGUF metadata: {err}") from None
    hf.name_or_path = str(path)  # where its chat template came from (templates.model_template_name)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(hf, eos_token_ids=eos_token_ids(gm.metadata))
    try:
        model, config = build_gguf_model(gm, keep_quantized, float_dtype)
    except ModelError as err:
        raise ModelError(f"{path}: {err}") from None
    sha = sha256_file(path)
    return LoadedModel(model, tokenizer, config, f"gguf-sha256:{sha}", source,
                       reference={"path": str(Path(path).resolve()), "sha256": sha})


def build_gguf_model(gm: GGUFModel, keep_quantized: bool, float_dtype) -> tuple[nn.Module, dict]:
    """The mlx-lm model for a translated GGUF file, and its config.

    Quantized triplets become ``nn.QuantizedLinear``/``QuantizedEmbedding`` with
    their own bits when ``keep_quantized`` (config then gets mlx-lm's per-module
    ``quantization`` entry), else they are dequantized in float32. Other float
    parameters are cast to ``float_dtype`` (``None`` keeps the GGUF's dtypes).

    Raises:
        ModelError: a tensor missing, unexpected or of another shape than the model of ``gm.config`` has.
    """
    config = dict(gm.config)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = model.sanitize(dict(gm.weights))
    if keep_quantized and gm.quantization:
        nn.quantize(model, class_predicate=lambda p, m: gm.quantization.get(p, False))
        # mlx-lm's config: defaults (the most common bits) plus one entry per module.
        bits = [q["bits"] for q in gm.quantization.values()]
        default = {"group_size": GROUP_SIZE, "bits": max(set(bits), key=bits.count)}
        config["quantization"] = {**default, **dict(sorted(gm.quantization.items()))}
    else:
        weights = dequantize_weights(weights, gm.quantization)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:  # MLX names each missing, unexpected or misshapen parameter
        detail = " ".join(str(err).split())[:400]
        raise ModelError(f"its tensors do not fit the {config['model_type']} model its metadata describes: "
                         f"{detail}") from None
    if float_dtype is not None:
        model.set_dtype(float_dtype)  # floating parameters only (set_dtype's default predicate)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def dequantize_weights(weights: dict, quantization: dict) -> dict:
    """Replace each ``{module}.weight/.scales/.biases`` triplet by a float32 ``.weight``.

    Scales and biases are widened to float32 first, so the values equal
    llama.cpp's float32 dequantization (``d * q + m``).
    """
    out = dict(weights)
    for module, q in quantization.items():
        if f"{module}.scales" not in out:
            continue  # popped by sanitize (a tied lm_head)
        scales = out.pop(f"{module}.scales").astype(mx.float32)
        biases = out.pop(f"{module}.biases").astype(mx.float32)
        out[f"{module}.weight"] = mx.dequantize(out[f"{module}.weight"], scales, biases, q["group_size"], q["bits"])
    return out


def _load_mlx_lm(path: str, keep_quantized: bool, float_dtype) -> LoadedModel:
    from huggingface_hub.errors import LocalEntryNotFoundError
    from mlx_lm.utils import dequantize_model, hf_repo_to_path, load

    try:
        model, tokenizer, config = load(path, return_config=True)
    except Exception as err:  # mlx-lm raises FileNotFoundError, ValueError, hub errors...
        if isinstance(err, LocalEntryNotFoundError) and not Path(path).is_dir():  # its text spans two lines
            raise ModelError(f"{path}: no such file or folder, and as a hub model it is not in the local cache and "
                             f"the hub cannot be reached (offline?); download it where there is network: hf download "
                             f"{path} --local-dir DIR, then set model.path: DIR") from None
        if Path(path).is_dir() and (problem := _folder_problem(path, err)):
            raise ModelError(problem) from None
        where = "model folder" if Path(path).is_dir() else "hub model (not a local path)"
        detail = " ".join(f"{type(err).__name__}: {err}".split())  # one line
        raise ModelError(f"{path}: mlx-lm could not load this {where}: {detail}") from None
    if not keep_quantized and config.get("quantization"):
        model = dequantize_model(_widened_scales(model))
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    model.set_dtype(float_dtype)
    if float_dtype != mx.float32 and _has_experts(model) and not _gather_mm_runs(float_dtype):
        name = next(k for k, v in DTYPES.items() if v == float_dtype)
        raise ModelError(f"{path}: a mixture-of-experts model in {name}: this device computes its expert layers "
                         f"(mx.gather_mm) in float32 only; set model.dtype float32 (or auto)")
    mx.eval(model.parameters())
    config_hash = hashlib.sha256(repr(sorted(config.items())).encode()).hexdigest()[:16]
    if Path(path).is_dir():
        location, fingerprint = str(Path(path).resolve()), folder_fingerprint(Path(path))
        reference = {"path": location, "fingerprint": fingerprint}
        aliases = (f"mlx-lm:{location}:{config_hash}",)  # what checkpoints before 2026-12-04 hold
    else:  # a hub id: by its download's content (mlx-lm's, in the hub cache): a re-upload is another model
        fingerprint = folder_fingerprint(hf_repo_to_path(path))
        reference = {"hub_id": path}
        aliases = (f"mlx-lm:{path}:{config_hash}",)  # what checkpoints before 2026-12-07 hold: the id and config
    identity = f"mlx-lm-folder:{fingerprint}"
    return LoadedModel(model, tokenizer, config, identity, f"mlx-lm model {path}", reference, aliases)


def _widened_scales(model: nn.Module) -> nn.Module:
    """``model`` with its quantized layers' float16/bfloat16 scales and biases widened to float32 (in place), so
    ``mlx_lm.utils.dequantize_model``, which computes ``scale * q + bias`` in their dtype, gives the float32 values,
    as :func:`dequantize_weights` does for a GGUF file (a converted folder's weights then equal its GGUF's)."""
    for _, module in model.named_modules():
        for name in ("scales", "biases"):
            value = getattr(module, name, None) if hasattr(module, "group_size") else None
            if isinstance(value, mx.array) and value.dtype in (mx.float16, mx.bfloat16):
                setattr(module, name, value.astype(mx.float32))
    return model


def _folder_problem(path: str, err: BaseException) -> str | None:
    """What mlx-lm's failure ``err`` on the model folder ``path`` comes from, naming the file, else None (mlx-lm's
    own message is said): no tokenizer files, a weight file MLX cannot read, a shard the index names that is absent,
    a Git LFS pointer in place of a tokenizer or weight file."""
    folder = Path(path)
    if _in_load_tokenizer(err):  # mlx-lm's load reads the weights first
        pointer = next(filter(None, map(lfs_pointer_problem, sorted(folder.glob("tokenizer*")))), None)
        return pointer or (None if _has_tokenizer_files(folder) else (
            f"{path}: the folder has no tokenizer files (tokenizer.json, or tokenizer.model for a SentencePiece "
            "tokenizer); copy them from the model it was made from"))
    if unreadable := _unreadable_weights(folder):
        return unreadable
    if absent := _absent_shards(folder):
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        return (f"{path}: model.safetensors.index.json names {absent[0]}{more}, which the folder lacks (an "
                "incomplete download?)")
    return None


def _in_load_tokenizer(err: BaseException) -> bool:
    """``err`` was raised inside mlx-lm's ``load_tokenizer``."""
    import traceback

    return any(frame.name == "load_tokenizer" for frame in traceback.extract_tb(err.__traceback__))


def _unreadable_weights(folder: Path) -> str | None:
    """The first of ``folder``'s weight files (those mlx-lm loads) that ``mx.load`` refuses, named with its error:
    MLX's ('[read] Unable to read 8 bytes from file.', a tensor's offsets past the file's end) name no file."""
    for weights in sorted(folder.glob("model*.safetensors")):
        try:
            mx.load(str(weights))
        except (RuntimeError, ValueError, OSError) as err:
            return lfs_pointer_problem(weights) or (
                f"{weights}: not a readable safetensors file ({' '.join(str(err).split())})")
    return None


def _absent_shards(folder: Path) -> list:
    """The weight files ``model.safetensors.index.json`` maps tensors to that ``folder`` lacks, sorted: mlx-lm loads
    the files present and names only the tensors missing ('Missing 12 parameters: ...')."""
    try:
        weight_map = read_json_object(folder / "model.safetensors.index.json").get("weight_map")
    except (ModelError, OSError):
        return []
    names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    return sorted(n for n in names if isinstance(n, str) and not (folder / n).is_file())


def _has_tokenizer_files(folder: Path) -> bool:
    """``folder`` holds a file transformers builds a tokenizer from (tokenizer.json, a SentencePiece or tiktoken
    model, a BPE or WordPiece vocabulary); without one it says 'You need to have sentencepiece or tiktoken
    installed', which they may well be."""
    return any(any(folder.glob(pattern)) for pattern in ("tokenizer.json", "*.model", "vocab.*", "*.tiktoken"))


def _has_experts(model) -> bool:
    """The model holds mlx-lm's expert layers (``SwitchLinear``, computed with ``mx.gather_mm``)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    return any(isinstance(m, SwitchLinear) for _, m in model.named_modules())


def _gather_mm_runs(dtype) -> bool:
    """``mx.gather_mm`` computes in ``dtype`` on the default device (MLX 0.32's CPU: float32 only, a RuntimeError
    at the first forward pass otherwise)."""
    try:
        mx.eval(mx.gather_mm(mx.zeros((1, 1, 2), dtype), mx.zeros((2, 2, 2), dtype), rhs_indices=mx.array([1], mx.uint32)))
    except RuntimeError:
        return False
    return True


SAMPLES, SAMPLE_BYTES = 16, 64 * 1024  # blocks of each weight file read by folder_fingerprint


def folder_fingerprint(folder: Path) -> str:
    """sha256 hex of a model folder's content, not its path: config.json's bytes and, per
    ``model*.safetensors`` file (those mlx-lm loads), its name, size, safetensors header and
    ``SAMPLES`` blocks of ``SAMPLE_BYTES`` at evenly spaced offsets (the whole file when smaller).

    At most about 1 MiB is read per file, so a 16 GB folder is not hashed whole at every start.
    It misses an edit in place that keeps every size and header and leaves the sampled bytes alone
    (replaced or re-downloaded weights change the samples).
    """
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("model*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"|{weights.name}|{size}|".encode())
        with open(weights, "rb") as f:
            if size <= SAMPLES * SAMPLE_BYTES:
                digest.update(f.read())
                continue
            header = int.from_bytes(f.read(8), "little")  # safetensors: u64 length, then the JSON header
            start = 8 + header if header < size - 8 else 0  # not a safetensors file: sample it all
            f.seek(0)
            digest.update(f.read(start))
            for i in range(SAMPLES):
                f.seek(start + i * max(size - start - SAMPLE_BYTES, 0) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
