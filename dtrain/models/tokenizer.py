"""Hugging Face fast tokenizers built from GGUF ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds are supported, as llama.cpp names them:

* ``gpt2``: byte-level BPE with explicit ``merges`` (SmolLM2, Llama 3, Qwen2).
  The pre-tokenizer follows ``tokenizer.ggml.pre`` (gpt2 regex by default).
* ``llama``: SentencePiece-style vocabulary with ``scores`` (Llama 2, Gemma).
  llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose
  concatenation has the highest score; that is BPE whose merge ranks are the
  merged pieces sorted by score, which is what we build (with byte fallback to
  the ``<0xXX>`` tokens and ``▁`` for spaces).

Tokens of type CONTROL (3) become special added tokens, USER_DEFINED (4) plain
added tokens; both are matched whole before BPE runs.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED, NORMAL = 3, 4, 1

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level_pre_tokenizer(pre: str):
    """The pre-tokenizer for a ``tokenizer.ggml.pre`` name (llama.cpp's llama-vocab.cpp)."""
    if pre in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _merges_from_scores(tokens: list, scores: list, types: list) -> list:
    """BPE merges ``(left, right)`` ordered by the score of ``left + right``, best first.

    Every split of a normal token into two vocabulary pieces is a merge; ties
    keep the merged token's id order.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(md: dict):
    """A ``transformers.PreTrainedTokenizerFast`` from GGUF metadata.

    Args:
        md: GGUF key/value pairs as Python values (``tokenizer.ggml.tokens``,
            ``token_type``, ``merges`` or ``scores``, ``bos_token_id`` ...).

    Raises:
        ValueError: no vocabulary, or a ``tokenizer.ggml.model`` other than
            ``gpt2`` / ``llama``.
    """
    from transformers import PreTrainedTokenizerFast

    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}

    def token(key):
        idx = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(md.get("tokenizer.ggml.pre", "gpt2"))
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        merges = _merges_from_scores(tokens, md["tokenizer.ggml.scores"], types)
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=token("unknown"), fuse_unk=True, byte_fallback=True)
        )
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        scheme = "first" if prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")

    tok.add_tokens(
        [
            AddedToken(t, special=types[i] == CONTROL, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )
    bos = token("bos")
    if md.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        pad_token=token("padding"),
        unk_token=token("unknown"),
    )
    hf.chat_template = md.get("tokenizer.chat_template")
    return hf


def eos_token_ids(md: dict) -> list:
    """End-of-sequence ids: ``eos_token_id`` and, when present, ``eot_token_id`` (Gemma's <end_of_turn>)."""
    ids = [md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.eot_token_id")]
    return sorted({int(i) for i in ids if i is not None})
