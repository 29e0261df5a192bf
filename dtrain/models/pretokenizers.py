"""llama.cpp's pre-tokenizers for GGUF ``gpt2`` (byte-level BPE) vocabularies.

A GGUF file names its pre-tokenizer in ``tokenizer.ggml.pre``; llama.cpp
(``src/llama-vocab.cpp``: ``llm_tokenizer_bpe`` and ``llama_vocab::impl::load``)
maps the name to a list of regexes and a few flags. The regexes are applied one
after another: each splits every piece left by the previous one into its matches
and the text between them (``unicode_regex_split`` in ``src/unicode.cpp``), which
is ``tokenizers``' ``Split(..., behavior="isolated")`` in a ``Sequence``.

The regexes below are llama.cpp's strings, character for character (where
llama.cpp rewrote a ``(?i:...)`` group of the original tokenizer.json into
explicit ``[sS]`` classes, we keep llama.cpp's form). Names not listed are
refused: silently splitting with another family's regex would tokenize digits,
whitespace or case runs differently from the model's own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Mistral's tekken: a letter run is [upper-ish]*[lower-ish]+ or [upper-ish]+[lower-ish]*,
# where llama.cpp writes "upper-ish" as "a letter that is not a-z" (and lower-ish
# as "not A-Z") because std::regex lacks \p{Lu}/\p{Ll}.
_UPPERISH, _LOWERISH = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type.

    ``regexes``: applied in order (each splits the pieces of the one before).
    ``ignore_merges``: a piece that is itself a vocabulary token is emitted whole
    without running BPE merges (llama.cpp ``ignore_merges``; tokenizers' BPE
    ``ignore_merges``). ``add_bos``: llama.cpp's default for adding BOS before
    ``tokenizer.ggml.add_bos_token`` overrides it.
    """

    regexes: tuple
    ignore_merges: bool = False
    add_bos: bool = False


def _family(names: str, pre: PreTokenizer) -> dict:
    return {name: pre for name in names.split()}


# tokenizer.ggml.pre -> PreTokenizer, grouped as in llama_vocab::impl::load.
PRE_TOKENIZERS = {
    "default": PreTokenizer(DEFAULT),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
              PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)),
    **_family("dbrx smaug-bpe", PreTokenizer((LLAMA3,))),
    **_family("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 "
              "mpt olmo jais trillion granite-docling", PreTokenizer((GPT2,))),
    **_family("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
              PreTokenizer((r"\p{N}", GPT2))),
    **_family("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open", PreTokenizer((QWEN2,))),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 kanana2 talkie", PreTokenizer((GPT4O,))),
}


def lookup(name: str | None) -> PreTokenizer:
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` value (absent: llama.cpp's ``default``).

    Raises:
        ValueError: a name dtrain does not implement, naming it.
    """
    if name is None:
        return PRE_TOKENIZERS["default"]  # llama.cpp warns and uses "default" too
    if name not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre {name!r} is not implemented, so its text would be split differently from "
            f"llama.cpp (implemented: {', '.join(sorted(PRE_TOKENIZERS))}); convert the original Hugging Face "
            "model with mlx_lm instead"
        )
    return PRE_TOKENIZERS[name]


def split_pre_tokenizer(pre: PreTokenizer):
    """``tokenizers`` pre-tokenizer doing the regex splits of ``pre`` (no byte-level mapping)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes])
