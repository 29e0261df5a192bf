"""``dtrain convert GGUF_FILE OUT_DIR``: a GGUF file → an mlx-lm model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from mlx_lm.utils import save_config, save_model

from ..errors import ModelError
from ..files import atomic_folder, home_path, home_text, storage
from .demo import demo_model_path
from .gguf import gguf_to_mlx
from .load import build_gguf_model, gguf_files_hint
from .tokenizer import build_tokenizer, eos_token_ids


def convert_gguf(gguf_path: str, out_dir: str, dequantize: bool = False) -> Path:
    """Write an mlx-lm model folder for a llama or gemma3 GGUF file.

    The folder holds ``config.json`` (with mlx-lm's per-module ``quantization``
    entry when quantized weights are kept), ``model.safetensors`` (HF tensor
    names; llama Q/K rows un-permuted, gemma3 norms without llama.cpp's +1) and
    the tokenizer files from ``PreTrainedTokenizerFast.save_pretrained``
    (including the chat template, with BOS in front where llama.cpp adds it and
    the template writes none: :func:`with_bos`), so ``mlx_lm.load(out_dir)`` and
    ``python -m mlx_lm generate --model OUT_DIR --adapter-path ADAPTER`` work.
    It is written into a temporary sibling folder and renamed into place.

    Args:
        gguf_path: the GGUF file, or ``demo`` for the demo model (a leading ``~``: the home folder).
        out_dir: a folder that does not exist yet, or is empty (a leading ``~``: the home folder).
        dequantize: store Q4_0/Q4_1/Q8_0 weights as float32 instead of keeping
            them as MLX affine-quantized layers (group size 32).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ModelError: a missing or unreadable GGUF file, an unsupported
            architecture or tokenizer, or an ``out_dir`` that is a file or not empty.
        UserError: a path opening ``~user`` of no user here.
    """
    if not gguf_path:  # else the working folder: ': a folder, not a GGUF file'
        raise ModelError("the GGUF file path is empty text; give a .gguf file (or demo)")
    src = demo_model_path() if gguf_path == "demo" else home_path(gguf_path, "gguf_file")  # as model.path reads ~
    out_dir = home_text(out_dir, "out_dir")
    if src.is_dir():
        raise ModelError(f"{gguf_path}: a folder, not a GGUF file (a model folder is already what convert writes)"
                         f"{gguf_files_hint(src)}")
    if not src.is_file() and src.exists():  # a pipe, a socket or a device
        raise ModelError(f"{gguf_path}: not a regular file (a pipe, a socket or a device); give a .gguf file")
    if not src.is_file():
        raise ModelError(f"{gguf_path}: no such GGUF file")
    check_new_folder(out_dir)
    gm = gguf_to_mlx(src)
    try:
        tokenizer = build_tokenizer(gm.metadata)
    except (ValueError, KeyError) as err:
        raise ModelError(f"{gguf_path}: cannot build the tokenizer from GGUF metadata: {err}") from None
    try:
        model, config = build_gguf_model(gm, keep_quantized=not dequantize, float_dtype=None)
    except ModelError as err:
        raise ModelError(f"{gguf_path}: {err}") from None
    config["eos_token_id"] = eos_token_ids(gm.metadata)
    tokenizer.chat_template = with_bos(tokenizer, tokenizer.chat_template)
    return write_folder(out_dir, lambda tmp: save_mlx_lm(tmp, model, config, tokenizer))


# BOS, then the chat with the space a first-fragment-only Metaspace tokenizer prefixes to a text's start
FIRST_FRAGMENT_BOS = ("{% set dtrain_chat %}{{ '' }}",
                      "{{ '' }}{% endset %}{{ bos_token }}{% if dtrain_chat and not dtrain_chat.startswith((' ', '\u2581')) %}"
                      "{{ ' ' }}{% endif %}{{ dtrain_chat }}")


def with_bos(tokenizer, template: str | dict | None) -> str | dict | None:
    """``template`` for a model folder: ``{{ bos_token }}`` in front when the tokenizer adds BOS to a text and the
    template writes none.

    Training (data/render.py) and llama.cpp put that BOS before a rendered chat; mlx-lm's generate and server, and
    transformers' ``apply_chat_template``, tokenize it with no special tokens added, so a folder's template writes
    BOS itself. The GGUF keeps the template as it is (llama.cpp would add a second BOS). Where the tokenizer writes
    ``▁`` before a text's first fragment only and the chat opens with text, a space follows BOS: training's
    ``['<s>', '▁What', ...]`` stays that, not ``['<s>', 'What', ...]`` (:data:`FIRST_FRAGMENT_BOS`).
    """
    from ..data.render import RowTokenizer, prefixes_first_fragment
    from ..data.templates import Renderer, hf_tokenizer
    from ..errors import BadRow, DataError

    if isinstance(template, dict):  # named templates (default, tool_use ...): each one
        return {name: with_bos(tokenizer, text) for name, text in template.items()}
    hf = hf_tokenizer(tokenizer)
    bos = hf.bos_token
    if template is None or not bos or RowTokenizer.own_additions(tokenizer)[0] != (hf.convert_tokens_to_ids(bos),):
        return template
    try:
        text = Renderer(hf, template, name="export").render([{"role": "user", "content": "1"}], True)
    except (BadRow, DataError):  # a template that refuses the probe is left as it is
        return template
    if text.startswith(bos):
        return template
    if prefixes_first_fragment(tokenizer) and not any(text.startswith(t) for t in hf.get_added_vocab()):
        # training's BOS + text gave the text's first fragment its '▁'; after '{{ bos_token }}' it would get none
        return FIRST_FRAGMENT_BOS[0] + template + FIRST_FRAGMENT_BOS[1]
    return "{{ bos_token }}" + template


def save_mlx_lm(folder: Path, model, config: dict, tokenizer) -> None:
    """``model.safetensors`` + ``config.json`` + tokenizer files, as ``mlx_lm.utils.save`` writes them."""
    save_model(folder, model)
    save_config(config, folder / "config.json")
    tokenizer.save_pretrained(str(folder))


def check_new_folder(out_dir: str) -> None:
    """Raises ModelError when ``out_dir`` is empty text, a file or under one, a folder that is not empty, or the
    current folder (:func:`write_folder` replaces the folder it writes)."""
    if not out_dir:
        raise ModelError("the output folder is empty text; name a new folder")
    out = Path(out_dir)
    file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:  # else mkdir's bare "File exists"
        where = "is a file" if file == out else f"is under {file}, a file"
        raise ModelError(f"{out_dir} {where}, not a folder; choose a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ModelError(f"{out_dir}: output folder already exists and is not empty; choose a new folder")
    if out.is_dir() and out.resolve() == Path.cwd().resolve():  # renaming it away strands the shell standing in it
        raise ModelError(f"{out_dir} is the current folder, which the output would replace; name a new folder "
                         f"(e.g. {out_dir}/merged)")


def write_folder(out_dir: str, fill: Callable[[Path], None]) -> Path:
    """Run ``fill(tmp)`` on a temporary sibling folder, then rename it to ``out_dir``.

    Nothing is left behind when ``fill`` fails (:func:`dtrain.files.atomic_folder`);
    an existing ``out_dir`` must be empty (see :func:`check_new_folder`).

    Raises:
        StorageError: a write failed (disk full, permissions; MLX's I/O RuntimeError included).
    """
    check_new_folder(out_dir)
    with storage(f"write {out_dir}", "; nothing was left there"), atomic_folder(Path(out_dir)) as tmp:
        fill(tmp)
    return Path(out_dir)
