"""``dtrain export``: the merged model written as an mlx-lm folder and a GGUF file, read back.

The reference is the base model with the LoRA layers in place (what training
saw): the fused export must give its logits. Bases are the tiny GGUF files of
test_models_gguf.py (llama with permuted Q/K rows, gemma3 with norms stored as
1 + w).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import DAMAGED_HEADERS, add_random_lora, damaged_header
from mlx.utils import tree_flatten
from test_models_gguf import Q, gguf, write_tiny_gemma3, write_tiny_llama

from dtrain.cli import main
from dtrain.errors import ModelError
from dtrain.models import load_model
from dtrain.models.export import export_adapter
from dtrain.models.gguf import gguf_to_mlx, permute_qk

TOKENS = mx.array([[1, 3, 40, 7, 300, 511, 2, 99, 100, 4, 17, 250]])


def write_adapter(base: str, folder, seed: int = 0):
    """A random LoRA adapter (rank 4, scale 2, all linear layers) on ``base``; returns the LoRA model."""
    model = add_random_lora(load_model(base, dtype="float32").model, seed=seed)
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers),
              "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return model


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture
def llama(tmp_path):
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_1})
    lora_model = write_adapter(str(base), tmp_path / "adapter")
    return base, tmp_path / "adapter", lora_model


def test_llama_f32_export_reproduces_the_lora_model_in_folder_and_gguf(tmp_path, llama):
    from mlx_lm import load

    base, adapter, lora_model = llama
    expected = np.array(lora_model(TOKENS))
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f32", dtype="float32")
    assert result.gguf == tmp_path / "out" / "model-F32.gguf"
    assert result.tensor_types == {"F32": 4 * 9 + 2}  # 4 layers x (7 matrices + 2 norms), embedding, final norm
    folder_model, _ = load(str(result.folder))
    np.testing.assert_allclose(np.array(folder_model(TOKENS)), expected, rtol=1e-4, atol=1e-4)
    back = load_model(str(result.gguf), dtype="float32")
    np.testing.assert_allclose(np.array(back.model(TOKENS)), expected, rtol=1e-4, atol=1e-4)
    assert back.config["tie_word_embeddings"] is True
    umask = os.umask(0)
    os.umask(umask)
    assert result.folder.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_gguf_keeps_the_base_metadata_and_tokenizer(tmp_path, llama):
    base, adapter, _ = llama
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="q8_0")
    old, new = gguf.GGUFReader(str(base)), gguf.GGUFReader(str(result.gguf))
    changed = {"general.file_type", "general.quantization_version"}
    added = {"general.finetune", "general.base_model.count", "general.base_model.0.name"}  # the adapter, the base
    keys = [k for k in old.fields if not k.startswith("GGUF.") and k not in changed]
    assert [k for k in new.fields if not k.startswith("GGUF.") and k not in changed | added] == keys
    for key in keys:
        assert new.fields[key].contents() == old.fields[key].contents(), key
        assert new.fields[key].types == old.fields[key].types, key
    assert new.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors]
    tok_old, tok_new = load_model(str(base)).tokenizer, load_model(str(result.gguf)).tokenizer
    for text in ["<|im_start|>user\nWhat is 12345?<|im_end|>\n", "Héllo  wörld\n\n\tok", "x = [1, 2]"]:
        assert tok_new.encode(text) == tok_old.encode(text)
    assert tok_new.chat_template == tok_old.chat_template


def test_gguf_leaves_out_the_base_imatrix_record(tmp_path):
    """A base quantized with an importance matrix (llama-quantize --imatrix) records it under quantize.imatrix.*;
    the export quantizes the merged weights without one, and kept that record."""
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {}, extra=[("add_string", "quantize.imatrix.file", "imatrix.dat"),
                                      ("add_int32", "quantize.imatrix.chunks_count", 125),
                                      ("add_string", "general.license", "apache-2.0")])
    write_adapter(str(base), tmp_path / "adapter")
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"), gguf_type="q8_0")
    fields = gguf.GGUFReader(str(result.gguf)).fields
    assert not [k for k in fields if k.startswith("quantize.")]
    assert fields["general.license"].contents() == "apache-2.0"


def test_a_base_with_an_empty_metadata_array_exports_without_it(tmp_path, monkeypatch):
    """llama.cpp's gguf.cpp writes empty arrays (a key with an item type and no items); gguf-py's writer refuses
    them, and the export stopped with its bare ValueError ("Empty array") after merging."""
    V = gguf.GGUFValueType
    pack = gguf.GGUFWriter._pack_val

    def as_gguf_cpp(self, val, vtype, add_vtype, sub_type=None):  # an empty array: its type, item type, count 0
        if vtype == V.ARRAY and len(val) == 0:
            return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
        return pack(self, val, vtype, add_vtype, sub_type)

    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "_pack_val", as_gguf_cpp)
        m.setattr(gguf.GGUFWriter, "add_strings", lambda w, k, v: w.add_key_value(k, v, V.ARRAY, V.STRING),
                  raising=False)
        base = tmp_path / "base.gguf"
        write_tiny_llama(base, {}, extra=[("add_strings", "general.tags", []),
                                          ("add_strings", "general.languages", ["en"])])
    assert gguf.GGUFReader(str(base)).fields["general.tags"].contents() == []
    write_adapter(str(base), tmp_path / "adapter")
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"), gguf_type="f16")
    fields = gguf.GGUFReader(str(result.gguf)).fields
    assert "general.tags" not in fields and fields["general.languages"].contents() == ["en"]
    assert load_model(str(result.gguf)).config["model_type"] == "llama"


def block_bound(w: np.ndarray, levels: float, steps: float) -> np.ndarray:
    """Per-value error bound of a 32-value block quant with step d = max|block| / levels.

    Rounding costs ``steps * d`` (Q8_0: half a step; Q4_0: one step, as the
    value opposite the block's extreme is clipped from +8 to +7), plus the f16
    rounding of d and of MLX's affine bias (-128 d or -8 d): d / 16 and 2^-10 |w|.
    """
    blocks = w.reshape(w.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / levels
    return ((steps + 1 / 16) * d + np.abs(blocks) * 2.0**-10 + 1e-7).reshape(w.shape)


@pytest.mark.parametrize("gguf_type, levels, steps", [("q8_0", 127.0, 0.5), ("q4_0", 8.0, 1.0)])
def test_quantized_export_is_within_the_quantization_error(tmp_path, llama, gguf_type, levels, steps):
    base, adapter, lora_model = llama
    merged = {k: np.array(v) for k, v in tree_flatten(load_model(str(base), dtype="float32").model.parameters())}
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type=gguf_type, dtype="float32")
    assert result.tensor_types == {gguf_type.upper(): 4 * 7 + 1, "F32": 4 * 2 + 1}
    from mlx_lm import load

    fused = {k: np.array(v) for k, v in tree_flatten(load(str(result.folder))[0].parameters())}
    back = gguf_to_mlx(result.gguf)
    weights = back.weights
    for name, w in fused.items():
        if w.ndim == 2:
            got = np.array(mx.dequantize(weights[name], weights[name.replace("weight", "scales")],
                                         weights[name.replace("weight", "biases")], 32, back.quantization[
                                             name[: -len(".weight")]]["bits"]))
            assert np.all(np.abs(got - w) <= block_bound(w, levels, steps)), name
        else:
            np.testing.assert_array_equal(np.array(weights[name]), w)
    assert any(not np.allclose(fused[k], merged[k]) for k in fused)  # the adapter did change weights
    # Logits: those of the fused model with each matrix rounded by gguf-py's own
    # quantize -> dequantize (blocks run along rows, so the Q/K row order does not matter).
    qtype = Q[gguf_type.upper()]
    rounded = {k: gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype) if w.ndim == 2 else w
               for k, w in fused.items()}
    reference = make_reference("llama", rounded)
    got = load_model(str(result.gguf), dtype="float32").model(TOKENS)
    np.testing.assert_allclose(np.array(got), np.array(reference(TOKENS)), rtol=1e-4, atol=1e-4)
    print(f"{gguf_type}: logits relative error vs the LoRA model {rel_err(got, lora_model(TOKENS)):.2e}")


def make_reference(module_name: str, weights: dict):
    from conftest import make_tiny_model

    model = make_tiny_model(module_name)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


@pytest.mark.parametrize("gguf_type, bound", [("f16", 1e-3), ("bf16", 1e-2)])
def test_half_precision_export_is_the_rounded_merge(tmp_path, llama, gguf_type, bound):
    from mlx_lm import load

    base, adapter, lora_model = llama
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type=gguf_type, dtype="float32")
    fused = {k: np.array(v) for k, v in tree_flatten(load(str(result.folder))[0].parameters())}
    back = gguf_to_mlx(result.gguf).weights
    half = mx.float16 if gguf_type == "f16" else mx.bfloat16
    for name, w in fused.items():  # bitwise: the same rounding of the same merged value, rows in place
        want = np.array(mx.array(w).astype(half).astype(mx.float32)) if w.ndim == 2 else w
        np.testing.assert_array_equal(np.array(back[name].astype(mx.float32)), want, err_msg=name)
    err = rel_err(load_model(str(result.gguf), dtype="float32").model(TOKENS), lora_model(TOKENS))
    print(f"{gguf_type}: logits relative error vs the LoRA model {err:.2e}")
    assert err < bound, err


def test_gemma3_export_restores_norm_offsets_and_reproduces_the_lora_model(tmp_path):
    base = tmp_path / "gemma.gguf"
    write_tiny_gemma3(base)
    lora_model = write_adapter(str(base), tmp_path / "adapter")
    tokens = mx.array([[2, 4, 270, 281, 290, 5, 7, 100, 200, 294, 295, 1]])
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"), gguf_type="f32",
                            dtype="float32")
    old = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(base)).tensors}
    new = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(result.gguf)).tensors}
    norms = [n for n in old if n.endswith("norm.weight")]
    assert len(norms) == 6 * 6 + 1  # 4 block norms + q/k norms per layer, final norm
    for name in norms:  # untouched by LoRA: stored exactly as the base stores them (1 + w)
        np.testing.assert_allclose(new[name], old[name], rtol=0, atol=1e-7, err_msg=name)
    back = load_model(str(result.gguf), dtype="float32")
    assert back.config["model_type"] == "gemma3_text"
    np.testing.assert_allclose(np.array(back.model(tokens)), np.array(lora_model(tokens)), rtol=1e-4, atol=1e-4)
    assert back.tokenizer.encode("hello the é") == load_model(str(base)).tokenizer.encode("hello the é")


@pytest.mark.parametrize("pad", [0, 8, 16, 24])
def test_a_base_with_its_own_alignment_exports_a_gguf_that_reads_back(tmp_path, pad):
    """general.alignment 64 was copied as a plain key while the tensors were padded to 32, so a
    reader (gguf-py, llama.cpp) looked for the data at other offsets; ``pad`` shifts the header
    end through the residues where the two disagree."""
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {}, alignment=64, extra=[("add_string", "test.pad", "p" * pad)])
    lora_model = write_adapter(str(base), tmp_path / "adapter")
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"), gguf_type="f32")
    assert gguf.GGUFReader(str(result.gguf)).alignment == 64
    back = load_model(str(result.gguf), dtype="float32")
    assert rel_err(back.model(TOKENS), lora_model(TOKENS)) < 1e-5


def test_llama_rows_are_permuted_back_to_llama_cpp_order(tmp_path, llama):
    base, adapter, _ = llama
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f32", dtype="float32")
    from mlx_lm import load

    fused = dict(tree_flatten(load(str(result.folder))[0].parameters()))
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(result.gguf)).tensors}
    q = np.array(fused["model.layers.2.self_attn.q_proj.weight"])
    k = np.array(fused["model.layers.2.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(stored["blk.2.attn_q.weight"], permute_qk(q, 4))
    np.testing.assert_array_equal(stored["blk.2.attn_k.weight"], permute_qk(k, 2))
    assert not np.array_equal(stored["blk.2.attn_q.weight"], q)


def test_gguf_without_a_type_before_the_adapter_folder_leaves_the_folder_to_it(tmp_path, capsys):
    """`dtrain export --base B --out O --gguf ADAPTER`: --gguf's optional TYPE took the adapter folder, and the
    error said "required: adapter_dir" although one was given. A value that is no GGUF type but an existing
    path is the adapter folder; a mistyped type is still named as one."""
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {})
    write_adapter(str(base), tmp_path / "adapter")
    out = tmp_path / "out"
    assert main(["export", "--base", str(base), "--out", str(out), "--gguf", str(tmp_path / "adapter")]) == 0
    assert f"wrote GGUF {out / 'model-F16.gguf'}" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "adapter"), "--base", str(base), "--out", str(tmp_path / "o2"),
                 "--gguf", "q5_k"]) == 2
    assert "GGUF type 'q5_k' is not one of f32, f16, bf16, q8_0, q4_0" in capsys.readouterr().err
    (tmp_path / "old.gguf").write_bytes(b"")  # a file is no adapter folder: still named as a wrong type
    assert main(["export", str(tmp_path / "adapter"), "--base", str(base), "--out", str(tmp_path / "o3"),
                 "--gguf", str(tmp_path / "old.gguf")]) == 2
    assert f"GGUF type '{tmp_path / 'old.gguf'}' is not one of" in capsys.readouterr().err



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_an_export_ended_by_a_signal_leaves_no_half_written_folder(tmp_path, sig):
    """SIGTERM (kill, timeout, a job scheduler) or SIGHUP (its terminal closed) ended `dtrain export` at once,
    leaving the half-written model folder beside --out (``.out.tmp-PID``, the model's size; Ctrl-C removed
    it). They now end it as Ctrl-C does: the folder is removed, exit status 128 + the signal."""
    base, work = tmp_path / "base.gguf", tmp_path / "work"
    write_tiny_llama(base, {})
    write_adapter(str(base), tmp_path / "adapter")
    work.mkdir()
    script = ("import os, sys, time\n"
              "from dtrain import cli\n"
              "from dtrain.models import export\n"
              "def write_gguf(*args):  # the mlx-lm files are written: the signal comes as the GGUF is\n"
              f"    os.kill(os.getpid(), {int(sig)})\n"
              "    time.sleep(30)\n"
              "export.write_gguf = write_gguf\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", script, "export", str(tmp_path / "adapter"), "--base", str(base),
                        "--out", str(work / "out"), "--gguf", "q8_0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + sig, r.stderr
    assert sorted(os.listdir(work)) == []


def test_an_export_stopped_midway_leaves_no_folder_it_made(tmp_path, monkeypatch):
    """``--out new/deeper/merged`` made new/ and new/deeper/ for the half-written folder, and an export stopped
    (Ctrl-C) or failing while it wrote removed only that folder: the empty new/deeper/ stayed where it was run."""
    base, work = tmp_path / "base.gguf", tmp_path / "work"
    write_tiny_llama(base, {})
    write_adapter(str(base), tmp_path / "adapter")
    work.mkdir()

    def stopped(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr("dtrain.models.export.write_gguf", stopped)
    assert main(["export", str(tmp_path / "adapter"), "--base", str(base), "--out", str(work / "new" / "deeper" / "merged"),
                 "--gguf", "q8_0"]) == 130
    assert os.listdir(work) == []

def test_rows_that_do_not_fill_a_block_fall_back_to_f16(tmp_path, capsys):
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {}, hidden_size=48)  # 48 columns: not a multiple of 32
    write_adapter(str(base), tmp_path / "adapter")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "adapter"), "--base", str(base), "--out", str(out), "--gguf", "q4_0"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote GGUF {out / 'model-Q4_0.gguf'}: tensor types F16 x25, F32 x9, Q4_0 x4" in printed
    assert "F16 instead of Q4_0 (rows not a multiple of 32): token_embd.weight, blk.0.attn_q.weight" in printed
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out / "model-Q4_0.gguf")).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q4_0" and types["blk.0.ffn_up.weight"] == "F16"
    assert load_model(str(out / "model-Q4_0.gguf"), dtype="float32").config["hidden_size"] == 48


# ---------------------------------------------------------------- errors


def test_export_errors_name_what_is_wrong(tmp_path, llama, capsys):
    base, adapter, _ = llama
    with pytest.raises(ModelError, match=r"empty: not an adapter folder \(missing adapters\.safetensors, "
                                         r"adapter_config\.json\)"):
        (tmp_path / "empty").mkdir()
        export_adapter(str(tmp_path / "empty"), str(base), str(tmp_path / "o1"))
    run = tmp_path / "run"  # a run's output folder given for its adapter
    shutil.copytree(adapter, run / "adapters")
    with pytest.raises(ModelError) as err:
        export_adapter(str(run), str(base), str(tmp_path / "o1"))
    assert str(err.value) == (f"{run}: not an adapter folder (missing adapters.safetensors, adapter_config.json); "
                              f"{run} is a run's output folder: its adapter is {run / 'adapters'}")
    with pytest.raises(ModelError, match=r"adaptrs: no such adapter folder$"):  # a mistyped path
        export_adapter(str(tmp_path / "adaptrs"), str(base), str(tmp_path / "o1"))
    other = tmp_path / "other.gguf"
    write_tiny_llama(other, {}, intermediate_size=96)
    with pytest.raises(ModelError, match=r"adapter: this adapter does not fit the base model .*other\.gguf: "
                                         r"Adapter at .* contains incompatible tensors: .*mlp\.down_proj\.lora_a"):
        export_adapter(str(adapter), str(other), str(tmp_path / "o2"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "full")]) == 2
    assert "output folder already exists and is not empty" in capsys.readouterr().err
    with pytest.raises(ModelError, match=r"GGUF type 'q5_k' is not one of f32, f16, bf16, q8_0, q4_0"):
        export_adapter(str(adapter), str(base), str(tmp_path / "o3"), gguf_type="q5_k")
    folder = tmp_path / "o4"
    export_adapter(str(adapter), str(base), str(folder))
    with pytest.raises(ModelError, match=r"--gguf needs a GGUF base model .*/o4 is not a GGUF file"):
        export_adapter(str(adapter), str(folder), str(tmp_path / "o5"), gguf_type="f16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base.gguf", "empty", "full", "o4", "other.gguf", "run"]


@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_full_disk_while_the_tokenizer_is_written_is_one_line(tmp_path, llama, capsys, monkeypatch, command):
    """The tokenizers library's write error (a bare Exception, 'No space left on device (os error 28)') was a
    traceback of exit status 1; now it is the folder's storage failure, and nothing is left."""
    from transformers import PreTrainedTokenizerFast

    def full(*_a, **_k):
        raise Exception("No space left on device (os error 28)")

    base, adapter, _ = llama
    out = tmp_path / "out"
    monkeypatch.setattr(PreTrainedTokenizerFast, "_save_pretrained", full)
    args = ["export", str(adapter), "--base", str(base), "--out", str(out)] if command == "export" else \
        ["convert", str(base), str(out)]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"dtrain: error: could not write {out}: No space left on device (os error 28); nothing was left there"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base.gguf"]


def test_export_gguf_onto_a_mistyped_base_path_says_no_such_file(tmp_path, llama, capsys):
    """A mistyped --base with --gguf was told it "is not a GGUF file" and pointed at mlx_lm.fuse."""
    _, adapter, _ = llama
    missing = str(tmp_path / "bse.gguf")
    assert main(["export", str(adapter), "--base", missing, "--out", str(tmp_path / "o"), "--gguf", "q8_0"]) == 2
    assert capsys.readouterr().err == f"dtrain: error: no such GGUF file: {missing}\n"
    assert not (tmp_path / "o").exists()
    with pytest.raises(ModelError, match=r"^--gguf needs a GGUF base model .*; some-org/some-model is not a GGUF"):
        export_adapter(str(adapter), "some-org/some-model", str(tmp_path / "o"), gguf_type="f16")  # a hub id


def test_a_leading_tilde_in_the_adapter_and_out_is_the_home_folder(tmp_path, llama, monkeypatch, capsys):
    """`dtrain export A --out=~/x` (where the shell expands no ~) wrote a folder named '~' in the working folder."""
    base, _, _ = llama
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["export", "~/adapter", "--base", str(base), "--out=~/merged", "--gguf", "f32"]) == 0
    out = capsys.readouterr().out
    assert f"wrote mlx-lm model folder {tmp_path}/merged (bfloat16)" in out
    assert f"wrote GGUF {tmp_path}/merged/model-F32.gguf" in out
    assert (tmp_path / "merged" / "model-F32.gguf").is_file() and list((tmp_path / "cwd").iterdir()) == []


def test_a_tilde_of_no_user_is_refused_in_one_line(tmp_path, llama, monkeypatch, capsys):
    """--base ~nobody-here/b.gguf with --gguf ended in pathlib's RuntimeError traceback; --out=~nobody-here/x
    wrote a folder named '~nobody-here' in the working folder."""
    _, adapter, _ = llama
    monkeypatch.chdir(tmp_path)
    argv = ["export", str(adapter), "--base", "~nobody-here/b.gguf", "--out", str(tmp_path / "o"), "--gguf", "q8_0"]
    assert main(argv) == 2
    assert capsys.readouterr().err == "dtrain: error: --base ~nobody-here/b.gguf: no home folder for ~nobody-here\n"
    assert main(["export", str(adapter), "--base", "demo", "--out=~nobody-here/x"]) == 2
    assert capsys.readouterr().err == "dtrain: error: --out ~nobody-here/x: no home folder for ~nobody-here\n"
    assert not (tmp_path / "o").exists() and not (tmp_path / "~nobody-here").exists()


def refused_unless_allowed(argv: list, capsys, names: str) -> None:
    """``dtrain ARGV`` stops with the base-mismatch line starting ``names`` and writes nothing to ``--out``;
    with ``--allow-base-mismatch`` it exports."""
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"dtrain: error: {names}; export onto the base it was trained on, or pass "
                                       "--allow-base-mismatch to merge it anyway\n")
    assert not Path(argv[argv.index("--out") + 1]).exists()
    assert main(argv + ["--allow-base-mismatch"]) == 0


def test_export_onto_another_base_is_refused_naming_both_unless_allowed(tmp_path, llama, capsys):
    """adapter_config.json records the base GGUF's sha256 (trainer: LoadedModel.reference); a --base of
    the same shapes but other bytes merged silently before. The override merges onto it as asked."""
    base, adapter, lora_model = llama
    recorded = {**load_model(str(base), dtype="float32").reference, "source": "GGUF"}  # what training writes
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model": recorded}))
    other = tmp_path / "other.gguf"
    write_tiny_llama(other, {"blk.0.attn_q.weight": Q.Q4_1})  # the same shapes, other weights
    sha = load_model(str(other), dtype="float32").reference["sha256"]
    argv = ["export", str(adapter), "--base", str(other), "--out", str(tmp_path / "o1"), "--dtype", "float32"]
    refused_unless_allowed(argv, capsys, f"{adapter / 'adapter_config.json'}: the adapter was trained on {base} "
                           f"(sha256 {recorded['sha256'][:16]}...), but --base {other} is another file (sha256 "
                           f"{sha[:16]}...)")
    from mlx_lm import load

    on_other, _ = load(str(tmp_path / "o1"))
    on_base, _ = load(str(export_adapter(str(adapter), str(base), str(tmp_path / "o2"), dtype="float32").folder))
    np.testing.assert_allclose(np.array(on_base(TOKENS)), np.array(lora_model(TOKENS)), rtol=1e-4, atol=1e-4)
    assert rel_err(on_other(TOKENS), on_base(TOKENS)) > 1e-3  # the other base's weights, as asked


@pytest.mark.parametrize("recorded, problem", [
    ("base.gguf", 'base_model is "base.gguf", not an object'), (["base.gguf"], 'base_model is ["base.gguf"], not an object'),
    ({"path": "base.gguf", "sha256": 5}, "base_model.sha256 is 5, not text"),
    ({"path": "base.gguf", "fingerprint": None}, "base_model.fingerprint is null, not text")])
def test_a_wrongly_typed_base_model_is_refused_naming_it_unless_allowed(tmp_path, llama, capsys, recorded, problem):
    """A base_model of text or a list (dtrain records an object; mlx-lm none), or a sha256 that is not text, skipped
    the base check without a word: an adapter exported onto any base."""
    _, adapter, _ = llama
    edited = tmp_path / "edited"
    shutil.copytree(adapter, edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**config, "base_model": recorded}))
    other = tmp_path / "other.gguf"
    write_tiny_llama(other, {"blk.0.attn_q.weight": Q.Q4_1})
    argv = ["export", str(edited), "--base", str(other), "--out", str(tmp_path / "o"), "--dtype", "float32"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"dtrain: error: {edited / 'adapter_config.json'}: {problem} (dtrain records the training base's path and "
        "its sha256 or content fingerprint there); correct or remove it, or pass --allow-base-mismatch to merge "
        "without the check\n")
    assert not (tmp_path / "o").exists()
    assert main(argv + ["--allow-base-mismatch"]) == 0


def test_export_onto_a_base_that_cannot_be_compared_says_so(tmp_path, llama):
    """An adapter trained on a GGUF records its sha256; a model folder as --base (`dtrain convert`'s, or
    an earlier export with the adapter already merged) was merged without a word."""
    from dtrain.models.convert import convert_gguf

    base, adapter, _ = llama
    recorded = {**load_model(str(base), dtype="float32").reference, "source": "GGUF"}  # what training writes
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model": recorded}))
    folder = convert_gguf(str(base), str(tmp_path / "folder"))
    said = []
    export_adapter(str(adapter), str(folder), str(tmp_path / "o1"), dtype="float32", report=said.append)
    assert said == [f"{adapter / 'adapter_config.json'}: the adapter was trained on {base} (recorded by its sha256); "
                    f"--base {folder} cannot be compared with it: make sure it is that model (not an export that "
                    "already holds the adapter)"]
    said.clear()
    export_adapter(str(adapter), str(base), str(tmp_path / "o2"), dtype="float32", report=said.append)
    assert said == []  # compared, and the same


def test_export_onto_another_model_folder_is_refused_by_content_unless_allowed(tmp_path, capsys):
    """Training on a model folder records its content fingerprint in base_model (the identity a resume
    compares); a folder of other weights merged silently before. A copy at another path is the same base;
    an adapter from before the fingerprint (path only) is not compared."""
    from conftest import make_tiny_model
    from fixtures_launch import MODEL_CONFIG, make_model_folder
    from mlx_lm.utils import save_model

    from dtrain.config import load_config
    from dtrain.models.load import folder_fingerprint
    from dtrain.run.trainer import train

    model = make_model_folder(tmp_path / "model")
    cfg = load_config(None, [f"model.path={model}", f"train.output_dir={tmp_path / 'run'}", "data.demo_pairs=8",
                             "data.max_length=64", "data.max_prompt_length=32", "lora.rank=2", "train.steps=1",
                             "train.global_batch_pairs=4", "train.micro_batch_pairs=4", "train.progress=false"])
    adapter = train(cfg, loaded=load_model(str(model), "float32")).adapter_dir
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    want = folder_fingerprint(model)
    assert config["base_model"] == {"path": str(model.resolve()), "fingerprint": want,
                                    "source": f"mlx-lm model {model}"}
    copy = shutil.copytree(model, tmp_path / "elsewhere" / "model")
    assert main(["export", str(adapter), "--base", str(copy), "--out", str(tmp_path / "o1")]) == 0
    other = shutil.copytree(model, tmp_path / "other")
    save_model(other, make_tiny_model(seed=7, num_hidden_layers=MODEL_CONFIG["num_hidden_layers"]))
    got = folder_fingerprint(other)
    capsys.readouterr()
    refused_unless_allowed(["export", str(adapter), "--base", str(other), "--out", str(tmp_path / "o2")], capsys,
                           f"{config_file}: the adapter was trained on {model.resolve()} (content fingerprint "
                           f"{want[:16]}...), but --base {other} is another folder (content fingerprint "
                           f"{got[:16]}...)")
    del config["base_model"]["fingerprint"]  # as dtrain wrote it before: the path only
    config_file.write_text(json.dumps(config))
    assert main(["export", str(adapter), "--base", str(other), "--out", str(tmp_path / "o3")]) == 0
    assert sorted(p.name for p in (tmp_path / "o3").iterdir()) == sorted(p.name for p in (tmp_path / "o2").iterdir())


@pytest.mark.slow
def test_demo_export_round_trip_greedy_tokens(demo_path, tmp_path, capsys):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    base = load_model("demo", dtype="float32")
    lora_model = add_random_lora(base.model, seed=3, scale=0.5)
    (tmp_path / "adapter").mkdir()
    mx.save_safetensors(str(tmp_path / "adapter" / "adapters.safetensors"),
                        dict(tree_flatten(lora_model.trainable_parameters())))
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 30, "lora_parameters": {"rank": 4, "scale": 0.5, "dropout": 0.0}}))
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "adapter"), "--base", "demo", "--out", str(out), "--gguf", "q8_0"]) == 0
    assert "tensor types F32 x61, Q8_0 x211" in capsys.readouterr().out  # 30 x 7 matrices + embedding
    prompt = base.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True)
    tokens = mx.array([prompt])
    back = load_model(str(out / "model-Q8_0.gguf"), dtype="float32")
    assert back.tokenizer.encode("x = 123 <|im_end|>") == base.tokenizer.encode("x = 123 <|im_end|>")
    err = rel_err(back.model(tokens), lora_model(tokens))
    print(f"demo q8_0: logits relative error vs the LoRA model {err:.2e}")
    greedy = make_sampler(temp=0.0)
    want = generate(lora_model, base.tokenizer, prompt, max_tokens=8, sampler=greedy)
    assert generate(back.model, back.tokenizer, prompt, max_tokens=8, sampler=greedy) == want


def test_an_adapter_missing_a_lora_tensor_or_lora_parameters_is_refused_naming_it(tmp_path, llama, capsys):
    """mlx-lm's load_adapters loads non-strictly: a lora_a the file lacks kept its random initialisation
    and was fused into the export as if trained; a config without lora_parameters raised AttributeError."""
    base, adapter, _ = llama
    partial = tmp_path / "partial"
    shutil.copytree(adapter, partial)
    weights = mx.load(str(partial / "adapters.safetensors"))
    del weights["model.layers.2.mlp.up_proj.lora_a"]
    mx.save_safetensors(str(partial / "adapters.safetensors"), weights)
    assert main(["export", str(partial), "--base", str(base), "--out", str(tmp_path / "o1"), "--gguf", "f32"]) == 2
    assert capsys.readouterr().err == (
        f"dtrain: error: {partial / 'adapters.safetensors'} lacks 1 of the 56 LoRA tensors its adapter_config.json "
        f"sets up on {base} (model.layers.2.mlp.up_proj.lora_a); the adapter is incomplete or its config is not "
        "the one it was trained with\n")
    shapeless = tmp_path / "shapeless"
    shutil.copytree(adapter, shapeless)
    (shapeless / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 4}))
    assert main(["export", str(shapeless), "--base", str(base), "--out", str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: {shapeless / 'adapter_config.json'}: no 'lora_parameters' "
                                       "(an mlx-lm LoRA adapter config has fine_tune_type, num_layers and "
                                       "lora_parameters)\n")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("rank", [2, 8])
def test_an_adapter_config_of_another_rank_than_its_tensors_is_named_not_blamed_on_the_base(tmp_path, llama, capsys,
                                                                                            rank):
    """A rank in adapter_config.json other than its tensors' (an edited config, or another adapter's) was reported
    as 'this adapter does not fit the base model BASE: ... adapter shape (4, 32) does not match model parameter
    shape (8, 32) ...', sending the user to the base, which was the right one."""
    base, adapter, _ = llama
    meta = json.loads((adapter / "adapter_config.json").read_text())
    meta["lora_parameters"]["rank"] = rank
    (adapter / "adapter_config.json").write_text(json.dumps(meta))
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 2
    assert capsys.readouterr().err == (
        f"dtrain: error: {adapter / 'adapter_config.json'}: lora_parameters.rank is {rank}, but "
        f"{adapter / 'adapters.safetensors'} holds LoRA tensors of rank 4 (model.layers.0.mlp.down_proj.lora_a: "
        "(64, 4)); the config is not the one the adapter was trained with\n")
    assert not (tmp_path / "out").exists()
    # tensors that name no one rank (lora_a and lora_b transposed) are not the config's fault: mlx-lm's shapes say it
    weights = mx.load(str(adapter / "adapters.safetensors"))
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {k: v.T for k, v in weights.items()})
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out")]) == 2
    assert "does not match model parameter shape" in capsys.readouterr().err


def test_an_adapter_that_changes_no_weight_says_so_instead_of_an_infinite_rounding_ratio(tmp_path, llama, capsys):
    """lora_b all zero (as training starts it; the checkpoint of a run whose every step was skipped as non-finite
    holds it so) was exported to q8_0 with 'warning: Q8_0 rounding moves the adapted weights infx as far as the
    adapter's update does ... may have lost much of the fine-tune', of a fine-tune that changed nothing."""
    base, adapter, _ = llama
    weights = mx.load(str(adapter / "adapters.safetensors"))
    zeroed = {k: mx.zeros_like(v) if k.endswith("lora_b") else v for k, v in weights.items()}
    mx.save_safetensors(str(adapter / "adapters.safetensors"), zeroed)
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), "--gguf", "q8_0"]) == 0
    assert capsys.readouterr().err == (f"{adapter}: the adapter changes no weight (the LoRA updates of its 28 adapted "
                                       "matrices are all zero, as training starts them): the export is the base "
                                       "model\n")


def test_an_adapter_with_nan_or_inf_values_is_refused_naming_the_tensors(tmp_path, llama, capsys):
    """A NaN lora_b was fused into its weight and the export written with exit 0: a model whose logits are all NaN."""
    base, adapter, _ = llama
    weights = mx.load(str(adapter / "adapters.safetensors"))
    weights["model.layers.1.self_attn.v_proj.lora_b"][0, 0] = float("nan")
    weights["model.layers.3.mlp.up_proj.lora_a"][2, 1] = float("inf")
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 2
    assert capsys.readouterr().err == (
        f"dtrain: error: {adapter / 'adapters.safetensors'} holds NaN or infinite values in 2 LoRA tensors "
        "(model.layers.1.self_attn.v_proj.lora_b, model.layers.3.mlp.up_proj.lora_a), which merged weights would "
        "carry; the adapter is damaged or from a run that diverged\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, written", [
    (["--gguf", "f16"], "blk.1.attn_v.weight merged with the adapter holds values up to 1.06e+09, beyond what F16 "
                        "can hold (65504)"),
    (["--gguf", "q4_0"], "blk.1.attn_v.weight merged with the adapter holds values up to 1.06e+09, beyond what Q4_0 "
                         "can hold (524032: 8 steps of its F16 block scale)"),
    (["--dtype", "float16"], "model.layers.1.self_attn.v_proj.weight merged with the adapter holds values up to "
                             "1.06e+09, beyond what float16 can hold (65504)")])
def test_an_adapter_whose_merge_overflows_the_written_type_is_refused(tmp_path, llama, capsys, argv, written):
    """A finite but huge LoRA value (a damaged file's flipped exponent bit) merged into weights that F16 writes as
    inf: the GGUF was written, exit 0, with numpy's 'overflow encountered in cast' the only sign, and llama.cpp
    would compute NaN."""
    base, adapter, _ = llama
    weights = mx.load(str(adapter / "adapters.safetensors"))
    weights["model.layers.1.self_attn.v_proj.lora_b"][1, 2] = 3e9
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" would be a second message
        assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err == (f"dtrain: error: {written}: it would be written as inf; the adapter is "
                                       "damaged or from a run that diverged\n")
    assert not (tmp_path / "out").exists()
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "wide"), "--gguf", "f32"]) == 0


@pytest.mark.parametrize("header, reason", DAMAGED_HEADERS)
def test_an_adapter_weights_file_with_a_damaged_header_is_one_line(tmp_path, llama, capsys, header, reason):
    """A header that is not JSON, or JSON not of safetensors' shape, ended `dtrain export` in MLX's RuntimeError
    traceback ('[json.exception.parse_error.101] ...'); a name that is not UTF-8 was blamed on the base."""
    base, adapter, _ = llama
    (adapter / "adapters.safetensors").write_bytes(damaged_header(header))
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtrain: error: could not read the adapter {adapter}: {reason}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, problem", [
    ("{", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("[]", "not a JSON object"),
    ("[" * 5000 + "]" * 5000, "not valid JSON (nested too deep for Python's recursion limit)"),
    ('{"fine_tune_type": "lora", "num_layers": null, "lora_parameters": {"rank": 4, "scale": 2.0}}',
     "num_layers is null, not an integer"),
    ('{"num_layers": 4, "lora_parameters": {"rank": "4", "scale": 2.0}}',
     'lora_parameters.rank is "4", not an integer'),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": "2"}}', 'lora_parameters.scale is "2", not a number'),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": null}}',
     "lora_parameters.dropout is null, not a number"),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 2.0}}',
     "lora_parameters has no dropout, which mlx-lm's LoRA layers take"),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "alpha": 8, "dropout": 0.0}}',
     "lora_parameters has no scale, which mlx-lm's LoRA layers take (PEFT's alpha / rank is mlx-lm's scale)"),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": "self_attn.q_proj"}}',
     'lora_parameters.keys is "self_attn.q_proj", not a list of module names'),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": [5]}}',
     "lora_parameters.keys is [5], not a list of module names"),
    # the bounds train.init_adapter reads them with: mlx-lm slices model.layers[5:] for -5, a part of the layers
    ('{"num_layers": -5, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}',
     "num_layers must be >= -1; got -5"),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 0.0, "dropout": 0.0}}',
     "lora_parameters.scale must be > 0; got 0.0"),
    ('{"num_layers": 4, "lora_parameters": {"rank": 0, "scale": 2.0, "dropout": 0.0}}',
     "lora_parameters.rank must be > 0; got 0"),
    # nn.Dropout's "The dropout probability 5 is not in [0, 1)" was blamed on the base
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 5}}',
     "lora_parameters.dropout must be in [0, 1); got 5.0"),
    ('{"num_layers": 4, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": -0.1}}',
     "lora_parameters.dropout must be in [0, 1); got -0.1"),
])
def test_an_unreadable_adapter_config_is_named_not_blamed_on_the_base(tmp_path, llama, capsys, text, problem):
    """mlx-lm's load_adapters parses the file itself; its JSON error or a mistyped value surfaced as 'this adapter
    does not fit the base model ...: uniform(): incompatible function arguments', sending the user to the base."""
    base, adapter, _ = llama
    broken = tmp_path / "broken"
    shutil.copytree(adapter, broken)
    (broken / "adapter_config.json").write_text(text)
    assert main(["export", str(broken), "--base", str(base), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {broken / 'adapter_config.json'}: {problem}\n"
    assert not (tmp_path / "out").exists()
