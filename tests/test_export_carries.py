"""What ``dtrain export`` carries from training: chat template, end tokens, the fine-tune's name,
an Ollama Modelfile, and the quantization error against the adapter's update (dtrain/models/export.py,
dtrain/models/modelfile.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import CHATML
from test_export import write_adapter
from test_models_gguf import Q, gguf, write_tiny_llama

from dtrain.cli import main
from dtrain.data.templates import PLAIN
from dtrain.lora import adapter_config
from dtrain.models import load_model
from dtrain.models.export import QUANT_WARN_RATIO, export_adapter
from dtrain.models.merge import training_template
from dtrain.models.modelfile import chat_parts, go_template, trims_content
from dtrain.models.vocab_attrs import token_attrs

TRIM_COMMENT = ("# the chat template trims the whitespace around message content and this TEMPLATE cannot (Go "
                "templates have no trim): send messages without leading or trailing whitespace")

@pytest.fixture
def tiny(tmp_path):
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {})
    (tmp_path / "run").mkdir()
    write_adapter(str(base), tmp_path / "run" / "adapters")
    return base, tmp_path / "run" / "adapters"


def record_template(adapter, template):
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "chat_template": template}))


def test_training_template_goes_into_gguf_folder_and_modelfile(tmp_path, tiny):
    from mlx_lm import load

    base, adapter = tiny
    record_template(adapter, PLAIN)  # trained with data.chat_template: plain on a ChatML base
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16")
    fields = gguf.GGUFReader(str(result.gguf)).fields
    assert fields["tokenizer.chat_template"].contents() == PLAIN
    assert (result.folder / "chat_template.jinja").read_text() == "{{ bos_token }}" + PLAIN  # the base adds BOS
    _, tok = load(str(result.folder))
    assert tok.chat_template == "{{ bos_token }}" + PLAIN
    assert load_model(str(result.gguf)).tokenizer.chat_template == PLAIN
    assert result.eos_token_ids == [2, 4]  # plain writes no end-of-turn token: the base's end tokens
    modelfile = (result.folder / "Modelfile").read_text().splitlines()
    assert modelfile[1] == "FROM ./model-F16.gguf" and modelfile[-2:] == ['PARAMETER stop "</s>"',
                                                                          'PARAMETER stop "<|im_end|>"']
    assert modelfile[2] == 'TEMPLATE """{{- range $i, $_ := .Messages }}'
    assert modelfile[5] == '{{- else if eq .Role "user" }}{{ "User: " }}{{ .Content }}{{ "\\n\\n" }}'


def test_a_training_template_replaces_the_named_templates_of_the_base_gguf(tmp_path):
    """A base GGUF's tool_use template (tokenizer.chat_template.tool_use) describes the base's format; the GGUF
    of a run trained with another template kept it beside the new default, so llama.cpp prompted tool calls
    in a format the fine-tune was not trained on. Without a training template both stay."""
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {}, extra=[("add_array", "tokenizer.chat_templates", ["tool_use"]),
                                      ("add_string", "tokenizer.chat_template.tool_use", "TOOLS " + CHATML)])
    (tmp_path / "run").mkdir()
    write_adapter(str(base), tmp_path / "run" / "adapters")
    kept = gguf.GGUFReader(str(export_adapter(str(tmp_path / "run" / "adapters"), str(base), str(tmp_path / "o1"),
                                              gguf_type="f16").gguf)).fields
    assert kept["tokenizer.chat_template.tool_use"].contents() == "TOOLS " + CHATML
    assert kept["tokenizer.chat_template"].contents() == CHATML
    record_template(tmp_path / "run" / "adapters", PLAIN)
    fields = gguf.GGUFReader(str(export_adapter(str(tmp_path / "run" / "adapters"), str(base), str(tmp_path / "o2"),
                                                gguf_type="f16").gguf)).fields
    assert fields["tokenizer.chat_template"].contents() == PLAIN
    assert not [k for k in fields if k.startswith("tokenizer.chat_template") and k != "tokenizer.chat_template"]


def test_end_of_turn_joins_the_end_tokens_and_general_finetune_marks_the_fine_tune(tmp_path, tiny):
    base, adapter = tiny
    before = load_model(str(base)).tokenizer
    assert sorted(before.eos_token_ids) == [2, 4]  # the GGUF names </s>; llama.cpp ends at <|im_end|> by its text
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="q8_0")
    assert result.eos_token_ids == [2, 4]  # <|im_end|> is the base template's end-of-turn too
    config = json.loads((result.folder / "config.json").read_text())
    generation = json.loads((result.folder / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == [2, 4]
    from mlx_lm import load

    assert load(str(result.folder))[1].eos_token_ids == {2, 4}
    fields = gguf.GGUFReader(str(result.gguf)).fields
    assert "general.name" not in fields  # as in the base: llama.cpp keys token attributes off it
    assert fields["general.finetune"].contents() == "run/adapters"
    assert fields["general.base_model.count"].contents() == 1
    assert fields["general.base_model.0.name"].contents() == "base"
    assert fields["tokenizer.chat_template"].contents() == CHATML  # the base's own, kept
    assert "tokenizer.ggml.eot_token_id" not in fields  # llama.cpp ends at <|im_end|> by its text already


def test_an_end_token_the_gguf_cannot_name_is_one_notice(tmp_path, capsys):
    """A GGUF names one end-of-turn token (tokenizer.ggml.eot_token_id): a base that names one already got
    none of the training template's, and nothing was said, so llama.cpp ran on past the turn's end."""
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {}, extra=[("add_uint32", "tokenizer.ggml.eot_token_id", 4)])
    (tmp_path / "run").mkdir()
    write_adapter(str(base), tmp_path / "run" / "adapters")
    record_template(tmp_path / "run" / "adapters", CHATML.replace("<|im_end|>", "<pad>"))  # <pad>: no llama.cpp end
    argv = ["export", str(tmp_path / "run" / "adapters"), "--base", str(base), "--out", str(tmp_path / "out")]
    assert main([*argv, "--gguf", "f16"]) == 0
    assert capsys.readouterr().err == (
        "model-F16.gguf: end token '<pad>' not marked: a GGUF names one end-of-turn token "
        "(tokenizer.ggml.eot_token_id, here '<|im_end|>'), so llama.cpp will not stop at it; "
        "the Modelfile's PARAMETER stop lines stop Ollama there\n")
    assert gguf.GGUFReader(str(tmp_path / "out" / "model-F16.gguf")).fields["tokenizer.ggml.eot_token_id"].contents() == 4
    assert 'PARAMETER stop "<pad>"' in (tmp_path / "out" / "Modelfile").read_text()
    assert main([*argv[:-1], str(tmp_path / "out2")]) == 0 and capsys.readouterr().err == ""  # no GGUF: no notice


@pytest.mark.parametrize("base_name, file_name, finetune", [("Tiny Llama", "base.gguf", "Instruct + phi3-tune"),
                                                              (None, "phi3-mini.gguf", "phi3-tune")])
def test_the_exported_general_name_is_the_base_s_so_llama_cpp_tokenizes_as_training(tmp_path, base_name, file_name,
                                                                                   finetune):
    """llama.cpp picks strip attributes by general.name (vocab_attrs.py): a Phi-3 name drops the spaces after
    special tokens, and it refuses a vocabulary without <unk>. The export named the file '<base> + <adapter>' (the
    file's stem for a base without a name), so an adapter folder 'phi3-tune' on a llama base gave a GGUF llama.cpp
    tokenizes unlike training, here one it does not load at all. The adapter goes in general.finetune."""
    base = tmp_path / file_name
    names = [("add_string", "general.name", base_name), ("add_string", "general.finetune", "Instruct")]
    write_tiny_llama(base, {}, extra=names if base_name else [])
    write_adapter(str(base), tmp_path / "phi3-tune")
    result = export_adapter(str(tmp_path / "phi3-tune"), str(base), str(tmp_path / "out"), gguf_type="f16")
    old, new = ({k: v.contents() for k, v in gguf.GGUFReader(str(p)).fields.items()} for p in (base, result.gguf))
    assert new.get("general.name") == base_name
    assert new["general.finetune"] == finetune
    assert new["general.base_model.0.name"] == (base_name or base.stem)
    assert token_attrs(new) == token_attrs(old)
    text = "<|im_start|>user\n  hi<|im_end|>  the"
    assert load_model(str(result.gguf)).tokenizer.encode(text) == load_model(str(base)).tokenizer.encode(text)
    assert (result.folder / "Modelfile").read_text().startswith(f"# {base_name or base.stem} + phi3-tune: ")


def test_the_fine_tune_label_names_the_run_of_each_adapter_folder_a_run_writes(tmp_path):
    """adapters-last/ (train.keep_best's last step) was named without its run, unlike adapters/."""
    from dtrain.models.export import adapter_label

    run = tmp_path / "demo"
    assert [adapter_label(str(run / f)) for f in ("adapters", "adapters-last", "checkpoints/step-0000012")] == [
        "demo/adapters", "demo/adapters-last", "demo/step-0000012"]
    assert adapter_label(str(tmp_path / "mine")) == "mine"


def test_chatml_modelfile_is_the_expected_go_template(tmp_path, tiny):
    base, adapter = tiny
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f32")
    want = "\n".join([
        "# base + run/adapters: `ollama create NAME -f Modelfile` in this folder",
        "FROM ./model-F32.gguf",
        'TEMPLATE """{{- range $i, $_ := .Messages }}',
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
        '{{- if eq .Role "system" }}{{ "<|im_start|>system\\n" }}{{ .Content }}{{ "<|im_end|>\\n" }}',
        '{{- else if eq .Role "user" }}{{ "<|im_start|>user\\n" }}{{ .Content }}{{ "<|im_end|>\\n" }}',
        '{{- else if eq .Role "assistant" }}{{ "<|im_start|>assistant\\n" }}{{ .Content }}'
        '{{- if not $last }}{{ "<|im_end|>\\n" }}{{ end }}',
        "{{- end }}",
        '{{- if and $last (ne .Role "assistant") }}{{ "<|im_start|>assistant\\n" }}{{ end }}',
        '{{- end }}"""',
        'PARAMETER stop "</s>"',
        'PARAMETER stop "<|im_end|>"',
    ]) + "\n"
    assert result.modelfile.read_text() == want


def _jinja(template):
    from jinja2 import Environment

    env = Environment(trim_blocks=True, lstrip_blocks=True)
    return lambda msgs, gen: env.from_string(template).render(messages=msgs, add_generation_prompt=gen,
                                                              bos_token="<s>")


SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
          "m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
NUMBERED = "{% for m in messages %}{{ loop.index }}. {{ m['content'] }}\n{% endfor %}"


def test_chat_parts_of_known_template_shapes():
    smol = chat_parts(_jinja(SMOL))
    assert smol.default_system == "You are helpful." and smol.open == ""
    assert smol.render([{"role": "user", "content": "hi"}], True) == _jinja(SMOL)([{"role": "user", "content": "hi"}],
                                                                                    True)
    llama3 = chat_parts(_jinja(LLAMA3))
    assert llama3.open == "<s>" and llama3.default_system is None
    assert llama3.before["user"] == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert go_template(llama3).startswith('{{ "<s>" }}')  # export cuts a BOS the tokenizer adds first
    assert '{{ "<s>" }}' not in go_template(dataclasses.replace(llama3, open=""))
    assert chat_parts(_jinja(NUMBERED)) is None  # numbers its turns: no literal pieces rebuild it
    assert chat_parts(lambda m, g: 1 / 0) is None


def test_a_template_that_drops_the_reasoning_of_earlier_replies_gets_no_template():
    """DeepSeek-R1's template writes an assistant turn from its `</think>` on. Its structure was read off probe
    replies without reasoning, so the TEMPLATE wrote a reply's `<think>...</think>` back whole: Ollama, whose chat
    sends the model's earlier replies (reasoning and all) back as history, then prompted with text the template
    (and training) drops. Such a template branches on content: no TEMPLATE, as for one that numbers its turns."""
    from chat_fixtures import DEEPSEEK

    history = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nA"},
               {"role": "user", "content": "Q2"}]
    assert "r\n</think>" not in _jinja(DEEPSEEK)(history, True)
    assert chat_parts(_jinja(DEEPSEEK)) is None
    assert chat_parts(_jinja(CHATML)).render(history, True) == _jinja(CHATML)(history, True)  # one that keeps it


LLAMA31 = ("{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
           "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
           "{{- '<|im_start|>system\nCutting Knowledge Date: December 2023\n\n' + system + '<|im_end|>\n' }}"
           "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_a_default_system_header_with_empty_content_is_written_by_the_go_template(tmp_path, tiny):
    """Llama 3.1's template writes BOS and a system header (dates) even with no system message (empty content).
    The Modelfile had SYSTEM \"\"\"\"\"\", which Ollama never adds (it adds SYSTEM only when not empty), so
    Ollama's prompts lacked the header; with a system message they began with BOS twice (the tokenizer's and
    the system branch's literal <s>)."""
    base, adapter = tiny
    record_template(adapter, LLAMA31)
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16")
    header = '{{ "<|im_start|>system\\nCutting Knowledge Date: December 2023\\n\\n'
    lines = result.modelfile.read_text().splitlines()
    assert lines[4:6] == ['{{- if and (eq $i 0) (ne .Role "system") }}' + header + '<|im_end|>\\n" }}{{ end }}',
                          '{{- if eq .Role "system" }}' + header + '" }}{{ .Content }}{{ "<|im_end|>\\n" }}']
    assert not any(line.startswith("SYSTEM") for line in lines) and "<s>" not in "".join(lines)


def test_a_bos_followed_by_more_opening_text_is_left_to_the_tokenizer(tmp_path, tiny):
    """A template opening with BOS and then a fixed preamble: the TEMPLATE wrote `{{ "<s>Chat log\\n" }}`, and
    Ollama, whose tokenizer adds BOS as this GGUF's does, sent the model <s><s> where training had one."""
    base, adapter = tiny
    record_template(adapter, "{{ bos_token }}{{ 'Chat log\n' }}" + CHATML)
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16")
    lines = result.modelfile.read_text().splitlines()
    assert lines[2:4] == ['TEMPLATE """{{ "Chat log\\n" }}', "{{- range $i, $_ := .Messages }}"]
    assert "<s>" not in "".join(lines[2:-2])  # the stop lines name </s>


def test_a_template_that_trims_the_content_is_said_so_in_the_modelfile(tmp_path, tiny):
    """Llama 3's template writes `message['content'] | trim`; Ollama's Go template writes .Content as it comes
    (Go templates have no trim), and nothing in the Modelfile said that prompts with whitespace around a
    message then differ from the trained ones."""
    base, adapter = tiny
    record_template(adapter, CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}"))
    lines = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16").modelfile.read_text()
    lines = lines.splitlines()
    assert lines[2] == TRIM_COMMENT
    assert lines[3].startswith('TEMPLATE """')
    record_template(adapter, CHATML)
    assert "trim" not in export_adapter(str(adapter), str(base), str(tmp_path / "o2"),
                                        gguf_type="f16").modelfile.read_text()


@pytest.mark.parametrize("content", ["m['content'].strip()", "m['content'].lstrip()", "m['content'].rstrip('\\n')"])
def test_a_template_that_strips_the_content_with_a_python_method_is_said_so_too(tmp_path, tiny, content):
    """Llama 2's template writes `content.strip()`, not `| trim`: the Modelfile said nothing about the whitespace
    Ollama then keeps. The trimming is read off the template's output, whatever writes it."""
    base, adapter = tiny
    record_template(adapter, CHATML.replace("m['content']", content))
    lines = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16").modelfile.read_text()
    assert lines.splitlines()[2] == TRIM_COMMENT


def test_chat_parts_reads_whether_the_template_trims_the_content():
    assert trims_content(_jinja(LLAMA3)) and trims_content(_jinja(CHATML.replace("m['content']", "m.content.strip()")))
    assert not trims_content(_jinja(SMOL)) and not trims_content(_jinja(CHATML))
    assert not trims_content(lambda m, g: 1 / 0)  # a template that refuses the probe: nothing to say


def test_modelfile_without_a_convertible_template_says_so(tmp_path, tiny):
    base, adapter = tiny
    record_template(adapter, NUMBERED)
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16")
    text = result.modelfile.read_text()
    assert "TEMPLATE" not in text.replace("# TEMPLATE", "")
    assert "# TEMPLATE: the chat template's structure could not be read off its output; write one by hand" in text


def test_modelfile_of_a_base_without_a_chat_template_says_so_and_sends_raw_prompts(tmp_path):
    """A base without a chat template got the comment for a template that could not be read, and no TEMPLATE.
    Training renders plain-text prompts as raw text (RAW_TEXT: the system text, a blank line, the prompt)."""
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {}, chat_template=None)
    write_adapter(str(base), tmp_path / "adapters")
    result = export_adapter(str(tmp_path / "adapters"), str(base), str(tmp_path / "out"), gguf_type="f16")
    assert result.modelfile.read_text().splitlines()[2:] == [
        "# the model has no chat template: prompts are sent as raw text, as dtrain trains them (the system "
        "text and a blank line, then the prompt)",
        'TEMPLATE """{{- if .System }}{{ .System }}{{ "\\n\\n" }}{{ end }}{{ .Prompt }}"""',
        'PARAMETER stop "</s>"', 'PARAMETER stop "<|im_end|>"']  # the GGUF's end-of-generation tokens


def test_export_leaves_out_a_system_text_ollama_cannot_read_back_with_one_notice(tmp_path, tiny, capsys):
    """Ollama's Modelfile parser drops U+2063 (not strconv.IsPrint), so SYSTEM would reach it without;
    the rest of the Modelfile is written."""
    base, adapter = tiny
    record_template(adapter, SMOL.replace("You are helpful.", "You are\u2063helpful."))
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 0
    assert capsys.readouterr().err == ("Modelfile: SYSTEM 'You are\\u2063helpful.' left out: Ollama's Modelfile "
                                       "parser drops the character U+2063, so no quoting gives it back\n")
    text = (tmp_path / "out" / "Modelfile").read_text()
    assert "# SYSTEM 'You are\\u2063helpful.' left out: " in text and "\nSYSTEM" not in text
    assert 'PARAMETER stop "<|im_end|>"' in text and "\u2063" not in text


def test_training_template_from_adapter_config_or_the_checkpoint_config(tmp_path, tiny):
    _, adapter = tiny
    assert training_template(str(adapter)) is None
    (adapter / "config.yaml").write_text("data:\n  chat_template: chatml\n")
    from dtrain.data.templates import CHATML as NAMED_CHATML

    assert training_template(str(adapter)) == NAMED_CHATML
    record_template(adapter, "T")
    assert training_template(str(adapter)) == "T"
    from conftest import make_tiny_model

    from dtrain.config import LoraConfig

    model = make_tiny_model("llama")
    assert adapter_config(LoraConfig(), model, None, "T")["chat_template"] == "T"
    assert "chat_template" not in adapter_config(LoraConfig(), model, None, None)



@pytest.mark.parametrize("text, problem", [
    ("data: [\n", "line 2 invalid YAML: expected the node content, but found '<stream end>'"),
    ("- 1\n", "data.chat_template unreadable: not a mapping of config sections"),
    ("data: 5\n", "data.chat_template unreadable: section 'data' is 5, not a mapping"),
    ("data: {chat_template: 5}\n", "data.chat_template is 5, not a template name or Jinja file"),
])
def test_a_checkpoint_config_that_cannot_be_read_is_named_not_a_traceback(tmp_path, tiny, capsys, text, problem):
    """Exporting a checkpoint folder whose config.yaml was damaged or hand-edited ended in yaml's ParserError,
    AttributeError or TypeError traceback."""
    base, adapter = tiny
    (adapter / "config.yaml").write_text(text)
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {adapter / 'config.yaml'}: {problem}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recorded, problem", [
    ("{% for m in messages %}{{ m['content'] }", "Jinja syntax error on line 1: unexpected '}'"),
    (["{{ m }}"], "a JSON array, not a Jinja template's text"),
])
def test_a_recorded_chat_template_that_cannot_render_is_named_not_exported(tmp_path, tiny, capsys, recorded, problem):
    """A hand-edited adapter_config.json chat_template was written into the folder and the GGUF as it was (a syntax
    error: mlx_lm.generate and llama.cpp --jinja fail on the export; a list: save_pretrained's traceback)."""
    base, adapter = tiny
    record_template(adapter, recorded)
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 2
    assert capsys.readouterr().err == f"dtrain: error: {adapter / 'adapter_config.json'}: chat_template: {problem}\n"
    assert not (tmp_path / "out").exists()

def quant_error_by_hand(result, base, adapter_dir, gguf_type):
    """‖Q(W+ΔW) − (W+ΔW)‖ and ‖ΔW‖ of one matrix, recomputed from the files."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from safetensors.numpy import load_file

    fused = dict(tree_flatten(load(str(result.folder))[0].parameters()))
    w = np.array(fused["model.layers.1.mlp.down_proj.weight"], dtype=np.float32)
    qtype = Q[gguf_type.upper()]
    err = np.linalg.norm(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype) - w)
    lora = load_file(str(adapter_dir / "adapters.safetensors"))
    scale = json.loads((adapter_dir / "adapter_config.json").read_text())["lora_parameters"]["scale"]
    a, b = (lora[f"model.layers.1.mlp.down_proj.lora_{x}"] for x in "ab")
    return err, np.linalg.norm(scale * (b.T @ a.T))


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0"])
def test_quantization_error_against_the_update_and_the_warning(tmp_path, tiny, gguf_type, capsys):
    base, adapter = tiny
    out = tmp_path / "out"
    assert main(["export", str(adapter), "--base", str(base), "--out", str(out), "--gguf", gguf_type,
                 "--dtype", "float32"]) == 0
    printed = capsys.readouterr()
    # the same export through the API gives the per-matrix numbers
    result = export_adapter(str(adapter), str(base), str(tmp_path / "api"), gguf_type=gguf_type, dtype="float32")
    assert len(result.quant_error) == 4 * 7
    err, upd = quant_error_by_hand(result, base, adapter, gguf_type)
    got_err, got_upd = result.quant_error["blk.1.ffn_down.weight"]
    assert got_err == pytest.approx(err, rel=1e-5) and got_upd == pytest.approx(upd, rel=1e-5)
    ratio = result.quant_ratio()
    total = np.sqrt(sum(e * e for e, _ in result.quant_error.values())) / np.sqrt(
        sum(u * u for _, u in result.quant_error.values()))
    assert ratio == pytest.approx(total)
    warned = "warning:" in printed.err
    assert warned == (ratio > QUANT_WARN_RATIO)
    if warned:
        assert f"{gguf_type.upper()} rounding moves the adapted weights {ratio:.1f}x as far as the adapter's " \
               "update does" in printed.err


def test_q4_0_rounding_that_swamps_a_small_update_warns(tmp_path, capsys):
    base = tmp_path / "base.gguf"
    write_tiny_llama(base, {})
    adapter = tmp_path / "small"
    write_adapter(str(base), adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["lora_parameters"]["scale"] = 0.002  # a tiny update: rounding dwarfs it
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "o4"), "--gguf", "q4_0"]) == 0
    err = capsys.readouterr().err
    assert "warning: Q4_0 rounding moves the adapted weights" in err and "28 adapted matrices, 28 of them above 1x" in err
    assert main(["export", str(adapter), "--base", str(base), "--out", str(tmp_path / "f16"), "--gguf", "f16"]) == 0
    assert "warning" not in capsys.readouterr().err  # no block rounding measured for f16


def test_a_folder_base_keeps_its_generation_config_and_code_files(tmp_path):
    """mlx_lm.fuse copies the base folder's generation_config.json and *.py files; the export kept only its
    own eos_token_id, so transformers' generate lost the base's sampling defaults (and remote code its files)."""
    from fixtures_launch import make_model_folder
    from transformers import GenerationConfig

    base = make_model_folder(tmp_path / "model")
    (base / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    (base / "modeling_tiny.py").write_text("# remote code\n")
    write_adapter(str(base), tmp_path / "adapter")
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"))
    saved = json.loads((result.folder / "generation_config.json").read_text())
    assert saved == {"bos_token_id": 1, "eos_token_id": [2, 4], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    gen = GenerationConfig.from_pretrained(str(result.folder))
    assert (gen.temperature, gen.top_p, gen.eos_token_id) == (0.6, 0.9, [2, 4])
    assert (result.folder / "modeling_tiny.py").read_text() == "# remote code\n"
    (base / "generation_config.json").write_text("{not json")  # mlx-lm ignores it too: the end tokens only
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out2"))
    assert json.loads((result.folder / "generation_config.json").read_text()) == {"eos_token_id": [2, 4]}


def test_a_folder_base_with_named_chat_templates_keeps_them_all(tmp_path):
    """A tokenizer_config.json with a list of named templates (default, tool_use) loads as a dict: the export
    wrote that dict as chat_template.jinja and failed with a TypeError traceback."""
    from fixtures_launch import make_model_folder
    from transformers import AutoTokenizer

    base = make_model_folder(tmp_path / "model")
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    tools = "TOOLS " + CHATML
    config["chat_template"] = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": tools}]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    write_adapter(str(base), tmp_path / "adapter")
    result = export_adapter(str(tmp_path / "adapter"), str(base), str(tmp_path / "out"))
    assert result.chat_template == CHATML and result.eos_token_ids == [2, 4]
    saved = AutoTokenizer.from_pretrained(str(result.folder)).chat_template
    assert saved == {"default": "{{ bos_token }}" + CHATML, "tool_use": "{{ bos_token }}" + tools}
    assert mlx_lm_prompt(result.folder, [{"role": "user", "content": "hi"}])[0] == 1


def mlx_lm_prompt(folder, messages):
    """The ids `mlx_lm.generate` (and mlx_lm.server) feed the model: the chat template's text, no special tokens
    added (transformers' apply_chat_template adds none either)."""
    from mlx_lm import load

    _, tok = load(str(folder))
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


@pytest.mark.parametrize("template", [None, PLAIN])
def test_folder_prompts_start_with_the_bos_training_put_there(tmp_path, tiny, template):
    """The tiny base's tokenizer adds BOS (add_bos_token) and neither its ChatML nor plain writes it: training
    (render.py) and llama.cpp put BOS first, mlx-lm's generate did not, so the merged folder ran without it."""
    from dtrain.config import DataConfig
    from dtrain.data import tokenize_rows
    from dtrain.types import Row

    base, adapter = tiny
    if template is not None:
        record_template(adapter, template)
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16")
    cfg = DataConfig(chat_template=None if template is None else "plain")
    pairs, _ = tokenize_rows([Row("What is the capital of France?", "Paris", "London")],
                             load_model(str(base)).tokenizer, cfg)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert pairs[0].prompt[0] == 1 and mlx_lm_prompt(result.folder, messages) == pairs[0].prompt
    want = template or CHATML
    assert result.chat_template == want  # the GGUF's and the Modelfile's: llama.cpp and Ollama add BOS themselves
    assert gguf.GGUFReader(str(result.gguf)).fields["tokenizer.chat_template"].contents() == want
    assert (result.folder / "chat_template.jinja").read_text() == "{{ bos_token }}" + want


def test_folder_template_that_writes_bos_or_a_tokenizer_without_bos_is_kept():
    from conftest import make_tokenizer

    from dtrain.models.convert import with_bos

    llama3 = "{{ bos_token }}" + CHATML
    assert with_bos(make_tokenizer(add_bos=True), llama3) == llama3
    assert with_bos(make_tokenizer(add_bos=False), CHATML) == CHATML
    assert with_bos(make_tokenizer(add_bos=True), CHATML) == "{{ bos_token }}" + CHATML
    assert with_bos(make_tokenizer(add_bos=True), None) is None


@pytest.mark.parametrize("template", ["raw", "plain", "chatml"])
@pytest.mark.parametrize("content", ["What is 7 + 5?", " What", "\nWhat", "\u2581What"])
def test_folder_bos_keeps_the_first_fragment_prefix_training_gave(template, content):
    """A Metaspace ``prepend_scheme: first`` tokenizer (Mistral v0.3's) writes '▁' before a text's first fragment
    only: training's BOS + text gave ['<s>', '▁', 'What▁', ...], but the folder's '{{ bos_token }}' made the text
    follow a control token, so mlx-lm's generate saw ['<s>', 'What▁', ...] for a raw or plain prompt."""
    from chat_fixtures import metaspace_tokenizer

    from dtrain.config import DataConfig
    from dtrain.data import tokenize_rows
    from dtrain.data.templates import CHATML as NAMED_CHATML
    from dtrain.data.templates import RAW_TEXT, hf_tokenizer
    from dtrain.models.convert import with_bos
    from dtrain.types import Row

    tok = metaspace_tokenizer()
    jinja = {"raw": RAW_TEXT, "plain": PLAIN, "chatml": NAMED_CHATML}[template]
    cfg = DataConfig(prompt_template="raw") if template == "raw" else DataConfig(chat_template=template)
    pairs, _ = tokenize_rows([Row(content, "ANSWER: 12", "It is 13.")], tok, cfg)
    hf = hf_tokenizer(tok)
    text = hf.apply_chat_template([{"role": "user", "content": content}], chat_template=with_bos(tok, jinja),
                                  add_generation_prompt=True, tokenize=False)
    inference = hf.encode(text, add_special_tokens=False)
    assert inference[0] == hf.bos_token_id
    assert inference[: len(pairs[0].prompt)] == pairs[0].prompt  # plain's 'Assistant:' may straddle into the reply


def test_dora_update_is_what_the_merge_changes(tmp_path, tiny):
    """A DoRA adapter (mlx-lm's fine_tune_type dora) changes W by its magnitudes too: with lora_b zero
    scale * B A is zero, yet the merge rescales every row. The rounding error was measured against
    scale * B A alone (an infinite ratio and a warning here)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    base, _ = tiny
    model = load_model(str(base), dtype="float32").model
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 4, "scale": 2.0, "dropout": 0.0}, use_dora=True)
    weights = {k: 1.5 * v if k.endswith(".m") else v for k, v in tree_flatten(model.trainable_parameters())}
    adapter = tmp_path / "dora"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "dora", "num_layers": len(model.layers), "lora_parameters": {"rank": 4, "scale": 2.0,
                                                                                         "dropout": 0.0}}))
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="q8_0", dtype="float32")
    before = dict(tree_flatten(load_model(str(base), dtype="float32").model.parameters()))
    after = dict(tree_flatten(load_model(str(result.folder), dtype="float32").model.parameters()))
    _, update = result.quant_error["blk.1.ffn_down.weight"]
    name = "model.layers.1.mlp.down_proj.weight"
    assert update == pytest.approx(float(np.linalg.norm(np.array(after[name]) - np.array(before[name]))), rel=1e-4)
    assert result.quant_ratio() < 0.1 and result.quant_warning() is None


def test_the_rounding_warning_suggests_only_types_wider_than_the_one_written(tmp_path):
    """A q8_0 export's warning said "export a wider type (q8_0, f16)": q8_0 is the type it wrote."""
    from dtrain.models.export import ExportResult

    errors = {"blk.0.attn_q.weight": (5.0, 1.0)}
    q8 = ExportResult(tmp_path, gguf=tmp_path / "model-Q8_0.gguf", quant_error=errors).quant_warning()
    q4 = ExportResult(tmp_path, gguf=tmp_path / "model-Q4_0.gguf", quant_error=errors).quant_warning()
    assert q8.endswith("or export a wider type (f16)")
    assert q4.endswith("or export a wider type (q8_0, f16)")


def _rows(kind: str) -> list:
    if kind == "text":
        return [{"prompt": f"What is {i} + 1?\n", "chosen": f"{i + 1}", "rejected": "the fox"} for i in range(4)]
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "chosen": [{"role": "assistant", "content": f"{i + 1}"}],
             "rejected": [{"role": "assistant", "content": "the fox"}]} for i in range(4)]


@pytest.mark.parametrize("base_template, rows, want", [
    (CHATML, "text", "raw"),  # raw prompts on a ChatML base: ChatML was exported, the model never saw it
    (None, "messages", PLAIN),  # message rows on a base without a template: the implicit plain, not exported
    (CHATML, "messages", CHATML),  # message rows keep the model's template under raw
    (None, "text", None),  # raw text on a base without a template: nothing to add
])
def test_a_raw_prompt_run_exports_the_template_its_prompts_were_rendered_with(tmp_path, base_template, rows, want):
    """data.prompt_template: raw renders plain-text prompts as raw text and, on a base without a template,
    message rows in the plain format: the export is prompted that way, as training was."""
    from dtrain.data.templates import RAW_TEXT

    want = RAW_TEXT if want == "raw" else want
    base, data = tmp_path / "base.gguf", tmp_path / "pairs.jsonl"
    write_tiny_llama(base, {}, chat_template=base_template)
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(rows)))
    assert main(["train", "--model.path", str(base), "--data.train", str(data), "--data.prompt_template", "raw",
                 "--data.valid_fraction", "0", "--train.steps", "1", "--train.global_batch_pairs", "2",
                 "--train.micro_batch_pairs", "2", "--train.progress", "false", "--train.warmup_steps", "0",
                 "--train.output_dir", str(tmp_path / "run")]) == 0
    adapter = tmp_path / "run" / "adapters"
    recorded = json.loads((adapter / "adapter_config.json").read_text()).get("chat_template")
    assert recorded == (None if want in (None, base_template) else want)
    result = export_adapter(str(adapter), str(base), str(tmp_path / "out"), gguf_type="f16")
    assert result.chat_template == want
    fields = gguf.GGUFReader(str(result.gguf)).fields
    assert (fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None) == want
    from dtrain.data import tokenize_rows
    from dtrain.config import DataConfig
    from dtrain.data.formats import parse_rows

    trained, _ = tokenize_rows(parse_rows([("x", r) for r in _rows(rows)[:1]], DataConfig(), "x")[0],
                               load_model(str(base)).tokenizer, DataConfig(prompt_template="raw"))
    prompt = _rows(rows)[0]["prompt"]
    messages = prompt if rows == "messages" else [{"role": "user", "content": prompt}]
    if want is not None:  # mlx_lm.generate's prompt is the one training put before each response
        assert mlx_lm_prompt(result.folder, messages) == trained[0].prompt
