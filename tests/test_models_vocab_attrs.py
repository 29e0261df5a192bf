"""llama.cpp's token attributes from a GGUF vocabulary, text rules included (dtrain/models/vocab_attrs.py).

Each rule of ``llama_vocab::impl::load`` (llama.cpp 0c1e570) is shown on a
vocabulary made for it, and the tokenizer built from it must split text as
llama.cpp then does: CONTROL text is matched whole only when special tokens are
parsed, USER_DEFINED text always. tests/test_llama_cpp.py checks the same
attributes against llama.cpp itself when it is installed.
"""

from __future__ import annotations

import random

import pytest
from test_models_gguf import gemma_vocab
from test_models_pretokenizers import pieces

from dtrain.models import vocab_attrs as va
from dtrain.models.tokenizer import build_tokenizer

C, U, N = va.CONTROL, va.USER_DEFINED, va.NORMAL


def spm_md(extra: list, extra_types: list, **keys) -> dict:
    tokens, scores, types = gemma_vocab()
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens + extra,
          "tokenizer.ggml.scores": scores + [0.0] * len(extra), "tokenizer.ggml.token_type": types + extra_types,
          "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.add_space_prefix": False}
    md.update({f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return md


def attrs_of(md: dict, texts) -> list:
    attrs, _ = va.token_attrs(md)
    ids = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    return [attrs[ids[t]] for t in texts]


def test_gemma3_end_of_sequence_text_is_control_and_split_as_plain_text():
    # Gemma 3 ships "</s>" as a USER_DEFINED token; llama.cpp makes it CONTROL (an end-of-generation text)
    md = spm_md(["</s>", "<b>"], [4, 4])
    attrs, eog = va.token_attrs(md)
    s_id = len(md["tokenizer.ggml.tokens"]) - 2
    assert attrs[s_id] == U | C and attrs[s_id + 1] == U
    assert eog == {1, 5, s_id}  # EOS <eos>, <end_of_turn>, </s>
    tok = build_tokenizer(md)
    tokens = md["tokenizer.ggml.tokens"]
    as_text = tok("a</s><b>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert [tokens[i] for i in as_text] == ["a", "<0x3C>", "<0x2F>", "s", "<0x3E>", "<b>"]
    assert tok.encode("a</s>", add_special_tokens=False) == [tokens.index("a"), s_id]


def test_texts_found_only_when_the_file_does_not_name_the_id():
    md = spm_md(["<|fim_prefix|>", "<PRE>", "<|fim_pad|>"], [1, 1, 1])
    pre, pre2, pad = attrs_of(md, ["<|fim_prefix|>", "<PRE>", "<|fim_pad|>"])
    assert (pre, pre2, pad) == (N | C, N, N | C)  # one FIM-prefix spelling is marked (the lower id)
    _, eog = va.token_attrs(md)
    assert md["tokenizer.ggml.tokens"].index("<|fim_pad|>") in eog
    named = spm_md(["<|fim_prefix|>", "<PRE>", "<|fim_pad|>"], [1, 1, 1], fim_pre_token_id=0, fim_pad_token_id=0)
    assert attrs_of(named, ["<|fim_prefix|>", "<PRE>", "<|fim_pad|>"]) == [N, N, N]


def test_gpt_oss_and_gemma4_exceptions():
    texts = ["<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|start|>"]
    md = spm_md(texts, [3, 3, 3, 3, 3])
    assert attrs_of(md, texts) == [C, C, U, U, U]
    end = md["tokenizer.ggml.tokens"].index("<|end|>")
    assert end not in va.token_attrs(md)[1]
    no_return = spm_md(["<|end|>", "<|call|>"], [1, 1])  # without <|return|>, <|end|> stays an end token
    assert attrs_of(no_return, ["<|end|>"]) == [N | C]
    solar = spm_md(["<|end|>", "<|calls|>", "<|flush|>"], [3, 3, 3])
    assert attrs_of(solar, ["<|end|>"]) == [U]
    gemma4 = spm_md(["</s>", "<turn|>", "<|tool_response>"], [4, 1, 3])
    assert attrs_of(gemma4, ["</s>", "<turn|>", "<|tool_response>"]) == [N, N | C, C]
    assert gemma4["tokenizer.ggml.tokens"].index("</s>") not in va.token_attrs(gemma4)[1]


def test_the_eos_id_takes_llama_cpp_default_when_out_of_range():
    md = spm_md([], [], eos_token_id=10**6)  # out of range: llama.cpp keeps the SPM default 2
    assert 2 in va.token_attrs(md)[1]


def test_every_end_of_generation_text_is_control_in_any_vocabulary():
    # property: wherever the texts sit and whatever type the file gives them, each
    # is CONTROL, in the set, and matched whole only when special tokens are parsed
    rnd = random.Random(0)
    known = set(gemma_vocab()[0])  # <eos>, <end_of_turn> are in the base vocabulary already
    texts = [t for t in va.EOG_TEXTS if t not in ("<|end|>", "</s>") and t not in known]  # exceptions: tested above
    for _ in range(20):
        picked = rnd.sample(texts, 5)
        types = [rnd.choice([1, 3, 4]) for _ in picked]
        md = spm_md(picked, types)
        attrs, eog = va.token_attrs(md)
        tokens = md["tokenizer.ggml.tokens"]
        tok = build_tokenizer(md)
        for text, kind in zip(picked, types):
            i = tokens.index(text)
            assert attrs[i] & C and i in eog, text
            assert tok.encode(f"a{text}", add_special_tokens=False) == [tokens.index("a"), i]
            split = tok(f"a{text}", add_special_tokens=False, split_special_tokens=True)["input_ids"]
            assert i not in split, (text, kind)


@pytest.mark.parametrize("bad", [None, []])
def test_no_token_types_means_all_normal(bad):
    md = spm_md([], [])
    md["tokenizer.ggml.token_type"] = bad
    attrs, _ = va.token_attrs(md)
    tokens = md["tokenizer.ggml.tokens"]
    assert attrs[tokens.index("<end_of_turn>")] == N | C and attrs[tokens.index("<bos>")] == N


def phi3_md(name: str, extra: list = ()) -> dict:
    """A Phi-3-style SPM vocabulary (specials <unk> <s> </s> <|endoftext|> <|end|>, a user-defined <x>) named ``name``."""
    md = spm_md(["<s>", "</s>", "<|endoftext|>", "<|end|>", "<x>", *extra], [3, 3, 3, 3, 4] + [3] * len(extra),
                add_space_prefix=True)
    md["general.name"] = name
    return md


def test_phi3_named_files_strip_spaces_after_special_tokens_as_llama_cpp():
    """llama.cpp sets RSTRIP on every CONTROL/USER_DEFINED/UNKNOWN token (and </s>), less <unk> <s> <|endoftext|>,
    when general.name holds "phi-3"/"phi3": the spaces after them are dropped. dtrain kept them ("<|end|>  the" gave
    <|end|> ▁ ▁ ▁the where llama.cpp gives <|end|> ▁the)."""
    md = phi3_md("Phi-3 Mini 4k Instruct (llamafied)")
    R = va.RSTRIP
    assert attrs_of(md, ["<|end|>", "<x>", "</s>", "<s>", "<unk>", "<|endoftext|>", "<eos>", "▁the"]) == [
        C | R, U | R, C | R, C, va.UNKNOWN, C, C | R, N]
    hf = build_tokenizer(md)
    assert pieces(hf, "hi<|end|>  the<x> \nthe", add_special_tokens=False) == [
        "▁", "h", "i", "<|end|>", "▁the", "<x>", "▁the"]
    assert pieces(hf, "<|endoftext|> the", add_special_tokens=False) == ["<|endoftext|>", "▁", "▁the"]
    other = build_tokenizer(phi3_md("Llama 2 7B"))
    assert pieces(other, "<|end|> the", add_special_tokens=False) == ["<|end|>", "▁", "▁the"]
    assert va.token_attrs(phi3_md("phi3-ish"))[0][-1] & R


def test_a_phi3_named_vocabulary_without_its_fixed_tokens_is_refused_as_llama_cpp_fails_to_load_it():
    md = phi3_md("my-phi3-finetune")
    md["tokenizer.ggml.tokens"] = [t if t != "<|endoftext|>" else "<|eot|>" for t in md["tokenizer.ggml.tokens"]]
    with pytest.raises(ValueError, match=r"^general\.name 'my-phi3-finetune' gives Phi-3's strip attributes, and "
                                         r"llama\.cpp does not load such a vocabulary without '<\|endoftext\|>'$"):
        va.token_attrs(md)
