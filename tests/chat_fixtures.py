"""Tiny tokenizers with the chat-template styles dtrain must reproduce.

Each is a byte-level BPE (vocab <= 600) trained in place with ``tokenizers``,
with its template's control tokens as special added tokens, wrapped by mlx-lm's
``TokenizerWrapper`` as dtrain loads models. ``CLOSING`` is what each template
writes after a final assistant message's content, :func:`turn_end` the part of it
that ends the turn (a response's last tokens).
"""

from __future__ import annotations

import datetime
from functools import lru_cache

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3: BOS written by the template, content trimmed, no newline after <|eot_id|>.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Gemma: the system text joins the first user turn, assistant is 'model', roles must alternate.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# A generation prompt that opens a reasoning block; <think> and </think> are ordinary added tokens (as in Qwen3).
THINK = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")

ALTERNATE = ("{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}")
# Llama 2: system in <<SYS>> inside the first user turn, BOS before each [INST], ' </s>' after each reply.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for m in loop_messages %}" + ALTERNATE +
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + m['content'] %}"
    "{% else %}{% set content = m['content'] %}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Mistral v0.1: one BOS, no system role (refused), EOS right after each reply, no generation prompt.
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}" + ALTERNATE +
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Mistral v0.3: the system text joins the last user turn only while that turn ends the conversation (a reply
# after it drops it), [INST]/[/INST] control tokens, replies trimmed after a space.
MISTRAL_V3 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\n\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' %}{{- ' ' + m['content'] | trim + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}{%- endif %}{%- endfor %}"
)
# Mistral v7 (Small 3): [SYSTEM_PROMPT] block, a default system prompt, [INST]/[/INST] control tokens.
MISTRAL_V7 = (
    "{%- set default_system_message = 'You are Mistral Small 3.' %}{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system_message = default_system_message %}"
    "{%- set loop_messages = messages %}{%- endif %}{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- for m in loop_messages %}{%- if m['role'] == 'user' %}{{- '[INST]' + m['content'] + '[/INST]' }}"
    "{%- elif m['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + m['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif m['role'] == 'assistant' %}{{- m['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}{%- endif %}{%- endfor %}"
)
# Phi-3: '<|end|>\n' after every turn, EOS once after the whole conversation (no generation prompt).
PHI3_EOS = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Llama 3.1: a system block always written (its date lines), content trimmed.
LLAMA31 = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' }}"
    "{{- system_message + '<|eot_id|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# Llama 3.2 as released (tools left out: dtrain refuses rows with tools): the system header's "Today Date"
# is `date_string`, else strftime_now("%d %b %Y") (transformers' global: the day it renders), else a fixed day.
LLAMA32 = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}"
    "{%- endif %}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = \"\" %}{%- endif %}"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}{{- system_message }}{{- \"<|eot_id|>\" }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Llama 3.1 as released: `date_string`, else the fixed "26 Jul 2024" (no clock: every day renders the same).
LLAMA31_DATED = LLAMA32.replace(
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}"
    "{%- set date_string = \"26 Jul 2024\" %}{%- endif %}", "{%- set date_string = \"26 Jul 2024\" %}")
# Qwen2.5: ChatML with a default system prompt where the messages have none.
QWEN25 = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# DeepSeek-R1: reasoning up to '</think>' dropped from assistant turns, a generation prompt that opens <think>.
DEEPSEEK = (
    "{{ bos_token }}{%- for m in messages %}{%- if m['role'] == 'system' %}{{ m['content'] }}"
    "{%- elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{%- elif m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{%- endif %}"
)
# Zephyr: EOS after every turn (user turns too), '<|assistant|>' without its newline as the generation prompt.
ZEPHYR = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token }}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}{% endfor %}"
)
# ChatML whose EOS closes only the whole conversation, after the last '<|im_end|>\n'.
CHATML_EOS = CHATML.replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}")
# ChatML with {% generation %} marks around each reply (transformers' assistant-token masks).
GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
STYLES = {
    # name: (template, special tokens, bos, eos, BOS added by the tokenizer, non-special added tokens)
    "chatml": (CHATML, ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"], "<s>", "</s>", True, []),
    "llama3": (LLAMA3, LLAMA_TOKENS, "<|begin_of_text|>", "<|end_of_text|>", True, []),
    "gemma": (GEMMA, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", True, []),
    "think": (THINK, QWEN_TOKENS, None, "<|im_end|>", False, ["<think>", "</think>"]),
    "base": (None, ["<s>", "</s>"], "<s>", "</s>", True, []),
    "llama2": (LLAMA2, ["<unk>", "<s>", "</s>"], "<s>", "</s>", True, []),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>"], "<s>", "</s>", True, []),
    "mistral_v3": (MISTRAL_V3, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", True, []),
    "mistral_v7": (MISTRAL_V7, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
                   "<s>", "</s>", True, []),
    "phi3": (PHI3_EOS, ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
             "<s>", "<|endoftext|>", False, []),
    "llama31": (LLAMA31, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>", True, []),
    "llama32": (LLAMA32, LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>", True, []),
    "qwen25": (QWEN25, QWEN_TOKENS, None, "<|im_end|>", False, []),
    "deepseek": (DEEPSEEK, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                 "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True, ["<think>", "</think>"]),
    "zephyr": (ZEPHYR, ["<unk>", "<s>", "</s>"], "<s>", "</s>", True, []),
    "chatml_eos": (CHATML_EOS, QWEN_TOKENS, None, "<|endoftext|>", False, []),
    "generation": (GENERATION, QWEN_TOKENS, None, "<|im_end|>", False, []),
}
# What each template writes after a final assistant message's content, and the end of the turn within it
# (Phi-3's '<|end|>': the EOS after it closes the whole conversation, not the turn).
CLOSING = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>\n", "think": "<|im_end|>\n",
           "llama2": " </s>", "mistral": "</s>", "mistral_v3": "</s>", "mistral_v7": "</s>", "phi3": "<|end|>\n<|endoftext|>",
           "llama31": "<|eot_id|>", "llama32": "<|eot_id|>", "qwen25": "<|im_end|>\n",
           "deepseek": "<｜end▁of▁sentence｜>", "zephyr": "</s>",
           "chatml_eos": "<|im_end|>\n<|endoftext|>", "generation": "<|im_end|>\n"}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "think": "<|im_end|>",
               "llama2": "</s>", "mistral": "</s>", "mistral_v3": "</s>", "mistral_v7": "</s>", "phi3": "<|end|>", "llama31": "<|eot_id|>",
               "llama32": "<|eot_id|>",
               "qwen25": "<|im_end|>", "deepseek": "<｜end▁of▁sentence｜>", "zephyr": "</s>", "chatml_eos": "<|im_end|>",
               "generation": "<|im_end|>"}
# templates whose rows with a system message are refused, and the words of the refusal: Mistral v0.1's raises,
# Mistral v0.3's drops the system text once a reply follows the prompt (so the prompt cannot be split off)
NO_SYSTEM = {"mistral": "cannot render this row: Conversation roles must alternate",
             "mistral_v3": "writes the system message only when no response follows the prompt"}


def turn_end(style: str) -> str:
    """The text a response of ``style`` is trained to end with: its closing up to the end of turn's token."""
    closing, end = CLOSING[style], END_OF_TURN[style]
    return closing[: closing.index(end) + len(end)]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris.",
    "user assistant system model Human: Assistant: hello world 0123456789 + - = ? yes no ok word",
    "think reason step answer café naïve 東京 emoji 🙂 tab\tnew\nline",
] * 20


@lru_cache(maxsize=None)
def style_tokenizer(style: str):
    """The mlx-lm-wrapped tokenizer of one style in :data:`STYLES` (built once per process)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, bos, eos, add_bos, added = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    extra = [t for t in specials if t not in (bos, eos)]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, additional_special_tokens=extra)
    if template:
        hf.chat_template = template
    return TokenizerWrapper(hf)


def demo_tokenizer(path):
    """The demo model's tokenizer (SmolLM2 GGUF), without loading its weights."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from dtrain.models.gguf import read_gguf
    from dtrain.models.tokenizer import build_tokenizer, eos_token_ids

    md = read_gguf(path)[0]
    return TokenizerWrapper(build_tokenizer(md), eos_token_ids=eos_token_ids(md))


@lru_cache(maxsize=None)
def metaspace_tokenizer():
    """A SentencePiece-style BPE whose pre-tokenizer is Metaspace with ``prepend_scheme: first`` (as in
    Mistral v0.3's tokenizer.json: ``▁`` before a text's first fragment only), ChatML template and tokens."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    corpus = [*_CORPUS, "<|im_start|> <|im_end|> </s>"]
    alphabet = sorted({c for line in corpus for c in line.replace(" ", "▁")})
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                        initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = CHATML
    return TokenizerWrapper(hf)


PHI3 = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@lru_cache(maxsize=None)
def rstrip_tokenizer():
    """Byte-level BPE with Phi-3's chat tokens, added with ``rstrip`` as Phi-3's tokenizer.json has them (a
    match takes in the whitespace after it: ``<|end|>\\n`` is one token), and its template."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, rstrip=True, special=True, normalized=False)
                            for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = PHI3
    return TokenizerWrapper(hf)


def fake_day(monkeypatch, day: str) -> None:
    """Make ``day`` (YYYY-MM-DD, a minute before midnight) today for transformers' ``strftime_now`` (a
    template's date) and dtrain's ``template_date``, both read from ``datetime.now()``."""
    import transformers.utils.chat_template_utils as hf_templates

    import dtrain.data.templates as templates

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls.strptime(day + " 23:59", "%Y-%m-%d %H:%M")

    for module in (hf_templates, templates):
        monkeypatch.setattr(module, "datetime", Clock)
