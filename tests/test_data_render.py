"""Rendering with the chat template, tokenization, BOS/EOT handling, truncation."""

from __future__ import annotations

from conftest import make_tokenizer

from dtrain.config import DataConfig
from dtrain.data import end_of_turn, tokenize_rows
from dtrain.data.formats import Row

Q = "What is 2 + 2?"
CHAT_Q = "<s><|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
HH = "\n\nHuman: What is 2 + 2?\n\nAssistant:"
FOX = "The quick brown fox jumps over the lazy dog"  # BOS + 9 tokens with the test tokenizer


def one_pair(tok, row, **cfg):
    pairs, report = tokenize_rows([row], tok, DataConfig(**cfg))
    assert report.bad == [] and report.dropped == [] and len(pairs) == 1
    return pairs[0]


def texts(tok, pair):
    return tok.decode(pair.prompt), tok.decode(pair.chosen), tok.decode(pair.rejected)


def test_end_of_turn_detected_from_template(tokenizer):
    assert end_of_turn(tokenizer) == ("<|im_end|>", [4])
    other = make_tokenizer("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}")
    assert end_of_turn(other) == ("</s>", [2])
    assert end_of_turn(make_tokenizer(chat_template=None)) == ("</s>", [2])


def test_standard_prompt_wrapped_as_user_turn_with_system(tokenizer):
    pair = one_pair(tokenizer, Row(Q, "4", "5", system="Be brief."))
    assert texts(tokenizer, pair) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n" + CHAT_Q[3:], "4<|im_end|>", "5<|im_end|>")
    assert (len(pair.prompt), len(pair.chosen), len(pair.rejected)) == (31, 2, 2)
    assert pair.prompt[0] == 1 and pair.prompt.count(1) == 1  # BOS once, at the start
    assert pair.chosen[-1] == 4 and pair.rejected_prompt is None


def test_raw_prompt_template(tokenizer):
    pair = one_pair(tokenizer, Row(Q, "4", "5", system="Be brief."), prompt_template="raw")
    assert texts(tokenizer, pair) == ("<s>Be brief.\n\nWhat is 2 + 2?", "4<|im_end|>", "5<|im_end|>")
    assert len(pair.prompt) == 19


def test_no_chat_template_uses_raw_text_and_eos():
    tok = make_tokenizer(chat_template=None)
    pair = one_pair(tok, Row(Q, "4", "5"))
    assert texts(tok, pair) == ("<s>What is 2 + 2?", "4</s>", "5</s>")


def test_append_eos_off(tokenizer):
    pair = one_pair(tokenizer, Row(Q, "4", "5"), append_eos=False)
    assert texts(tokenizer, pair) == (CHAT_Q, "4", "5") and (len(pair.prompt), len(pair.chosen)) == (18, 1)


def test_bos_not_doubled_when_template_writes_it():
    template = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    tok = make_tokenizer(template)
    pair = one_pair(tok, Row(Q, "4", "5"))
    assert tok.decode(pair.prompt) == CHAT_Q and pair.prompt[:2] == [1, 3] and pair.prompt.count(1) == 1
    assert 1 not in pair.chosen and 1 not in pair.rejected


def test_no_bos_when_tokenizer_adds_none():
    tok = make_tokenizer(add_bos=False)
    pair = one_pair(tok, Row(Q, "4", "5"))
    assert tok.decode(pair.prompt) == CHAT_Q[3:] and 1 not in pair.prompt


def test_transcript_rendered_as_chat_turns_or_raw(tokenizer):
    row = Row(HH, " 4", " 5", transcript=True)
    assert texts(tokenizer, one_pair(tokenizer, row)) == (CHAT_Q, "4<|im_end|>", "5<|im_end|>")
    pair = one_pair(tokenizer, row, prompt_template="raw")
    assert texts(tokenizer, pair) == ("<s>" + HH, " 4<|im_end|>", " 5<|im_end|>")
    assert (len(pair.prompt), len(pair.chosen), len(pair.rejected)) == (18, 3, 3)


def test_prompt_and_responses_tokenized_separately(tokenizer):
    pair = one_pair(tokenizer, Row(Q, "4", "5"))
    assert pair.prompt == tokenizer.encode(CHAT_Q[3:])  # post-processor adds the one BOS
    assert pair.chosen == tokenizer.encode("4", add_special_tokens=False) + [4]


def test_multi_message_completion(tokenizer):
    u = [{"role": "user", "content": "hi"}]
    tail = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}]
    pair = one_pair(tokenizer, Row(u, tail, "w"))
    assert texts(tokenizer, pair) == ("<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                      "x<|im_end|>\n<|im_start|>user\ny<|im_end|>\n<|im_start|>assistant\nz<|im_end|>",
                                      "w<|im_end|>")
    assert (len(pair.prompt), len(pair.chosen)) == (11, 14)


def test_rejected_prompt_only_when_histories_differ(tokenizer):
    u = [{"role": "user", "content": "hi"}]
    pair = one_pair(tokenizer, Row(u + [{"role": "user", "content": "a"}], "x", "w",
                                   rejected_prompt=u + [{"role": "user", "content": "b"}]))
    assert tokenizer.decode(pair.prompt).endswith("user\na<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(pair.rejected_prompt).endswith("user\nb<|im_end|>\n<|im_start|>assistant\n")
    assert len(pair.prompt) == len(pair.rejected_prompt) == 17 and not pair.shared_prompt


def test_truncation_prompt_left_keeping_bos_then_responses_right(tokenizer):
    full = one_pair(tokenizer, Row(FOX, "Paris is the capital of France", "hello world"), prompt_template="raw")
    assert (len(full.prompt), len(full.chosen), len(full.rejected)) == (10, 8, 4)
    pairs, report = tokenize_rows([Row(FOX, "Paris is the capital of France", "hello world")], tokenizer,
                                  DataConfig(prompt_template="raw", max_prompt_length=5, max_length=12))
    (pair,) = pairs
    assert pair.prompt == full.prompt[:1] + full.prompt[-4:]  # BOS + last 4 tokens
    assert pair.chosen == full.chosen[:7] and pair.rejected == full.rejected  # 12 - 5 = 7 response tokens
    assert tokenizer.decode(pair.prompt) == "<s> over the lazy dog" and report.truncated == 1


def test_pair_with_no_room_for_a_response_is_dropped(tokenizer):
    row = Row(FOX, "Paris", "hello", source="f.jsonl:3")
    pairs, report = tokenize_rows([row], tokenizer, DataConfig(prompt_template="raw", max_prompt_length=20, max_length=10))
    assert pairs == [] and report.dropped == [("f.jsonl:3", "no response tokens fit in data.max_length=10 after a 10-token prompt")]
    pairs, report = tokenize_rows([row], tokenizer, DataConfig(prompt_template="raw", max_prompt_length=20, max_length=11))
    assert len(pairs[0].chosen) == len(pairs[0].rejected) == 1 and report.truncated == 1
