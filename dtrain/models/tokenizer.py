"""Hugging Face fast tokenizers built from GGUF ``tokenizer.*`` metadata, tokenizing as llama.cpp.

Two vocabulary kinds are supported, as llama.cpp names them:

* ``gpt2``: byte-level BPE with explicit ``merges`` (SmolLM2, Llama 3, Qwen2).
  The pre-tokenizer is llama.cpp's for ``tokenizer.ggml.pre`` (pretokenizers.py);
  a name dtrain does not implement is refused.
* ``llama``: SentencePiece-style vocabulary with ``scores`` (Llama 2, Gemma).
  llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose
  concatenation has the highest score; that is BPE whose merge ranks are the
  merged pieces sorted by score, which is what we build (with byte fallback to
  the ``<0xXX>`` tokens and ``▁`` for spaces).

Tokens llama.cpp marks CONTROL or UNKNOWN become special added tokens,
USER_DEFINED ones plain added tokens; all are matched whole before BPE runs, as
llama.cpp does when it parses special tokens. The marks are the file's token
types as llama.cpp corrects them by text (end-of-generation texts such as
``</s>`` or ``<end_of_turn>`` are CONTROL whatever the file says; see
vocab_attrs.py); a token llama.cpp gives LSTRIP/RSTRIP (Phi-3 by name) takes
the whitespace before/after it (tokenizers strips Unicode whitespace, llama.cpp
ASCII ``isspace`` only). Other ``tokenizer.*`` keys that would change the ids
(``add_sep_token``, unknown keys) are refused by name.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from . import vocab_attrs as va
from .pretokenizers import lookup, split_pre_tokenizer

NORMAL = 1  # GGUF token type of ordinary vocabulary

# tokenizer.* keys this module reads or that do not change how text becomes ids
# (ids of special tokens, chat templates, an embedded tokenizer.json we do not use).
# Any other tokenizer.* key is refused by name.
_KNOWN_KEYS = {
    f"tokenizer.ggml.{k}" for k in (
        "model pre tokens token_type scores merges add_bos_token add_eos_token add_sep_token add_space_prefix "
        "remove_extra_whitespaces bos_token_id eos_token_id eot_token_id eom_token_id unknown_token_id "
        "seperator_token_id padding_token_id mask_token_id fim_pre_token_id fim_suf_token_id fim_mid_token_id "
        "fim_pad_token_id fim_rep_token_id fim_sep_token_id prefix_token_id suffix_token_id middle_token_id"
    ).split()
} | {"tokenizer.chat_template", "tokenizer.chat_templates", "tokenizer.huggingface.json"}
# arrays read by index or iterated: their element kind and how a message names it
_LISTS = {"tokenizer.ggml.tokens": (str, "texts"), "tokenizer.ggml.token_type": (int, "integers"),
          "tokenizer.ggml.scores": ((int, float), "numbers"), "tokenizer.ggml.merges": (str, "texts")}
_FLAGS = {f"tokenizer.ggml.{k}" for k in ("add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix",
                                          "remove_extra_whitespaces")}


def check_tokenizer_keys(md: dict) -> None:
    """Refuse tokenizer metadata that would change tokenization and is not implemented.

    Raises:
        ValueError: an unknown ``tokenizer.*`` key, ``add_sep_token`` true
            (BERT-style separator after the text), or a token id, flag, ``pre`` or
            vocabulary list of another kind (llama.cpp refuses a key of the wrong type),
            naming the key.
    """
    for key in md:
        if key.startswith("tokenizer.") and key not in _KNOWN_KEYS and not key.startswith("tokenizer.chat_template."):
            raise ValueError(f"GGUF key {key!r} is not supported (it may change tokenization)")
        value = md[key]
        if key.endswith("_token_id") and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"GGUF key {key!r} = {value!r} is not supported (expected a token id)")
        if key in _FLAGS and not isinstance(value, bool):  # else bool('false') adds the token
            raise ValueError(f"GGUF key {key!r} = {value!r} is not supported (expected true or false)")
        if key == "tokenizer.ggml.pre" and not isinstance(value, str):
            raise ValueError(f"GGUF key {key!r} = {value!r} is not supported (expected a name)")
        if key in _LISTS:  # else len()'s or iteration's TypeError, or 'int' has no attribute 'split'
            kind, what = _LISTS[key]
            if not isinstance(value, list):
                raise ValueError(f"GGUF key {key!r} = {value!r} is not supported (expected a list of {what})")
            odd = next((i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, kind)), None)
            if odd is not None:
                raise ValueError(f"GGUF key {key!r} holds {value[odd]!r} at index {odd}, which is not supported "
                                 f"(expected a list of {what})")
    if md.get("tokenizer.ggml.add_sep_token"):
        raise ValueError("GGUF key 'tokenizer.ggml.add_sep_token' = true is not supported")


def _merges_from_scores(tokens: list, scores: list, types: list) -> list:
    """BPE merges ``(left, right)`` ordered by the score of ``left + right``, best first.

    Every split of a normal token into two vocabulary pieces is a merge; splits
    of one token keep the id order of their left piece.

    Raises:
        ValueError: two different tokens made by merges share a score.
            llama.cpp then merges the pair further left first
            (``llm_bigram_spm``'s comparator: score, then left position), which
            no fixed merge rank reproduces ("cbdcc" with "bd" and "cc" tied and
            "bdc" above them: c bdc c there, c bd cc by rank); GGUFs converted
            without the SentencePiece model file (every score -1000) are such.
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
    by_score = {}  # score -> the first token merged at it
    for score, i, *_ in ranked:
        if by_score.setdefault(score, i) != i:
            raise ValueError(
                f"tokenizer.ggml.scores gives {tokens[by_score[score]]!r} and {tokens[i]!r} the same score {-score}: "
                "llama.cpp merges the leftmost of two pairs with one score first, which dtrain's ranked merges do "
                "not reproduce; convert the original Hugging Face model with mlx_lm instead")
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(md: dict):
    """A ``transformers.PreTrainedTokenizerFast`` that tokenizes as llama.cpp does.

    ``gpt2`` vocabularies: llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre``
    (pretokenizers.py), byte-level BPE with the file's merges. ``llama``
    vocabularies (SentencePiece): ``tokenizer.ggml.pre`` is ignored, as in
    llama.cpp; a space is prepended to every text fragment (the start, and after
    each special token) when ``add_space_prefix`` (default true), spaces become
    ``▁``. BOS/EOS are added per ``add_bos_token``/``add_eos_token``, whose
    defaults follow llama.cpp (SPM: BOS; llama3-family and tekken BPE: BOS).
    Source: llama.cpp ``src/llama-vocab.cpp`` (``load``, ``tokenize``).

    Args:
        md: GGUF key/value pairs as Python values (``tokenizer.ggml.tokens``,
            ``token_type``, ``merges`` or ``scores``, ``bos_token_id`` ...).

    Raises:
        ValueError: no vocabulary, no or another ``tokenizer.ggml.model`` than
            ``gpt2``/``llama``, no ``merges`` (gpt2) or ``scores`` (llama), an unimplemented ``tokenizer.ggml.pre``, an
            unknown ``tokenizer.*`` key, a BOS/EOS flag without its token id,
            ``token_type`` or ``scores`` of another length than ``tokens``, a token
            text held twice, or ``merges`` that do not fit the tokens; each
            message names the key.
    """
    # as mlx_lm/__init__.py does: without it, a transformers imported before mlx_lm prints that
    # PyTorch is missing and "Models won't be available" (dtrain data check on a GGUF model)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import PreTrainedTokenizerFast

    check_tokenizer_keys(md)
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    for key in ("token_type", "scores"):  # one entry per token, read by index
        values = md.get(f"tokenizer.ggml.{key}")
        if values and len(values) != len(tokens):
            raise ValueError(f"tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")
    types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for an empty text
    vocab = {}
    for i, t in enumerate(tokens):  # llama.cpp aborts loading a text held twice
        if vocab.setdefault(t, i) != i:
            raise ValueError(f"tokenizer.ggml.tokens holds {t!r} twice (ids {vocab[t]} and {i}); llama.cpp does not "
                             "load such a vocabulary")

    def token(key):
        idx = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    def needed(key):  # else a bare KeyError: "cannot build the tokenizer from GGUF metadata: 'tokenizer.ggml.merges'"
        if md.get(f"tokenizer.ggml.{key}") is None:
            raise ValueError(f"the GGUF file has no tokenizer.ggml.{key}, which a {kind} vocabulary merges by")
        return md[f"tokenizer.ggml.{key}"]

    if kind == "gpt2":
        pre = lookup(md.get("tokenizer.ggml.pre"))
        merges = [tuple(m.split(" ", 1)) for m in needed("merges")]
        where = "tokenizer.ggml.merges do not fit tokenizer.ggml.tokens"
        odd = next((m for m, pair in zip(md["tokenizer.ggml.merges"], merges) if len(pair) != 2), None)
        if odd is not None:
            raise ValueError(f"{where} (merge {odd!r} is not two pieces with a space between)")
        try:
            tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
        except Exception as err:  # tokenizers raises a bare Exception for a merge of pieces not in the vocabulary
            raise ValueError(f"{where} ({err})") from None
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split_pre_tokenizer(pre), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
        add_bos_default = pre.add_bos
    elif kind == "llama":
        merges = _merges_from_scores(tokens, needed("scores"), types)
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=token("unknown"), fuse_unk=True, byte_fallback=True)
        )
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        # A normalizer runs on each fragment between added tokens, like llama.cpp's
        # per-fragment prefix; Metaspace would prefix only the first fragment and
        # skip texts that already start with a space.
        escape = normalizers.Replace(" ", "▁")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(" "), escape]) if prefix else escape
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True
    elif kind is None:
        raise ValueError("the GGUF file has no tokenizer.ggml.model (supported: gpt2, llama)")
    else:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")

    attrs, _ = va.token_attrs(md)
    tok.add_tokens(
        [
            AddedToken(t, special=bool(attrs[i] & (va.CONTROL | va.UNKNOWN)), normalized=False,
                       lstrip=bool(attrs[i] & va.LSTRIP), rstrip=bool(attrs[i] & va.RSTRIP))
            for i, t in enumerate(tokens)
            if attrs[i] & (va.CONTROL | va.UNKNOWN | va.USER_DEFINED)
        ]
    )
    bos, eos = token("bos"), token("eos")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    for flag, on, name in (("add_bos_token", add_bos, bos), ("add_eos_token", add_eos, eos)):
        if on and name is None:
            key = "bos_token_id" if flag == "add_bos_token" else "eos_token_id"
            raise ValueError(f"tokenizer.ggml.{flag} is true but tokenizer.ggml.{key} is missing or out of range")
    if add_bos or add_eos:
        single = " ".join([*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])])
        specials = {t: vocab[t] for t, on in ((bos, add_bos), (eos, add_eos)) if on}
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B')}", special_tokens=list(specials.items())
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)  # decode: text as written
    # Named after construction: transformers adds a constructor's special token that is no added token
    # (an id on a NORMAL token) as a special one, matched whole in text where llama.cpp runs BPE over it.
    hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token = bos, eos, token("padding"), token("unknown")
    template = md.get("tokenizer.chat_template")
    # named templates (convert_hf_to_gguf.py writes tokenizer.chat_template.tool_use ...): transformers' dict
    named = {n: md[f"tokenizer.chat_template.{n}"] for n in md.get("tokenizer.chat_templates") or []
             if f"tokenizer.chat_template.{n}" in md}
    hf.chat_template = {"default": template, **named} if named and template is not None else template
    return hf


def eos_token_ids(md: dict) -> list:
    """The ids llama.cpp ends generation at (vocab_attrs.py): EOS, EOT (Gemma's <end_of_turn>), EOM and the
    end-of-turn texts of the vocabulary (Llama 3's <|end_of_text|>, <|eom_id|>, <|eot_id|>), sorted."""
    return sorted(va.token_attrs(md)[1])
