"""GGUF loading against mlx-lm built from the same weights, on tiny files written here.

The writers follow llama.cpp's convert_hf_to_gguf.py: llama Q/K rows permuted
(``LlamaModel.permute``), gemma3 norm weights stored as ``w + 1``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import CHATML, make_tiny_model, make_tokenizer, tiny_llama_args
from mlx.utils import tree_flatten

from dtrain.errors import ModelError
from dtrain.models import convert_gguf, load_model
from dtrain.models.gguf import gguf_to_mlx
from dtrain.models.load import build_gguf_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
_LLAMA_LAYER = {**_LAYER, "post_attention_layernorm": "ffn_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str, layer_map: dict) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{suffix}"
    _, _, n, rest = module.split(".", 3)
    return f"blk.{n}.{layer_map[rest]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(writer, hf_tok, pre: str = "gpt-2", chat_template: str | None = CHATML) -> None:
    """gpt2-style vocabulary (tokens, merges, types) of a byte-level BPE tokenizer (None: no chat template)."""
    spec = json.loads(hf_tok.backend_tokenizer.to_str())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)  # "gpt-2": the source tokenizer's ByteLevel regex is GPT-2's
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of a block's float16 d (and dmin): ggml-common.h


def k_quant(shape: tuple, qtype, seed: int = 0) -> np.ndarray:
    """Random ``shape`` blocks of a K-quant type with small scales (gguf-py cannot quantize to these types)."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(seed).integers(0, 256, size=(shape[0] * shape[1] // 256, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return blocks.reshape(shape[0], -1)


def write_tiny_llama(path, quant: dict, rope_freqs=None, pre="gpt-2", extra=(), alignment=None, chat_template=CHATML,
                     **over) -> dict:
    """A 4-layer llama GGUF; returns the HF-layout float32 weights it encodes.

    ``quant`` maps GGUF tensor names to a GGML type; those tensors are quantized
    and the returned reference holds their dequantized values. ``extra``:
    ``(writer method, key, value)`` triples for more metadata; ``alignment``:
    ``general.alignment`` (None: the format's default 32); ``chat_template``: None for a base without one.
    """
    model = make_tiny_model("llama", seed=1, **over)
    args = model.args
    ref = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_context_length(128)
    w.add_embedding_length(args.hidden_size)
    w.add_block_count(args.num_hidden_layers)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    tokenizer_metadata(w, make_tokenizer()._tokenizer, pre, chat_template)
    for method, key, value in extra:
        getattr(w, method)(key, value)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for name, value in ref.items():
        stored = value
        if ".q_proj." in name:  # llama.cpp permutes q/k biases too
            stored = llama_cpp_permute(value, args.num_attention_heads)
        elif ".k_proj." in name:
            stored = llama_cpp_permute(value, args.num_key_value_heads)
        tname = gguf_name(name, _LLAMA_LAYER)
        if tname in quant:
            kind = quant[tname]
            packed = k_quant(stored.shape, kind) if kind in K_QUANT_SCALES else gguf.quants.quantize(stored, kind)
            w.add_tensor(tname, packed, raw_dtype=quant[tname])
            ref[name] = gguf.quants.dequantize(packed, quant[tname])
            if "q_proj" in name or "k_proj" in name:  # back to HF row order
                n = args.num_attention_heads if "q_proj" in name else args.num_key_value_heads
                ref[name] = ref[name].reshape(n, -1, 2, ref[name].shape[1]).swapaxes(1, 2).reshape(value.shape)
        else:
            w.add_tensor(tname, stored)
    _finish(w)
    return ref


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_refused(path, message: str, tmp_path, capsys) -> None:
    """load_model and ``dtrain convert`` both refuse the GGUF ``path`` with ``message``, and convert writes nothing."""
    from dtrain.cli import main

    with pytest.raises(ModelError) as err:
        load_model(str(path))
    assert str(err.value) == message
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {message}\n"
    assert not (tmp_path / "out").exists()


def reference_logits(module_name: str, args, weights: dict, tokens: mx.array) -> np.ndarray:
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.{module_name}")
    model = mod.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return np.array(model(tokens))


TOKENS = mx.array([[1, 3, 40, 7, 300, 511, 2, 99, 100, 4]])


@pytest.mark.parametrize(
    "quant",
    [
        {},
        {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_0, "token_embd.weight": Q.Q8_0,
         "blk.2.ffn_up.weight": Q.Q4_1},
        {"blk.0.attn_q.weight": Q.Q5_0, "blk.3.ffn_down.weight": Q.Q5_1},  # mx.load rejects these
        {"blk.0.attn_k.weight": Q.BF16, "token_embd.weight": Q.BF16},  # mx.load narrows these to float16
    ],
    ids=["f32", "q8_q4_kept_by_mx_load", "q5_via_gguf_reader", "bf16_read_exactly"],
)
def test_llama_gguf_logits_equal_mlx_lm_on_original_weights(tmp_path, quant):
    path = tmp_path / "tiny.gguf"
    ref = write_tiny_llama(path, quant)
    loaded = load_model(str(path), dtype="float32")
    expected = reference_logits("llama", make_tiny_model("llama").args, ref, TOKENS)
    np.testing.assert_allclose(np.array(loaded.model(TOKENS)), expected, rtol=1e-5, atol=1e-5)
    assert loaded.config["model_type"] == "llama" and loaded.config["tie_word_embeddings"] is True
    assert loaded.identity.startswith("gguf-sha256:")


def test_k_quant_tensors_are_dequantized_as_gguf_does(tmp_path):
    """mx.load accepts Q4_K and Q6_K tensors (a Q4_K_M file's types) but narrows them to float16, and decodes
    Q4_K wrongly (values off by up to the tensor's range): a Q4_K_M GGUF was trained on other weights than
    llama.cpp runs. Files with such tensors are now read with gguf's dequantization, which is ggml's."""
    path = tmp_path / "k.gguf"
    quant = {"blk.0.ffn_down.weight": Q.Q4_K, "blk.1.ffn_down.weight": Q.Q6_K}
    ref = write_tiny_llama(path, quant, intermediate_size=256)  # K-quant rows hold 256-value blocks
    weights = gguf_to_mlx(path).weights
    for n in (0, 1):
        name = f"model.layers.{n}.mlp.down_proj.weight"
        np.testing.assert_array_equal(np.array(weights[name]), ref[name])
    expected = reference_logits("llama", tiny_llama_args(intermediate_size=256), ref, TOKENS)
    np.testing.assert_allclose(np.array(load_model(str(path), dtype="float32").model(TOKENS)), expected,
                               rtol=1e-5, atol=1e-5)


def test_llama3_rope_freqs_become_mlx_lm_rope_scaling(tmp_path):
    from mlx_lm.models.rope_utils import Llama3RoPE

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base, head_dim = 500000.0, 8  # wavelengths 6 .. 7e4: short, medium and long ones
    rope = Llama3RoPE(head_dim, base=base, scaling_config=scaling)
    factors = np.array(rope._freqs / base ** (mx.arange(0, head_dim, 2) / head_dim), dtype=np.float32)
    assert factors[0] == 1.0 and factors[-1] == pytest.approx(8.0) and 1 < factors[-2] < 8
    path = tmp_path / "llama3.gguf"
    ref = write_tiny_llama(path, {}, rope_freqs=factors, rope_theta=base)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config["rope_scaling"] == pytest.approx(scaling)
    args = make_tiny_model("llama", rope_theta=base, rope_scaling=scaling, max_position_embeddings=128).args
    tokens = mx.array([list(range(1, 200, 7))])
    np.testing.assert_allclose(np.array(loaded.model(tokens)), reference_logits("llama", args, ref, tokens),
                               rtol=1e-5, atol=1e-5)


def test_gguf_gpt2_tokenizer_equals_source_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})
    tok = load_model(str(path)).tokenizer
    source = make_tokenizer()
    for text in ["The quick brown fox, 0123!", "Héllo wörld — ça?", "def f(x):\n    return x + 1"]:
        assert tok.encode(text) == source.encode(text)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 3
    assert tok.encode("hi")[0] == 1  # add_bos_token
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_named_chat_templates_of_a_gguf_reach_the_tokenizer_and_the_converted_folder(tmp_path):
    """convert_hf_to_gguf.py writes a model's other templates as tokenizer.chat_template.<name> (listed in
    tokenizer.chat_templates); only the default one was read, so a converted folder lost tool_use."""
    from transformers import AutoTokenizer

    tools = "TOOLS " + CHATML
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {}, extra=[("add_array", "tokenizer.chat_templates", ["tool_use"]),
                                      ("add_string", "tokenizer.chat_template.tool_use", tools)])
    assert load_model(str(path)).tokenizer.chat_template == {"default": CHATML, "tool_use": tools}
    convert_gguf(str(path), str(tmp_path / "out"))
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template
    assert saved == {"default": "{{ bos_token }}" + CHATML, "tool_use": "{{ bos_token }}" + tools}  # adds BOS


def test_gguf_tokenizer_prints_no_transformers_advice(tmp_path):
    """`dtrain data check` on a GGUF model imports transformers before mlx_lm (which silences its
    advisories): without torch, transformers then printed "PyTorch was not found. Models won't be
    available" on a model that loads fine."""
    import os

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    code = f"from dtrain.models import load_model; print(load_model({str(path)!r}).tokenizer.encode('hi'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(make_tokenizer().encode("hi"))
    assert "PyTorch" not in r.stderr and "transformers" not in r.stderr, r.stderr


def test_convert_and_export_name_a_file_where_the_folder_should_be(tmp_path, capsys):
    """An output path that is a file, or under one, was 'already exists and is not empty' or
    mkdir's bare 'could not write X: File exists'; a folder given as the GGUF was 'no such GGUF file'."""
    from dtrain.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out, message in [(notes, f"{notes} is a file, not a folder; choose a new folder"),
                         (notes / "sub", f"{notes / 'sub'} is under {notes}, a file, not a folder; choose a new folder"),
                         ("", "the output folder is empty text; name a new folder")]:
        with pytest.raises(ModelError) as err:
            convert_gguf(str(path), str(out))
        assert str(err.value) == message
        assert main(["export", str(tmp_path), "--base", str(path), "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"dtrain: error: {message}\n"
    with pytest.raises(ModelError) as err:
        convert_gguf(str(tmp_path), str(tmp_path / "out"))
    assert str(err.value) == (f"{tmp_path}: a folder, not a GGUF file (a model folder is already what convert writes)"
                              "; it holds the GGUF file tiny.gguf: give that file")
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "tiny.gguf"]



@pytest.mark.parametrize("out", [".", "../here"])
def test_convert_and_export_into_the_empty_current_folder_are_refused_in_one_line(tmp_path, monkeypatch, capsys, out):
    """`--out .` in an empty folder ended in "could not write .: Device or resource busy" once the merge was done,
    and `--out ../here` from inside it replaced the folder the shell stood in (its shell then in a removed one)."""
    from dtrain.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    message = f"{out} is the current folder, which the output would replace; name a new folder (e.g. {out}/merged)"
    with pytest.raises(ModelError) as err:
        convert_gguf(str(path), out)
    assert str(err.value) == message
    assert main(["export", str(tmp_path), "--base", str(path), "--out", out]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "tiny.gguf"] and not any((tmp_path / "here").iterdir())


def test_convert_into_a_link_to_an_empty_folder_writes_the_folder_it_names(tmp_path):
    """An --out that is a symlink to an empty folder (on another disk) was replaced by a new folder beside it, the
    link set aside as a hidden .out.old-PID and the folder it names left empty."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "disk")
    convert_gguf(str(path), str(tmp_path / "out"))
    assert (tmp_path / "out").is_symlink() and (tmp_path / "disk" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "out", "tiny.gguf"]


def test_convert_into_a_symlink_loop_is_one_line(tmp_path, capsys):
    """An --out that is a symlink loop ended convert in pathlib's 'RuntimeError: Symlink loop' traceback."""
    from dtrain.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})
    (tmp_path / "out").symlink_to("out")
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: could not write {tmp_path / 'out'}: Too many levels of "
                                       "symbolic links; nothing was left there\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_convert_tiny_llama_loads_in_mlx_lm_with_same_logits(tmp_path):
    from mlx_lm import load

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_gate.weight": Q.Q4_0})
    out = convert_gguf(str(path), str(tmp_path / "converted"))
    model, tok = load(str(out))
    loaded = load_model(str(path), dtype="float32")
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(loaded.model(TOKENS)), rtol=1e-5, atol=1e-5)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>"
    assert tok.encode(text) == loaded.tokenizer.encode(text)
    assert tok.chat_template == "{{ bos_token }}" + CHATML  # the GGUF adds BOS; mlx-lm's chat prompts add none
    hi = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(hi, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered, add_special_tokens=False) == loaded.tokenizer.encode(
        loaded.tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True))
    with pytest.raises(ModelError, match="output folder already exists and is not empty"):
        convert_gguf(str(path), str(out))
    cli = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "3"]
    assert subprocess.run(cli, capture_output=True, text=True).returncode == 0


def test_keep_quantized_builds_per_module_bits(tmp_path):
    import mlx.nn as nn

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_1})
    model, config = build_gguf_model(gguf_to_mlx(path), keep_quantized=True, float_dtype=mx.float32)
    q_proj, k_proj = model.model.layers[0].self_attn.q_proj, model.model.layers[1].self_attn.k_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (8, 32)
    assert isinstance(k_proj, nn.QuantizedLinear) and k_proj.bits == 4
    assert isinstance(model.model.layers[0].self_attn.k_proj, nn.Linear)
    assert config["quantization"]["model.layers.1.self_attn.k_proj"] == {"group_size": 32, "bits": 4}
    dense = load_model(str(path), dtype="float32").model
    np.testing.assert_allclose(np.array(model(TOKENS)), np.array(dense(TOKENS)), rtol=1e-4, atol=1e-4)


def test_llama_gguf_with_bias_tensors_loads_and_converts_with_the_same_logits(tmp_path, monkeypatch):
    """llama.cpp's llama reads attn_q/k/v/output and ffn biases as optional tensors; dtrain built the model
    without biases and stopped with mlx-lm's 'Received 24 parameters not in model' traceback. Here q/k/v and
    the MLP have biases and attn_output has none (a zero bias in mlx-lm's attention_bias model)."""
    add = gguf.GGUFWriter.add_tensor
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", lambda self, name, *a, **k: None if name.endswith(
        "attn_output.bias") else add(self, name, *a, **k))
    path = tmp_path / "bias.gguf"
    ref = write_tiny_llama(path, {}, attention_bias=True, mlp_bias=True)
    for name in [n for n in ref if n.endswith("o_proj.bias")]:
        ref[name] = np.zeros_like(ref[name])
    expected = reference_logits("llama", tiny_llama_args(attention_bias=True, mlp_bias=True), ref, TOKENS)
    np.testing.assert_allclose(np.array(load_model(str(path), dtype="float32").model(TOKENS)), expected,
                               rtol=1e-5, atol=1e-5)
    from mlx_lm.utils import load

    convert_gguf(str(path), str(tmp_path / "out"))
    np.testing.assert_allclose(np.array(load(str(tmp_path / "out"))[0](TOKENS)), expected, rtol=1e-5, atol=1e-5)


def test_end_tokens_are_those_llama_cpp_ends_generation_at(tmp_path):
    """A Llama 3.1 GGUF names only <|eot_id|> as EOS; llama.cpp (and the HF model's config, [128001, 128008,
    128009]) also end at <|end_of_text|> and <|eom_id|>. The tokenizer and convert's config.json held the EOS
    (and EOT) id alone, so mlx-lm generated on past the other two."""
    from mlx_lm.utils import load

    from dtrain.models.tokenizer import eos_token_ids

    tokens = ["a", "b", "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [1, 1, 3, 3, 3, 3], "tokenizer.ggml.bos_token_id": 2,
          "tokenizer.ggml.eos_token_id": 5}
    assert eos_token_ids(md) == [3, 4, 5]
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {})  # names </s> (2) as EOS; llama.cpp ends at <|im_end|> (4) by its text too
    assert load_model(str(path)).tokenizer.eos_token_ids == {2, 4}
    convert_gguf(str(path), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == [2, 4]
    assert load(str(tmp_path / "out"))[1].eos_token_ids == {2, 4}


# ---------------------------------------------------------------- gemma3


def gemma_vocab():
    """SentencePiece-style vocabulary: specials, 256 byte tokens, scored pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "he", "ll", "▁he", "llo", "▁hello", "▁t", "▁the"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


def write_tiny_gemma3(path) -> tuple:
    from mlx_lm.models import gemma3_text

    tokens, scores, types = gemma_vocab()
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=32, num_hidden_layers=6, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=len(tokens), rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=16, sliding_window=4, sliding_window_pattern=6, max_position_embeddings=128,
    )
    rng = np.random.default_rng(0)
    model = gemma3_text.Model(args)
    ref = {k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in tree_flatten(model.parameters())}
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_block_count(6)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_uint32("tokenizer.ggml.eot_token_id", 5)
    for name, value in ref.items():
        stored = value + 1.0 if name.endswith("norm.weight") else value  # llama.cpp norm_shift
        w.add_tensor(gguf_name(name, _LAYER), stored.astype(np.float16 if "mlp" in name else np.float32))
        if "mlp" in name:
            ref[name] = stored.astype(np.float16).astype(np.float32)
    _finish(w)
    return args, ref


def test_gemma3_gguf_logits_equal_mlx_lm_gemma3_text(tmp_path):
    path = tmp_path / "gemma.gguf"
    args, ref = write_tiny_gemma3(path)
    tokens = mx.array([[2, 4, 270, 281, 290, 5, 7, 100, 200, 294, 295, 1]])  # 12 > sliding_window
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config["model_type"] == "gemma3_text"
    expected = reference_logits("gemma3_text", args, ref, tokens)
    np.testing.assert_allclose(np.array(loaded.model(tokens)), expected, rtol=1e-5, atol=1e-5)


def test_gemma3_spm_tokenizer_merges_by_score_and_falls_back_to_bytes(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_tiny_gemma3(path)
    tok = load_model(str(path)).tokenizer
    tokens = gemma_vocab()[0]
    ids = tok.encode("hello the")
    assert [tokens[i] for i in ids] == ["<bos>", "he", "llo", "▁the"]
    ids = tok.encode("é<end_of_turn>", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["<0xC3>", "<0xA9>", "<end_of_turn>"]
    assert tok.decode(tok.encode("hello the é", add_special_tokens=False)) == "hello the é"
    assert tok.eos_token_ids == {1, 5}


# ---------------------------------------------------------------- errors


def test_corrupt_gguf_is_a_model_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelError, match=r"broken\.gguf: not a readable GGUF file"):
        load_model(str(path))


def test_a_gguf_cut_short_says_so(tmp_path, capsys):
    """An incomplete download was reported in numpy's terms: 'not a readable GGUF file (ValueError: cannot reshape
    array of size 1496 into shape (64,32))', '(... When changing to a larger dtype, its size must be a divisor ...)'."""
    whole = tmp_path / "whole.gguf"
    write_tiny_llama(whole, {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_0})
    data = whole.read_bytes()
    path = tmp_path / "cut.gguf"
    for cut, detail in [(len(data) - 1, f"{len(data) - 1} bytes, but its tensors end at byte {len(data)}"),
                        (len(data) // 2, f"{len(data) // 2} bytes, but its tensors end at byte {len(data)}"),
                        (1000, "its 1000 bytes end inside the header"), (4, "its 4 bytes end inside the header")]:
        path.write_bytes(data[:cut])
        message = f"{path}: not a readable GGUF file (cut short: {detail}; an incomplete download?)"
        assert_refused(path, message, tmp_path, capsys)


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_a_gguf_alignment_that_is_no_power_of_two_is_one_line(tmp_path, capsys, alignment):
    """general.alignment 0 ended load and convert in ZeroDivisionError's traceback; 3 or 48, which llama.cpp refuses
    ('alignment is not a power of 2'), loaded with exit 0 (3: tensors read from shifted offsets, NaN weights)."""
    import struct

    path = tmp_path / "aligned.gguf"
    write_tiny_llama(path, {}, alignment=64)
    data = path.read_bytes()
    at = data.index(b"general.alignment") + len(b"general.alignment")
    assert struct.unpack("<II", data[at:at + 8]) == (4, 64)  # uint32 type, value
    path.write_bytes(data[:at + 4] + struct.pack("<I", alignment) + data[at + 8:])
    message = (f"{path}: GGUF key 'general.alignment' = {alignment} is not supported (llama.cpp requires a power "
               "of 2)")
    assert_refused(path, message, tmp_path, capsys)


@pytest.mark.parametrize("ttype, problem", [
    (Q.Q8_1, "is Q8_1, a type dtrain cannot read (the gguf package does not dequantize it)"),
    (Q.F64, "is F64, a type dtrain cannot read (the gguf package does not dequantize it)"),
    (99, "has GGML type 99, which the installed gguf package does not know"),
])
def test_a_tensor_type_dtrain_cannot_read_is_named_with_its_tensor(tmp_path, capsys, ttype, problem):
    """Such files were 'not a readable GGUF file (NotImplementedError: Dequantization for Q8_1 is not yet
    implemented)' or '(ValueError: np.uint32(99) is not a valid GGMLQuantizationType)': no tensor named."""
    import struct

    path = tmp_path / "typed.gguf"
    write_tiny_llama(path, {"blk.0.attn_v.weight": Q.Q8_0})
    data = path.read_bytes()
    at = data.index(b"blk.0.attn_v.weight") + len(b"blk.0.attn_v.weight")
    at += 4 + 8 * struct.unpack("<I", data[at:at + 4])[0]  # past n_dims and the dims: the type
    assert struct.unpack("<I", data[at:at + 4]) == (Q.Q8_0,)
    path.write_bytes(data[:at] + struct.pack("<I", ttype) + data[at + 4:])
    message = f"{path}: tensor 'blk.0.attn_v.weight' {problem}"
    assert_refused(path, message, tmp_path, capsys)


@pytest.mark.parametrize("field, at", [("tensor count", 8), ("metadata count", 16)])
def test_a_gguf_header_count_past_its_entries_is_a_model_error(tmp_path, field, at):
    """A damaged header whose tensor or metadata count runs past its entries read a length from the data
    that followed as a key's or name's: f.read(2**60) ended in MemoryError's traceback."""
    import struct

    path = tmp_path / "damaged.gguf"
    write_tiny_llama(path, {})
    data = path.read_bytes()
    path.write_bytes(data[:at] + struct.pack("<Q", 1 << 60) + data[at + 8:])
    with pytest.raises(ModelError, match=r"damaged\.gguf: not a readable GGUF file"):
        load_model(str(path))


def test_unsupported_gguf_architecture_is_a_model_error(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(w)
    with pytest.raises(ModelError, match=r"phi\.gguf: GGUF architecture 'phi3' is not supported"):
        load_model(str(path))


def test_a_gguf_architecture_of_another_kind_is_one_line(tmp_path, capsys):
    """general.architecture as a list ended convert and load in 'TypeError: unhashable type: 'list''."""
    path = tmp_path / "listed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_key_value("general.architecture", ["llama"], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(w)
    assert_refused(path, f"{path}: GGUF architecture ['llama'] is not supported (supported: llama, gemma3); convert "
                         "the original Hugging Face model with mlx_lm instead", tmp_path, capsys)


@pytest.mark.parametrize(
    "extra, message",
    [
        ([("add_float32", "llama.attention.max_alibi_bias", 8.0)],
         r"GGUF key 'llama\.attention\.max_alibi_bias' is not supported \(it may change the model\)"),
        ([("add_uint32", "llama.rope.dimension_count", 4)],
         r"GGUF key 'llama\.rope\.dimension_count' = 4 is not supported \(expected 8\)"),
        ([("add_string", "llama.rope.scaling.type", "yarn")], r"GGUF rope scaling 'yarn' is not supported"),
        ([("add_uint32", "llama.expert_count", 8)], r"GGUF key 'llama\.expert_count' = 8 is not supported"),
    ],
    ids=["alibi", "partial_rotary", "yarn", "experts"],
)
def test_model_metadata_we_do_not_reproduce_is_refused_by_name(tmp_path, extra, message):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {}, extra=extra)
    with pytest.raises(ModelError, match=r"tiny\.gguf: " + message):
        load_model(str(path))


@pytest.mark.parametrize("method, value, message", [
    ("add_block_count", "four", "GGUF key 'llama.block_count' = 'four' is not supported (expected a number above 0)"),
    ("add_head_count_kv", [2, 2, 2, 2],  # per-layer values, which llama.cpp's get_key_or_arr also reads
     "GGUF key 'llama.attention.head_count_kv' = [2, 2, 2, 2] is not supported (expected a number above 0)"),
    ("add_head_count", 0, "GGUF key 'llama.attention.head_count' = 0 is not supported (expected a number above 0)"),
    ("add_layer_norm_rms_eps", "1e-5",
     "GGUF key 'llama.attention.layer_norm_rms_epsilon' = '1e-5' is not supported (expected a number above 0)"),
    ("add_head_count", 3, "GGUF key 'llama.attention.head_count' = 3 does not fit "
     "model.layers.0.self_attn.q_proj.weight: its 32 rows are not 3 heads of an even size"),
    # a float32 NaN or inf: written with exit 0 as a model whose logits are NaN, or int()'s OverflowError
    ("add_layer_norm_rms_eps", float("nan"),
     "GGUF key 'llama.attention.layer_norm_rms_epsilon' = nan is not supported (expected a number above 0)"),
    ("add_block_count", float("inf"), "GGUF key 'llama.block_count' = inf is not supported (expected a number above 0)"),
], ids=["text", "per_layer_list", "zero_heads", "text_eps", "heads_not_dividing_rows", "nan_eps", "inf_count"])
def test_a_model_key_of_another_kind_or_size_is_one_line_naming_it(tmp_path, monkeypatch, capsys, method, value,
                                                                     message):
    """int()'s ValueError or TypeError, a ZeroDivisionError or MLX's reshape error ended convert and load in a
    traceback."""
    from dtrain.cli import main

    key = {"add_block_count": "llama.block_count", "add_head_count": "llama.attention.head_count",
           "add_head_count_kv": "llama.attention.head_count_kv",
           "add_layer_norm_rms_eps": "llama.attention.layer_norm_rms_epsilon"}[method]
    kind = gguf.GGUFValueType.get_type(value)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, _: self.add_key_value(
        key, value, kind, gguf.GGUFValueType.UINT32 if isinstance(value, list) else None))
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {})
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {path}: {message}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, value, problem", [
    ("add_token_types", [1, 1, 3], "tokenizer.ggml.token_type has 3 entries for 361 tokens"),
    ("add_token_merges", ["Ġt he"], "tokenizer.ggml.merges do not fit tokenizer.ggml.tokens (Error while "
                                    "initializing BPE: Token `Ġt` out of vocabulary)"),
    ("add_token_merges", ["Ġthe"], "tokenizer.ggml.merges do not fit tokenizer.ggml.tokens (merge 'Ġthe' is not two "
                                   "pieces with a space between)"),
], ids=["short_token_types", "merge_of_unknown_pieces", "merge_without_space"])
def test_tokenizer_lists_that_do_not_fit_the_tokens_are_one_line(tmp_path, monkeypatch, capsys, method, value,
                                                                   problem):
    """vocab_attrs' IndexError, tokenizers' TypeError or bare Exception ended convert and load in a traceback."""
    from dtrain.cli import main

    write = getattr(gguf.GGUFWriter, method)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, _: write(self, value))
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {})
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: {path}: cannot build the tokenizer from GGUF metadata: "
                                       f"{problem}\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method, problem", [
    ("add_token_merges", "the GGUF file has no tokenizer.ggml.merges, which a gpt2 vocabulary merges by"),
    ("add_tokenizer_model", "the GGUF file has no tokenizer.ggml.model (supported: gpt2, llama)"),
])
def test_a_missing_tokenizer_key_is_named_as_missing(tmp_path, monkeypatch, method, problem):
    """No merges ended in a bare key ('cannot build the tokenizer from GGUF metadata: 'tokenizer.ggml.merges''), no
    model in 'tokenizer.ggml.model None is not supported'."""
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, *args: None)
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {})
    with pytest.raises(ModelError) as err:
        load_model(str(path))
    assert str(err.value) == f"{path}: cannot build the tokenizer from GGUF metadata: {problem}"


def test_a_sentencepiece_vocabulary_without_scores_is_named(tmp_path):
    from dtrain.models.tokenizer import build_tokenizer

    tokens, _, types = gemma_vocab()
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    with pytest.raises(ValueError, match=r"^the GGUF file has no tokenizer\.ggml\.scores, which a llama vocabulary "
                                         r"merges by$"):
        build_tokenizer(md)


@pytest.mark.parametrize("method, value, problem", [
    ("add_eos_token_id", "2", "GGUF key 'tokenizer.ggml.eos_token_id' = '2' is not supported (expected a token id)"),
    ("add_bos_token_id", 1.0, "GGUF key 'tokenizer.ggml.bos_token_id' = 1.0 is not supported (expected a token id)"),
    ("add_add_bos_token", "false", "GGUF key 'tokenizer.ggml.add_bos_token' = 'false' is not supported (expected true "
                                   "or false)"),
], ids=["eos_id_text", "bos_id_float", "add_bos_text"])
def test_a_tokenizer_id_or_flag_of_another_kind_is_one_line(tmp_path, monkeypatch, capsys, method, value, problem):
    """An id as text or a float ended convert and load in TypeError's traceback ('<=' not supported between
    instances of 'int' and 'str'; list indices must be integers), and add_bos_token 'false' added BOS (bool('false')),
    where llama.cpp refuses a key of the wrong type."""
    kind = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32}[type(value)]
    key = {"add_eos_token_id": "tokenizer.ggml.eos_token_id", "add_bos_token_id": "tokenizer.ggml.bos_token_id",
           "add_add_bos_token": "tokenizer.ggml.add_bos_token"}[method]
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, _: self.add_key_value(key, value, kind))
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {})
    assert_refused(path, f"{path}: cannot build the tokenizer from GGUF metadata: {problem}", tmp_path, capsys)


@pytest.mark.parametrize("key, value, kind, problem", [
    ("tokenizer.ggml.tokens", 5, "INT32", "= 5 is not supported (expected a list of texts)"),
    ("tokenizer.ggml.token_type", 2.5, "FLOAT32", "= 2.5 is not supported (expected a list of integers)"),
    ("tokenizer.ggml.merges", [1, 2], "INT32", "holds 1 at index 0, which is not supported (expected a list of texts)"),
    ("tokenizer.ggml.pre", ["gpt-2"], "STRING", "= ['gpt-2'] is not supported (expected a name)"),
], ids=["tokens_number", "token_type_float", "merges_of_numbers", "pre_list"])
def test_a_tokenizer_list_or_name_of_another_kind_is_one_line(tmp_path, monkeypatch, capsys, key, value, kind,
                                                               problem):
    """Such keys ended convert and load in a traceback: 'object of type 'int' has no len()', ''int' object has no
    attribute 'split'', 'unhashable type: 'list''."""
    add = gguf.GGUFWriter.add_key_value
    kind = gguf.GGUFValueType[kind]

    def replaced(self, k, v, vtype, *args, **kwargs):
        if k != key:
            return add(self, k, v, vtype, *args, **kwargs)
        if isinstance(value, list):
            return add(self, k, value, gguf.GGUFValueType.ARRAY, sub_type=kind)
        return add(self, k, value, kind)

    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", replaced)
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {})
    assert_refused(path, f"{path}: cannot build the tokenizer from GGUF metadata: GGUF key {key!r} {problem}",
                   tmp_path, capsys)


@pytest.mark.parametrize("key, value, held", [
    ("llama.block_count", 2**40, "4 layers"),
    ("llama.block_count", 5, "4 layers"),
    ("llama.embedding_length", 2**40, "32 values in a row of token_embd.weight"),
    ("llama.feed_forward_length", 2**40, "64 rows in blk.0.ffn_up.weight"),
], ids=["layers_huge", "layers_one_more", "width_huge", "ffn_huge"])
def test_a_model_size_the_tensors_do_not_have_is_one_line(tmp_path, monkeypatch, capsys, key, value, held):
    """A damaged 2**40 ended convert and load in MLX's 'OverflowError: Integer value 1099511627776 is outside the
    supported range' or a MemoryError, as the model was built before its tensors were compared."""
    add = gguf.GGUFWriter.add_key_value
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", lambda self, k, v, vtype, *args, **kwargs: add(
        self, k, *((value, gguf.GGUFValueType.UINT64) if k == key else (v, vtype)), *args, **kwargs))
    path = tmp_path / "sized.gguf"
    write_tiny_llama(path, {})
    assert_refused(path, f"{path}: GGUF key {key!r} = {value} does not fit the tensors, which hold {held}", tmp_path,
                   capsys)


@pytest.mark.parametrize("key, proj, rows", [("head_count", "q", 32), ("head_count_kv", "k", 16)])
def test_a_gemma3_head_count_the_tensors_do_not_have_is_one_line(tmp_path, monkeypatch, capsys, key, proj, rows):
    """gemma3.attention.head_count(_kv) 2**44 ended convert and load in MLX's 'OverflowError: Integer value
    281474976710656 is outside the supported range' (llama's heads are checked against the q/k rows already)."""
    add = gguf.GGUFWriter.add_key_value
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", lambda self, k, v, vtype, *args, **kwargs: add(
        self, k, *((2**44, gguf.GGUFValueType.UINT64) if k == f"gemma3.attention.{key}" else (v, vtype)), *args,
        **kwargs))
    path = tmp_path / "gemma.gguf"
    write_tiny_gemma3(path)
    assert_refused(path, f"{path}: GGUF keys 'gemma3.attention.{key}' = {2**44} and 'gemma3.attention.key_length' = "
                         f"16 do not fit the tensors: blk.0.attn_{proj}.weight has {rows} rows", tmp_path, capsys)


def test_a_vocabulary_larger_than_the_embedding_is_one_line(tmp_path, capsys):
    """361 tokens over a 300-row token_embd loaded and converted with exit 0; MLX does not bounds-check the
    embedding lookup, so ids 300..360 (plain English text reaches 357) read memory past it."""
    path = tmp_path / "short.gguf"
    write_tiny_llama(path, {}, vocab_size=300)
    message = (f"{path}: tokenizer.ggml.tokens holds 361 tokens but token_embd.weight has 300 rows, so ids 300 and "
               "above have no embedding")
    assert_refused(path, message, tmp_path, capsys)


def test_known_harmless_model_keys_are_accepted(tmp_path):
    path = tmp_path / "tiny.gguf"
    extra = [("add_uint32", "llama.rope.dimension_count", 8), ("add_uint32", "llama.vocab_size", 512),
             ("add_uint32", "llama.expert_count", 0)]
    write_tiny_llama(path, {}, extra=extra)
    assert load_model(str(path), dtype="float32").config["head_dim"] == 8


@pytest.mark.parametrize("pre", ["tekken", "deepseek-llm"])
def test_gguf_pre_tokenizer_is_implemented_or_refused_by_name(tmp_path, pre):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {}, pre=pre)
    if pre == "tekken":  # implemented: digits one by one, ignore_merges, BOS by default (add_bos_token is set)
        tok = load_model(str(path)).tokenizer
        assert tok.encode("2024", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "2024"]
        return
    with pytest.raises(ModelError, match=r"tiny\.gguf: cannot build the tokenizer from GGUF metadata: "
                                         r"tokenizer\.ggml\.pre 'deepseek-llm' is not implemented"):
        load_model(str(path))


def test_bf16_tensors_keep_values_float16_cannot_hold(tmp_path):
    from dtrain.models.gguf import read_gguf

    path = tmp_path / "bf16.gguf"
    values = np.array([[1e5, -3.7290156e-06, 1.0, -2.5e-30] * 8] * 2, dtype=np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(300)])  # metadata arrays are skipped
    w.add_tensor("a.weight", np.ones((3, 32), np.float32))
    w.add_tensor("b.weight", gguf.quants.quantize(values, Q.BF16), raw_dtype=Q.BF16)
    _finish(w)
    _, tensors = read_gguf(path)
    expected = gguf.quants.dequantize(gguf.quants.quantize(values, Q.BF16), Q.BF16)
    assert expected[0, 0] == 99840.0 and expected[0, 3] != 0  # beyond float16's range, below its subnormals
    np.testing.assert_array_equal(np.array(tensors["b.weight"]), expected)
    np.testing.assert_array_equal(np.array(tensors["a.weight"]), np.ones((3, 32)))


def test_converted_config_names_the_transformers_architecture(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (get_model_architecture) and vLLM pick the model class from
    config.json's architectures; a folder converted or exported from a GGUF had none ('Failed to detect model
    architecture')."""
    from transformers import AutoConfig

    for name, write, want in (("llama", lambda p: write_tiny_llama(p, {}), "LlamaForCausalLM"),
                              ("gemma", write_tiny_gemma3, "Gemma3ForCausalLM")):
        write(tmp_path / f"{name}.gguf")
        convert_gguf(str(tmp_path / f"{name}.gguf"), str(tmp_path / name))
        assert json.loads((tmp_path / name / "config.json").read_text())["architectures"] == [want]
        assert AutoConfig.from_pretrained(str(tmp_path / name)).architectures == [want]


@pytest.mark.parametrize("change, detail", [
    (lambda name, data: None if name == "blk.3.ffn_up.weight" else data,
     "Missing 1 parameters: model.layers.3.mlp.up_proj.weight."),
    (lambda name, data: data[:-2] if name == "blk.3.ffn_up.weight" else data,
     "Expected shape (64, 32) but received shape (62, 32) for parameter model.layers.3.mlp.up_proj.weight"),
])
def test_a_tensor_missing_or_misshapen_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, change, detail):
    """A GGUF whose tensors do not fit the model its metadata describes stopped with MLX's ValueError traceback."""
    add = gguf.GGUFWriter.add_tensor

    def add_changed(self, name, data, *args, **kwargs):
        if (data := change(name, data)) is not None:
            add(self, name, data, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_changed)
    write_tiny_llama(tmp_path / "bad.gguf", {})
    message = f"{tmp_path / 'bad.gguf'}: its tensors do not fit the llama model its metadata describes: {detail}"
    with pytest.raises(ModelError) as err:
        load_model(str(tmp_path / "bad.gguf"))
    assert str(err.value) == message
    from dtrain.cli import main

    assert main(["convert", str(tmp_path / "bad.gguf"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_a_gguf_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """A GGUF file without read permission (tested through open: root reads any file) ended in
    PermissionError's traceback from the tensor-type scan, which lets only a non-GGUF file through to
    gguf's reader."""
    from dtrain.models import gguf_bf16

    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_bf16, "open", refused, raising=False)
    monkeypatch.setattr(gguf, "GGUFReader", refused)
    with pytest.raises(ModelError) as err:
        load_model(str(path))
    assert str(err.value) == f"{path}: not a readable GGUF file (PermissionError: [Errno 13] Permission denied)"


def test_convert_reads_a_leading_tilde_as_the_home_folder(tmp_path, monkeypatch, capsys):
    """`dtrain convert '~/m.gguf' '~/out'` (a quoted ~, or a script's) said no such GGUF file, and a ~ out
    folder was written as a folder named '~' in the working folder, where model.path and export read ~ as home."""
    from dtrain.cli import main

    write_tiny_llama(tmp_path / "m.gguf", {})
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["convert", "~/m.gguf", "~/out"]) == 0
    assert capsys.readouterr().out.endswith(f"wrote mlx-lm model folder {tmp_path}/out\n")
    assert (tmp_path / "out" / "config.json").is_file() and list((tmp_path / "cwd").iterdir()) == []
    assert main(["convert", "~/m.gguf", "~nobody-here/out"]) == 2
    assert capsys.readouterr().err == "dtrain: error: out_dir ~nobody-here/out: no home folder for ~nobody-here\n"


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (0, "0"), ("six", "'six'"),
                                          (-1, "-1")], ids=["nan", "inf", "zero", "text", "negative"])
def test_a_gemma3_sliding_window_pattern_of_another_kind_is_one_line(tmp_path, monkeypatch, capsys, value, shown):
    """gemma3.attention.sliding_window_pattern was read past the checks of the other keys: a NaN, an inf or a text
    ended convert in int()'s traceback, a 0 in a ZeroDivisionError and a -1 was converted into a model whose layers
    all slide."""
    from dtrain.cli import main

    add_sliding_window = gguf.GGUFWriter.add_sliding_window
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window", lambda self, v: (add_sliding_window(self, v), (
        self.add_key_value("gemma3.attention.sliding_window_pattern", value, gguf.GGUFValueType.get_type(value)))))
    path = tmp_path / "gemma.gguf"
    write_tiny_gemma3(path)
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: {path}: GGUF key 'gemma3.attention.sliding_window_pattern' = "
                                       f"{shown} is not supported (expected a number above 0)\n")
    assert not (tmp_path / "out").exists()


def test_a_gemma3_per_layer_sliding_pattern_that_does_not_repeat_is_refused(tmp_path, monkeypatch, capsys):
    """A per-layer list was read as its first period: [T, T, F, T, T, T] over 6 layers loaded and converted with
    layers 2 and 5 global (period 3), where the file makes layer 2 the only one; a list of 4 flags for 6 layers too."""
    from dtrain.cli import main

    add_sliding_window = gguf.GGUFWriter.add_sliding_window
    flags = []
    monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window", lambda self, v: (add_sliding_window(self, v), (
        self.add_array("gemma3.attention.sliding_window_pattern", flags))))
    path = tmp_path / "gemma.gguf"
    tokens = mx.array([[2, 4, 270, 281, 290, 5, 7, 100, 200, 294, 295, 1]])
    flags[:] = [True] * 5 + [False]  # the default period of 6, one flag per layer: as the number 6
    args, ref = write_tiny_gemma3(path)
    np.testing.assert_allclose(np.array(load_model(str(path), dtype="float32").model(tokens)),
                               reference_logits("gemma3_text", args, ref, tokens), rtol=1e-5, atol=1e-5)
    for value, detail in [([True, True, False, True, True, True], "6 for 6 layers) is not supported: layer 5 breaks "
                                                                  "the repeating pattern of 2"),
                          ([True, True, True, False], "4 for 6 layers) is not supported: layer 4 breaks the repeating "
                                                      "pattern of 3")]:
        flags[:] = value
        write_tiny_gemma3(path)
        assert main(["convert", str(path), str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == (f"dtrain: error: {path}: GGUF key 'gemma3.attention.sliding_window_pattern' "
                                           f"(one flag per layer, {detail} sliding layers and a global one that "
                                           "mlx-lm's gemma3_text computes\n")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), "two"], ids=["nan", "text"])
def test_a_split_count_of_another_kind_is_one_line(tmp_path, capsys, value):
    """split.count holding a float32 NaN or a text ended convert in int()'s ValueError traceback."""
    from dtrain.cli import main

    path = tmp_path / "bad.gguf"
    write_tiny_llama(path, {}, extra=[("add_float32" if isinstance(value, float) else "add_string", "split.count",
                                       value)])
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: {path}: GGUF key 'split.count' = {value!r} is not supported "
                                       f"(expected 1)\n")
    assert not (tmp_path / "out").exists()


def test_a_converted_quantized_folder_loads_with_the_weights_of_its_gguf(tmp_path):
    """convert keeps Q4_0/Q4_1/Q8_0 as MLX-quantized layers with float16 scales; loaded at float32 (the CPU's auto),
    mlx-lm's dequantize_model computed scale * q + bias in float16, so the folder's logits were up to 1e-3 off its
    GGUF's, whose dequantization is float32 (llama.cpp's)."""
    path = tmp_path / "q.gguf"
    quant = {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_0, "token_embd.weight": Q.Q4_1,
             "blk.2.ffn_up.weight": Q.Q4_1, "blk.3.ffn_down.weight": Q.Q4_0}
    write_tiny_llama(path, quant)
    convert_gguf(str(path), str(tmp_path / "out"))
    folder = load_model(str(tmp_path / "out"), dtype="float32")
    gguf_model = load_model(str(path), dtype="float32")
    for name, value in tree_flatten(gguf_model.model.parameters()):
        np.testing.assert_array_equal(np.array(dict(tree_flatten(folder.model.parameters()))[name]), np.array(value))
    np.testing.assert_allclose(np.array(folder.model(TOKENS)), np.array(gguf_model.model(TOKENS)), rtol=0, atol=1e-6)
