"""Exports and GGUF tokenizers checked by llama.cpp itself (llama-cpp-python; skipped when it is not installed).

Install it as docs/llama-cpp.md says (it compiles llama.cpp: ``pip install llama-cpp-python==0.3.36``,
which embeds llama.cpp 0c1e570, the commit dtrain/models/vocab_attrs.py follows).

- Every ``dtrain export --gguf`` type of the demo adapter loads in llama.cpp with no warning, and its
  logits are the merged model's: f32 top-1 equal at every position of 5 chat prompts (f16: every position but
  flips of near-ties, reference top-2 within 0.1), and both the
  same greedy output; bf16/q8_0 top-1 equal at >= 99% of positions, near-tie flips not counted against them
  (the demo adapter trained on another CPU's BLAS flipped two q8_0 positions, reference top-2 0.05 and 0.11
  apart); q4_0 is measured and printed.
  The adapter is the demo adapter (configs/demo.yaml's 12 steps, trained in the fixture), or the folder
  named by ``DTRAIN_TEST_ADAPTER``.
- Tokenization: dtrain's tokenizer of every GGUF these tests build or ship gives llama.cpp's ids over
  generated strings, with special tokens parsed and not.
- Token attributes: for every token-like string compiled into llama.cpp's library, a vocabulary
  holding it gets the same CONTROL / USER_DEFINED / NORMAL attribute from llama.cpp and from
  vocab_attrs.token_attrs, so a newer llama.cpp with new end-of-generation texts fails here.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from test_models_gguf import gemma_vocab, gguf, write_tiny_gemma3, write_tiny_llama  # noqa: E402

from dtrain.models import load_model  # noqa: E402
from dtrain.models import vocab_attrs as va  # noqa: E402
from dtrain.models.export import GGUF_TYPES, export_adapter  # noqa: E402
from dtrain.models.tokenizer import build_tokenizer  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "What is 17 + 25?",
           "Name three colors.", "Explain photosynthesis in one sentence."]
WARN, ERROR = 3, 4  # ggml_log_level
TIE = 0.1  # logits: f16 positions whose reference top-2 are closer than this may flip (max f16 error seen: 0.087)


@pytest.fixture(scope="module")
def log():
    """llama.cpp's log lines of level WARN or ERROR while the fixture's user runs."""
    lines = []

    @llama_cpp.llama_log_callback
    def callback(level, text, _):
        if level in (WARN, ERROR):
            lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    yield lines
    llama_cpp.llama_log_set(llama_cpp.llama_log_callback(0), ctypes.c_void_p(0))


def llama(path, log, **kw):
    log.clear()
    return llama_cpp.Llama(model_path=str(path), verbose=False, n_threads=2, seed=0, **kw)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, demo_path):
    """``(adapter folder, {type: export result}, tokenizer)`` for every GGUF type."""
    tmp = tmp_path_factory.mktemp("llama_cpp")
    base = load_model("demo", dtype="float32")
    adapter = os.environ.get("DTRAIN_TEST_ADAPTER")
    if adapter is None:  # the demo adapter: configs/demo.yaml's run, as a user trains it
        from dtrain.config import load_config
        from dtrain.run.trainer import train

        cfg = load_config("configs/demo.yaml", [f"model.path={demo_path}", f"train.output_dir={tmp / 'run'}",
                                                "train.progress=false", "train.eval_every=0"])
        adapter = train(cfg).adapter_dir
    out = {t: export_adapter(str(adapter), "demo", str(tmp / t), gguf_type=t, dtype="float32") for t in GGUF_TYPES}
    return adapter, out, base.tokenizer


def merged_logits(folder, tokens):
    from mlx_lm import load

    model, _ = load(str(folder))
    return np.array(model(mx.array([tokens]))[0], dtype=np.float32)


def prompt_tokens(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def greedy(llm, tokens, n):
    llm.reset()
    out = list(tokens)
    for _ in range(n):
        llm.eval(out[llm.n_tokens:])
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    return out[len(tokens):]


def mlx_greedy(folder, tokens, n):
    from mlx_lm import load

    model, _ = load(str(folder))
    out = list(tokens)
    for _ in range(n):
        out.append(int(mx.argmax(model(mx.array([out]))[0, -1]).item()))
    return out[len(tokens):]


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
def test_every_export_type_gives_the_merged_models_logits_in_llama_cpp(exports, log, gguf_type):
    _, out, tokenizer = exports
    result = out[gguf_type]
    llm = llama(result.gguf, log, n_ctx=512, logits_all=True)
    assert log == [], log  # loads without a warning
    agree, total, ties, max_diff, same_greedy = 0, 0, 0, 0.0, 0
    for text in PROMPTS:
        tokens = prompt_tokens(tokenizer, text)
        want = merged_logits(result.folder, tokens)
        llm.reset()
        llm.eval(tokens)
        got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        equal = got.argmax(-1) == want.argmax(-1)
        top2 = np.sort(want, axis=-1)[:, -2:]
        ties += int((~equal & (top2[:, 1] - top2[:, 0] < TIE)).sum())  # f16 activations can flip a near-tie
        agree += int(equal.sum())
        total += len(tokens)
        max_diff = max(max_diff, float(np.abs(got - want).max()))
        same_greedy += greedy(llm, tokens, 12) == mlx_greedy(result.folder, tokens, 12)
    print(f"llama.cpp {gguf_type}: top-1 equal at {agree}/{total} positions ({ties} others within {TIE} of a tie), "
          f"max |logit diff| {max_diff:.4f}, greedy output equal on {same_greedy}/{len(PROMPTS)} prompts, "
          f"rounding/update ratio {result.quant_ratio()}")
    if gguf_type == "f32":
        assert agree == total and same_greedy == len(PROMPTS)
    elif gguf_type == "f16":  # llama.cpp multiplies F16 weights with activations rounded to f16
        assert agree + ties == total and same_greedy == len(PROMPTS)
    elif gguf_type in ("bf16", "q8_0"):  # rounded weights flip near-ties too: only the others count
        assert agree + ties >= 0.99 * total


def strings(vocab_texts, seed, n=400):
    """Generated strings: words, digits, unicode, whitespace runs, and the vocabulary's special texts."""
    rnd = random.Random(seed)
    pieces = ["hello", "world", " the", "The", "é", "日本語", "🙂", "123", "4567", " ", "  ", "\n", "\n\n", "\t", "x=1;",
              "don't", "'s", "Über", "ß", "—", "<", ">", "</", "|", "[", "]"] + list(vocab_texts)
    return [("" if rnd.random() < 0.5 else " ").join(rnd.choice(pieces) for _ in range(rnd.randint(1, 12)))
            for _ in range(n)]


def tokenizer_files(tmp_path, demo_path, exports):
    """Every GGUF the tests build or ship: the demo, its exports, the tiny llama/gemma3 files, Gemma-like `</s>`."""
    write_tiny_llama(tmp_path / "tiny.gguf", {})
    write_tiny_gemma3(tmp_path / "gemma.gguf")
    files = {"demo": demo_path, "tiny llama": tmp_path / "tiny.gguf", "tiny gemma3": tmp_path / "gemma.gguf"}
    files |= {f"export {t}": r.gguf for t, r in exports[1].items()}
    tokens, scores, types = gemma_vocab()
    files["gemma </s>"] = spm_vocab_file(tmp_path / "eos-text.gguf", tokens + ["</s>", "<b>"],
                                         scores + [0.0, 0.0], types + [4, 4])
    return files


def spm_vocab_file(path, tokens, scores, types, **ids):
    """A llama-architecture GGUF holding only an SPM vocabulary (llama.cpp loads it with vocab_only)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 64), ("embedding_length", 32), ("block_count", 1),
                       ("feed_forward_length", 64), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    for key, value in ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.slow
def test_tokenization_equals_llama_cpp_on_every_gguf(tmp_path, demo_path, exports, log):
    for name, path in tokenizer_files(tmp_path, demo_path, exports).items():
        md, _ = __import__("dtrain.models.gguf", fromlist=["read_gguf"]).read_gguf(Path(path))
        ours = build_tokenizer(md)
        llm = llama(path, log, vocab_only=True)
        specials = [t for t in md["tokenizer.ggml.tokens"] if t in va.EOG_TEXTS or t.startswith("<|")][:40]
        checked = 0
        for text in strings(specials, seed=len(name)):
            for special in (False, True):
                want = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
                got = ours(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"]
                assert got == want, (name, text, special)
                checked += 1
        print(f"{name}: {checked} tokenizations equal to llama.cpp's")


def library_token_texts() -> list:
    """Token-like strings compiled into llama.cpp's library (``<...>``, ``[...]``, ``<|...|>`` ...)."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    texts = set()
    for so in lib.glob("libllama*.so*"):
        for raw in re.findall(rb"[\x21-\x7e\xc2-\xf4\x80-\xbf]{3,40}", so.read_bytes()):
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            # the linker keeps "<EOT>" only inside "_<EOT>": every tail that opens a bracket counts too
            for j, c in enumerate(s):
                tail = s[j:]
                if (j == 0 or c in "<[") and tail[0] in "<[_▁" and tail[-1] in ">][" and len(tail) >= 3 \
                        and "%" not in tail and "::" not in tail:
                    texts.add(tail)
    return sorted(texts)


@pytest.mark.slow
def test_token_attributes_equal_llama_cpps_for_every_text_in_its_library(tmp_path, log):
    texts = library_token_texts()
    known = set(va.EOG_TEXTS) | {t for group in va.FOUND_BY_TEXT.values() for t in group}
    assert known <= set(texts), known - set(texts)  # the scan finds what vocab_attrs knows
    tokens, scores, types = gemma_vocab()
    checked = 0
    for i, text in enumerate(sorted(set(texts) - set(tokens))):  # a text twice in a vocabulary aborts llama.cpp
        for kind in (1, 4):  # NORMAL, USER_DEFINED in the file
            path = spm_vocab_file(tmp_path / f"v{i}-{kind}.gguf", tokens + [text], scores + [0.0], types + [kind])
            llm = llama(path, log, vocab_only=True)
            want = llama_cpp.llama_vocab_get_attr(llama_cpp.llama_model_get_vocab(llm.model), len(tokens))
            md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens + [text],
                  "tokenizer.ggml.token_type": types + [kind], "tokenizer.ggml.eos_token_id": 1}
            got = va.token_attrs(md)[0][len(tokens)]
            mask = va.CONTROL | va.USER_DEFINED | va.NORMAL
            assert got & mask == want & mask, (text, kind, got, want)
            checked += 1
    print(f"{checked} token texts from llama.cpp's library: attributes equal")


COMBINATIONS = [  # (added texts, their file types, ids the file names): the rules that look at several tokens
    (["<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|start|>"], [3, 3, 3, 3, 3], {}),
    (["<|end|>", "<|call|>"], [1, 1], {}),
    (["<|end|>", "<|calls|>", "<|flush|>"], [3, 3, 3], {}),
    (["</s>", "<turn|>", "<|tool_response>"], [4, 1, 3], {}),
    (["</s>", "<b>"], [4, 4], {}),
    (["<|fim_prefix|>", "<|fim_pad|>", "<|file_sep|>"], [1, 1, 1], {}),
    (["<|fim_prefix|>", "<|fim_pad|>", "<|im_end|>"], [1, 1, 1], {"fim_pre": 0, "fim_pad": 0, "eot": 5}),
]


@pytest.mark.slow
@pytest.mark.parametrize("n", range(len(COMBINATIONS)))
def test_rules_over_several_tokens_equal_llama_cpps(tmp_path, log, n):
    added, kinds, ids = COMBINATIONS[n]
    tokens, scores, types = gemma_vocab()
    path = spm_vocab_file(tmp_path / "v.gguf", tokens + added, scores + [0.0] * len(added), types + kinds, **ids)
    llm = llama(path, log, vocab_only=True)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens + added, "tokenizer.ggml.token_type":
          types + kinds, "tokenizer.ggml.eos_token_id": 1, **{f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()}}
    attrs, eog = va.token_attrs(md)
    mask = va.CONTROL | va.USER_DEFINED | va.NORMAL
    for i in range(len(tokens) + len(added)):
        assert attrs[i] & mask == llama_cpp.llama_vocab_get_attr(vocab, i) & mask, (i, md["tokenizer.ggml.tokens"][i])
        assert (i in eog) == bool(llama_cpp.llama_vocab_is_eog(vocab, i)), (i, md["tokenizer.ggml.tokens"][i])
