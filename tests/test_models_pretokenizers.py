"""GGUF tokenizers split text as llama.cpp does, and refuse what they do not reproduce.

Expected splits are hand-written (worked through the regex by hand) and, for
every string, recomputed with Python's ``regex`` module — a second regex engine —
running llama.cpp's sequential split (``unicode_regex_split``: each regex splits
every piece into its matches and the text between them).
"""

from __future__ import annotations

import heapq
import random

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from test_models_gguf import gemma_vocab

from dtrain.models.pretokenizers import PRE_TOKENIZERS, lookup, split_pre_tokenizer
from dtrain.models.tokenizer import build_tokenizer


def reference_split(regexes, text: str) -> list:
    words = [text]
    for pattern in regexes:
        out = []
        for word in words:
            pos = 0
            for m in regex.finditer(pattern, word):
                if m.start() > pos:
                    out.append(word[pos:m.start()])
                out.append(m.group())
                pos = m.end()
            if pos < len(word):
                out.append(word[pos:])
        words = out
    return words


def our_split(name: str, text: str) -> list:
    return [piece for piece, _ in split_pre_tokenizer(lookup(name)).pre_tokenize_str(text)]


HAND_WRITTEN = {
    "gpt-2": [
        ("Hello world", ["Hello", " world"]),
        ("I'm 12345 ok", ["I", "'m", " 12345", " ok"]),
        ("I'M", ["I", "'", "M"]),  # contractions are case-sensitive in GPT-2
        ("a  b", ["a", " ", " b"]),
        ("x\n\ny", ["x", "\n", "\n", "y"]),
    ],
    "llama-bpe": [
        ("12345", ["123", "45"]),
        ("I'M here", ["I", "'M", " here"]),
        ("x\n\n  y", ["x", "\n\n", " ", " y"]),
        ("hello!!\n\nworld", ["hello", "!!\n\n", "world"]),
        (" 2024", [" ", "202", "4"]),
    ],
    "smollm": [
        ("x = 123", ["x", " =", " ", "1", "2", "3"]),
        ("½ ٣٤", ["½", " ", "٣", "٤"]),  # \p{N} includes No and other scripts' digits
    ],
    "qwen2": [("12345", ["1", "2", "3", "4", "5"]), ("don't", ["don", "'t"])],
    "tekken": [
        ("HelloWorld", ["Hello", "World"]),
        ("HTTPServer", ["HTTPServer"]),
        ("ÉCOLE", ["É", "COLE"]),  # llama.cpp's "not a-z" stands in for \p{Lu}
        ("a/b\n", ["a", "/b", "\n"]),
        ("123", ["1", "2", "3"]),
    ],
    "gpt-4o": [("I'M here", ["I'M", " here"]), ("12345", ["123", "45"])],
    "default": [("a+b=12345!", ["a", "+", "b", "=", "123", "45", "!"])],
}

TRICKY = [
    "", " ", "   ", "\t\tx", "a\r\nb", "x \n y", "trailing   ", "\n\n\n", "1234567", "3.14159", "v1.2.3-rc4",
    "don't I'LL we've", "naïve café", "e\u0301te", "ǅemal", "日本語のテキスト", "你好，世界！", "🙂🙂 ok",
    "x\u00a0y", "a\u3000b", "ΑΒΓ δεζ", "Ⅻ ½ ²", "٣٤٥ ١", "<tag attr=\"1\">", "def f(x):\n    return x ** 2",
    "$100,000.00", "a||b&&c", "CamelCaseWord", "ALLCAPS lower", "ok!?…", "\u200bzero\u200bwidth",
]


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_hand_written_splits(name):
    for text, expected in HAND_WRITTEN[name]:
        assert our_split(name, text) == expected, text
        assert reference_split(lookup(name).regexes, text) == expected, text


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_matches_a_second_regex_engine_on_tricky_strings(name):
    for text in TRICKY:
        assert our_split(name, text) == reference_split(lookup(name).regexes, text), text


ALPHABET = st.sampled_from(list("aZé1٣½ '\n\r\t.!?-_/\u00a0\u3000日🙂\u0301") + ["'s", "'LL", "123", "  "])


@settings(max_examples=150, deadline=None)
@given(st.lists(ALPHABET, max_size=24).map("".join), st.sampled_from(["gpt-2", "llama-bpe", "smollm", "qwen2",
                                                                     "tekken", "gpt-4o", "default"]))
def test_split_equals_reference_on_generated_text(text, name):
    pieces = our_split(name, text)
    assert "".join(pieces) == text
    assert pieces == reference_split(lookup(name).regexes, text)


# ---------------------------------------------------------------- whole tokenizers


def bpe_metadata(pre: str | None, **over) -> dict:
    """A small gpt2-kind vocabulary: specials, the letters a-c, space and two merges."""
    tokens = ["<s>", "</s>", "a", "b", "c", "Ġ", "bc", "ab", "abc"]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * 7,
        "tokenizer.ggml.merges": ["b c", "a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return {**md, **over}


def pieces(hf, text: str, **kw) -> list:
    return hf.convert_ids_to_tokens(hf.encode(text, **kw))


def test_llama3_family_ignores_merges_and_adds_bos_by_default():
    # merges alone give a + bc ("a b" never applies after "b c"); llama3's
    # ignore_merges emits the whole word when it is a vocabulary token.
    assert pieces(build_tokenizer(bpe_metadata("gpt-2")), "abc") == ["a", "bc"]
    assert pieces(build_tokenizer(bpe_metadata("llama-bpe")), "abc") == ["<s>", "abc"]
    no_bos = bpe_metadata("llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    assert pieces(build_tokenizer(no_bos), "abc") == ["abc"]


def test_add_eos_token_appends_eos():
    md = bpe_metadata("gpt-2", **{"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.add_bos_token": True})
    assert pieces(build_tokenizer(md), "ab c") == ["<s>", "ab", "Ġ", "c", "</s>"]
    assert pieces(build_tokenizer(md), "ab", add_special_tokens=False) == ["ab"]


def test_missing_pre_is_llama_cpp_default_not_gpt2():
    hf = build_tokenizer(bpe_metadata(None))
    assert hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a+12345")[0][0] == "a"
    pre = [p for p, _ in hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a+12345")]
    assert pre == ["a", "+", "123", "45"]


@pytest.mark.parametrize("name", ["deepseek-llm", "deepseek-coder", "chatglm-bpe", "gpt2", "my-own-splitter"])
def test_unimplemented_pre_tokenizer_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.pre '{regex.escape(name)}' is not implemented"):
        build_tokenizer(bpe_metadata(name))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("tokenizer.ggml.add_sep_token", True, r"'tokenizer\.ggml\.add_sep_token' = true is not supported"),
        ("tokenizer.ggml.precompiled_charsmap", [0, 1], r"'tokenizer\.ggml\.precompiled_charsmap' is not supported"),
        ("tokenizer.ggml.add_eos_token", True, r"add_eos_token is true but tokenizer\.ggml\.eos_token_id is missing"),
    ],
)
def test_tokenizer_metadata_that_changes_ids_is_refused_by_name(key, value, message):
    md = bpe_metadata("gpt-2", **{key: value})
    if key.endswith("add_eos_token"):
        del md["tokenizer.ggml.eos_token_id"]
    with pytest.raises(ValueError, match=message):
        build_tokenizer(md)


def spm_metadata(prefix: bool) -> dict:
    tokens, scores, types = gemma_vocab()
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_space_prefix": prefix,
        "tokenizer.ggml.pre": "default",  # llama.cpp ignores pre for SPM vocabularies
    }


def test_spm_space_prefix_goes_before_every_fragment_as_in_llama_cpp():
    hf = build_tokenizer(spm_metadata(prefix=True))
    # llama.cpp prefixes the text after each special token too, and always adds
    # one space (a text that starts with a space gets two).
    assert pieces(hf, "hello<end_of_turn>the") == ["<bos>", "▁hello", "<end_of_turn>", "▁the"]
    assert pieces(hf, " the", add_special_tokens=False) == ["▁", "▁the"]
    assert hf.decode(hf.encode("hello the", add_special_tokens=False)) == "hello the"
    flat = build_tokenizer(spm_metadata(prefix=False))
    assert pieces(flat, "hello<end_of_turn>the", add_special_tokens=False) == ["he", "llo", "<end_of_turn>", "t",
                                                                                "he"]


def test_unknown_type_token_is_matched_whole():
    hf = build_tokenizer(spm_metadata(prefix=False))
    assert pieces(hf, "a<unk>b", add_special_tokens=False) == ["a", "<unk>", "b"]


@pytest.mark.parametrize("key", ["bos", "eos", "padding", "unknown"])
def test_a_special_id_on_a_normal_token_is_tokenized_as_text_as_in_llama_cpp(key):
    """A BOS/EOS/pad/unknown id naming a NORMAL token ("ab") was handed to transformers, which adds such a token as
    special: "abc" became ab + c (matched whole) where llama.cpp runs BPE over it: a + bc ("b c" merges first)."""
    hf = build_tokenizer(bpe_metadata("gpt-2", **{f"tokenizer.ggml.{key}_token_id": 7}))
    assert pieces(hf, "abc", add_special_tokens=False) == ["a", "bc"]
    assert getattr(hf, {"padding": "pad", "unknown": "unk"}.get(key, key) + "_token") == "ab"
    assert hf.decode(hf.encode("abc", add_special_tokens=False), skip_special_tokens=True) == "abc"


def test_a_token_text_twice_is_refused_and_empty_tokens_are_named_as_llama_cpp_names_them():
    """A vocabulary holding one text twice loaded with the later id winning (the earlier one never produced), where
    llama.cpp aborts loading it; empty texts, which llama.cpp renames [EMPTY_<id>], collided the same way."""
    md = bpe_metadata("gpt-2")
    twice = {**md, "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"] + ["ab"],
             "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"] + [1]}
    with pytest.raises(ValueError, match=r"^tokenizer\.ggml\.tokens holds 'ab' twice \(ids 7 and 9\); llama\.cpp "
                                         r"does not load such a vocabulary$"):
        build_tokenizer(twice)
    empty = {**md, "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"] + ["", ""],
             "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"] + [3, 1]}
    hf = build_tokenizer(empty)
    assert hf.convert_ids_to_tokens([9, 10]) == ["[EMPTY_9]", "[EMPTY_10]"]
    assert hf.encode("a[EMPTY_9]", add_special_tokens=False) == [2, 9]  # a control token's text, as llama.cpp


@pytest.mark.parametrize("key", ["padding", "unknown"])
def test_a_special_id_on_a_normal_token_is_no_control_text_in_messages(key):
    """The data layer took every named special token (pad "ab" on a NORMAL token) for control text, which this
    tokenizer runs BPE over as text: a message "abc" was reported as having control-token text."""
    from dtrain.config import DataConfig
    from dtrain.data import tokenize_rows
    from dtrain.data.formats import parse_rows
    from dtrain.data.templates import control_strings

    hf = build_tokenizer(bpe_metadata("gpt-2", **{f"tokenizer.ggml.{key}_token_id": 7}))
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"
    assert control_strings(hf) == ("</s>", "<s>")
    rows, _ = parse_rows([("f:1", {"prompt": "abc", "chosen": "c", "rejected": "bc"})], DataConfig(), "f")
    pairs, report = tokenize_rows(rows, hf, DataConfig())
    assert report.control_text == [] and report.summary() == ""
    assert hf.convert_ids_to_tokens(pairs[0].prompt) == ["a", "bc", "</s>"]


# ---------------------------------------------------------------- SentencePiece merges against llama.cpp's rule


def llama_cpp_spm(text: str, vocab: dict, scores: list) -> list:
    """llama.cpp's ``llm_tokenizer_spm_session::tokenize`` on one escaped fragment, as token texts: merge the
    adjacent pair whose text is a token with the highest score, the leftmost first on a tie; a lone character
    that is no token becomes its <0xXX> bytes."""
    text_of, nxt, prv = list(text), list(range(1, len(text))) + [-1], list(range(-1, len(text) - 1))
    queue = []

    def push(left, right):
        if left >= 0 and right >= 0 and text_of[left] + text_of[right] in vocab:
            merged = text_of[left] + text_of[right]
            heapq.heappush(queue, (-scores[vocab[merged]], left, right, merged))

    for i in range(1, len(text)):
        push(i - 1, i)
    while queue:
        _, left, right, merged = heapq.heappop(queue)
        if text_of[left] + text_of[right] != merged or not text_of[right]:
            continue
        text_of[left], text_of[right], nxt[left] = merged, "", nxt[right]
        if nxt[left] >= 0:
            prv[nxt[left]] = left
        push(prv[left], left)
        push(left, nxt[left])
    return [t for p in text_of if p for t in ([p] if p in vocab else [f"<0x{b:02X}>" for b in p.encode()])]


def spm_vocab(rng: random.Random, scores) -> dict:
    """A SentencePiece-style vocabulary over a-d: specials, 256 bytes, the letters and 10 made-up pieces of 2-4
    letters, each built from two pieces before it, scored by ``scores(n)`` (n pieces)."""
    pieces = list("abcd")
    while len(pieces) < 14:
        piece = rng.choice(pieces) + rng.choice(pieces)
        if len(piece) <= 4 and piece not in pieces:
            pieces.append(piece)
    made = pieces[4:]
    rng.shuffle(made)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces[:4] + made
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 263 + list(scores(len(made))),
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 14, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": False}


def test_spm_merges_equal_llama_cpp_on_generated_vocabularies():
    rng = random.Random(0)
    for _ in range(40):
        md = spm_vocab(rng, lambda n: rng.sample(range(-100, 0), n))  # distinct scores, in no id order
        hf, vocab = build_tokenizer(md), {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
        for _ in range(20):
            text = "".join(rng.choice("abcde") for _ in range(rng.randrange(1, 10)))
            assert pieces(hf, text, add_special_tokens=False) == llama_cpp_spm(
                text, vocab, md["tokenizer.ggml.scores"]), text


def test_spm_pieces_sharing_a_score_are_refused():
    """llama.cpp breaks a score tie by position (the leftmost pair first); dtrain's ranked merges broke it by id:
    with "bd" and "cc" tied and "bdc" above them, "cbdcc" became c bd cc where llama.cpp gives c bdc c."""
    md = spm_vocab(random.Random(0), lambda n: [-5.0] * n)
    tokens = md["tokenizer.ggml.tokens"][:263] + ["cc", "bd", "bdc"]
    md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 263 + [-5.0, -5.0, -2.0],
               "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"][:len(tokens)]})
    assert llama_cpp_spm("cbdcc", {t: i for i, t in enumerate(tokens)}, md["tokenizer.ggml.scores"]) == [
        "c", "bdc", "c"]
    with pytest.raises(ValueError, match=r"^tokenizer\.ggml\.scores gives 'cc' and 'bd' the same score -5\.0: "
                                         r"llama\.cpp merges the leftmost of two pairs with one score first"):
        build_tokenizer(md)
