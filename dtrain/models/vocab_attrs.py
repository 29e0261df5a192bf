"""Token attributes as llama.cpp derives them from a GGUF vocabulary, texts included.

llama.cpp does not take a token's kind only from ``tokenizer.ggml.token_type``:
while loading a vocabulary (``llama_vocab::impl::load`` in src/llama-vocab.cpp)
it also looks tokens up by their text. :func:`token_attrs` replays those steps,
in llama.cpp's order, as of the commit in :data:`LLAMA_CPP_COMMIT` (the one
llama-cpp-python 0.3.36 embeds):

1. the file's token type gives the attribute (CONTROL, USER_DEFINED, ...);
2. a special token whose id the file does not give (``eot``, ``eom``, the six
   ``fim_*``) is found by its text and becomes CONTROL (:data:`FOUND_BY_TEXT`);
3. every token whose text ends generation (:data:`EOG_TEXTS`) becomes CONTROL
   and joins the end-of-generation set, with the FIM pad/repo/separator tokens
   and the EOS/EOT/EOM ids;
4. gpt-oss's ``<|channel|>``-style tokens become USER_DEFINED only;
5. ``<|end|>`` is USER_DEFINED only and leaves the set when the set holds
   ``<|return|>`` + ``<|call|>`` (gpt-oss) or ``<|calls|>`` + ``<|flush|>``
   (solar-open); ``</s>`` is NORMAL and leaves it when the set holds
   ``<|tool_response>`` (Gemma 4) or ``<|plamo:eos|>``;
6. the per-model strip bits, chosen by name: LSTRIP on ``<mask>`` (jina
   pre-tokenizers and architectures) or ``[MASK]`` (``general.name`` holding
   "modern-bert"); RSTRIP on every CONTROL/USER_DEFINED/UNKNOWN token and
   ``</s>``, less ``<unk>`` ``<s>`` ``<|endoftext|>``, when ``general.name``
   holds "phi-3" or "phi3" (llama.cpp then drops the spaces after those tokens).

The texts are llama.cpp's, so they age with it: tests/test_llama_cpp.py asks
the installed llama.cpp for the attribute of every token-like string its
library holds and fails when this module disagrees. Not replayed: when a
vocabulary holds two spellings of one FIM token, llama.cpp's choice by
hash-map order (we take the lower id).
"""

from __future__ import annotations

LLAMA_CPP_COMMIT = "0c1e570"

# llama_token_attr bits (include/llama.h)
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 128, 256  # the spaces before / after the token's text are dropped when it is matched whole
# GGUF token type (llama_token_type) -> attribute
_TYPE_ATTR = {0: UNDEFINED, 1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# Special tokens llama.cpp finds by text when ``tokenizer.ggml.<key>_token_id`` is absent.
FOUND_BY_TEXT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts that end generation (and are made CONTROL) wherever they are in the vocabulary.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: always rendered
_DEFAULT_EOS = {"llama": 2, "gpt2": 11}  # llama.cpp's default EOS id per tokenizer.ggml.model


def token_attrs(md: dict) -> tuple[list, set]:
    """``(attrs, eog)``: llama.cpp's attribute bits per token id, and its end-of-generation ids.

    Args:
        md: GGUF key/value pairs (``tokenizer.ggml.tokens``, ``token_type``,
            ``eos_token_id``, ``eot_token_id``, ``fim_*_token_id`` ...).

    Source: llama.cpp src/llama-vocab.cpp ``llama_vocab::impl::load`` at
    :data:`LLAMA_CPP_COMMIT` (steps in the module docstring).
    """
    tokens = list(md.get("tokenizer.ggml.tokens") or [])
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type") or [1] * n
    attrs = [_TYPE_ATTR.get(int(t), UNDEFINED) for t in types[:n]]
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t or f"[EMPTY_{i}]", i)

    def given(key, default=None):  # an id out of range keeps the default, as llama.cpp does
        for value in (md.get(f"tokenizer.ggml.{key}_token_id"), default):
            if value is not None and 0 <= int(value) < n:
                return int(value)
        return None

    special = {key: given(key) for key in FOUND_BY_TEXT}
    for key, texts in FOUND_BY_TEXT.items():
        if special[key] is None:
            found = sorted(ids[t] for t in texts if t in ids)
            if found:
                special[key] = found[0]
                attrs[found[0]] |= CONTROL
    eog = {special[k] for k in ("fim_pad", "fim_rep", "fim_sep") if special[k] is not None}
    for t in EOG_TEXTS:
        if t in ids:
            eog.add(ids[t])
            attrs[ids[t]] |= CONTROL
    for t in ALWAYS_USER_DEFINED:
        if t in ids:
            attrs[ids[t]] = USER_DEFINED
    eos = given("eos", _DEFAULT_EOS.get(md.get("tokenizer.ggml.model")))
    eog |= {i for i in (eos, special["eot"], special["eom"]) if i is not None}
    texts = {tokens[i]: i for i in eog}
    has_call = bool({"<|call|>", "<|calls|>"} & texts.keys())
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = USER_DEFINED
    if "</s>" in texts and {"<|tool_response>", "<|plamo:eos|>"} & texts.keys():
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = NORMAL
    _strip_by_name(md, attrs, ids)
    return attrs, eog


def _strip_by_name(md: dict, attrs: list, ids: dict) -> None:
    """Step 6: the LSTRIP/RSTRIP bits llama.cpp sets by pre-tokenizer, architecture or model name.

    Raises:
        ValueError: a Phi-3 name on a vocabulary without one of the four texts
            llama.cpp then looks up (it fails to load such a file).
    """
    pre, arch = md.get("tokenizer.ggml.pre") or "", md.get("general.architecture") or ""
    name = (md.get("general.name") or "").encode().lower().decode()  # std::tolower: ASCII letters only
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        mask = "<mask>"
    elif "phi-3" in name or "phi3" in name:
        for i, attr in enumerate(attrs):
            if attr & (CONTROL | USER_DEFINED | UNKNOWN):
                attrs[i] |= RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if text not in ids:
                raise ValueError(f"general.name {md['general.name']!r} gives Phi-3's strip attributes, and llama.cpp "
                                 f"does not load such a vocabulary without {text!r}")
            attrs[ids[text]] = attrs[ids[text]] | RSTRIP if on else attrs[ids[text]] & ~RSTRIP
        return
    elif "modern-bert" in name:
        mask = "[MASK]"
    else:
        return
    if mask in ids:  # llama.cpp warns when it is missing
        attrs[ids[mask]] |= LSTRIP
