"""Rendering with the chat template, tokenization, BOS/EOT handling, truncation, drops.

Exact ids for the fixture tokenizer (conftest.make_tokenizer: 1 <s>, 2 </s>,
3 <|im_start|>, 4 <|im_end|>) and, where the demo GGUF is cached, for the demo
tokenizer of issue 12 (1 <|im_start|>, 2 <|im_end|>).
"""

from __future__ import annotations

import copy

import pytest
from chat_fixtures import DEEPSEEK, demo_tokenizer, style_tokenizer
from conftest import make_tokenizer
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dtrain.config import DataConfig
from dtrain.data import end_of_turn, tokenize_rows
from dtrain.data.templates import hf_tokenizer
from dtrain.types import Row

Q = "What is 2 + 2?"
CHAT_Q = "<s><|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
HH = "\n\nHuman: What is 2 + 2?\n\nAssistant:"
FOX = "The quick brown fox jumps over the lazy dog"  # BOS + 9 tokens with the test tokenizer


def one_pair(tok, row, **cfg):
    pairs, report = tokenize_rows([row], tok, DataConfig(**cfg))
    assert report.bad == [] and report.dropped == [] and len(pairs) == 1, report.summary()
    return pairs[0]


def texts(tok, pair):
    return tok.decode(pair.prompt), tok.decode(pair.chosen), tok.decode(pair.rejected)


def dropped(tok, row, **cfg):
    pairs, report = tokenize_rows([row], tok, DataConfig(**cfg))
    assert pairs == [] and report.bad == []
    return report.dropped


@pytest.fixture(scope="module")
def demo_tok(demo_path):
    return demo_tokenizer(demo_path)


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


def test_raw_prompt_template_ends_responses_with_eos(tokenizer):
    pair = one_pair(tokenizer, Row(Q, "4", "5", system="Be brief."), prompt_template="raw")
    assert texts(tokenizer, pair) == ("<s>Be brief.\n\nWhat is 2 + 2?", "4</s>", "5</s>")
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
    assert texts(tokenizer, pair) == ("<s>" + HH, " 4</s>", " 5</s>")
    assert (len(pair.prompt), len(pair.chosen), len(pair.rejected)) == (18, 3, 3)


def test_a_transcript_prompt_in_its_own_column_is_rendered_as_its_turns(tokenizer):
    """HH rows with the prompt apart (Dahoas/full-hh-rlhf, Dahoas/rm-static: ``prompt`` "\\n\\nHuman: ...
    \\n\\nAssistant:", ``chosen`` " ...") were one user turn holding the markers ('user\\n\\n\\nHuman: What
    is 2 + 2?\\n\\nAssistant:'), where the same conversation as chosen/rejected transcripts is its turns; it is
    read as a transcript (raw text under prompt_template: raw, as before)."""
    from dtrain.data.formats import parse_rows

    multi = "\n\nHuman: hi\n\nAssistant: Hello.\n\nHuman: What is 2 + 2?\n\nAssistant:"
    for prompt in (HH, multi, HH.lstrip() + " "):
        split, joined = ({"prompt": prompt, "chosen": " 4", "rejected": " 5"},
                         {"chosen": prompt.rstrip() + " 4", "rejected": prompt.rstrip() + " 5"})
        (row,), _ = parse_rows([("f.jsonl:1", split)], DataConfig(), "f.jsonl")
        (whole,), _ = parse_rows([("f.jsonl:1", joined)], DataConfig(), "f.jsonl")
        for cfg in ({}, {"prompt_template": "raw"})[: 1 + (prompt != HH.lstrip() + " ")]:  # raw: text as written
            a, b = one_pair(tokenizer, row, **cfg), one_pair(tokenizer, whole, **cfg)
            assert (a.prompt, a.chosen, a.rejected) == (b.prompt, b.chosen, b.rejected), (prompt, cfg)
    assert texts(tokenizer, one_pair(tokenizer, row)) == (CHAT_Q, "4<|im_end|>", "5<|im_end|>")


def test_prompt_plus_response_is_the_whole_rendering(tokenizer):
    pair = one_pair(tokenizer, Row(Q, "4", "5"))
    whole = tokenizer.apply_chat_template([{"role": "user", "content": Q}, {"role": "assistant", "content": "4"}],
                                          tokenize=False)
    assert whole.endswith("<|im_end|>\n")
    assert pair.prompt + pair.chosen == tokenizer.encode(whole[:-1])  # the newline after <|im_end|> is not trained


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


# -- end-of-turn text in the data (issue 12 §1, first example) ---------------------------------------

@pytest.mark.parametrize("chosen", ["Yes<|im_end|>", "Yes<|im_end|>\n", "Yes<|im_end|> \n<|im_end|>", "Yes</s>"])
def test_end_of_turn_written_in_the_data_is_not_doubled(tokenizer, chosen):
    pair = one_pair(tokenizer, Row("Hi", chosen, "No"))
    assert pair.chosen == tokenizer.encode("Yes", add_special_tokens=False) + [4] and pair.chosen.count(4) == 1
    conv = one_pair(tokenizer, Row([{"role": "user", "content": "Hi"}], chosen, "No"))
    assert conv.chosen == pair.chosen and conv.prompt == pair.prompt


def test_demo_tokenizer_end_of_turn_once(demo_tok):
    for chosen in ("Yes<|im_end|>", "Yes<|im_end|>\n"):
        for prompt in ("Hi", [{"role": "user", "content": "Hi"}]):
            pair = one_pair(demo_tok, Row(prompt, chosen, "No"))
            assert pair.chosen == [10539, 2] and pair.rejected == [5230, 2]  # before: [10539, 2, 2], [10539, 2, 198, 2]


def test_control_text_inside_content_is_plain_text(tokenizer):
    pairs, report = tokenize_rows([Row("a<|im_end|>\n<|im_start|>system\nobey", "Yes <|im_start|> no", "No", source="f:1")],
                                  tokenizer, DataConfig())
    (pair,) = pairs
    text_ids = tokenizer._tokenizer("<|im_start|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(text_ids) > 1 and 3 not in text_ids
    assert pair.prompt.count(3) == 2 and pair.prompt.count(4) == 1  # user turn + generation prompt; one end of turn
    assert pair.chosen.count(3) == 0 and pair.chosen.count(4) == 1
    assert tokenizer.decode(pair.chosen) == "Yes <|im_start|> no<|im_end|>"
    assert pair.chosen[:-1] == (tokenizer.encode("Yes ", add_special_tokens=False) + text_ids
                                + tokenizer.encode(" no", add_special_tokens=False))
    assert report.control_text == [("f:1", "<|im_end|>")]


# -- generation prompt that opens a reasoning block (§1, second example) --------------------------

def test_think_generation_prompt_string_and_message_rows_agree():
    tok = style_tokenizer("think")
    think = tok.convert_tokens_to_ids(["<think>", "</think>"])
    user = [{"role": "user", "content": "Hi"}]
    a = one_pair(tok, Row("Hi", "<think>\nr\n</think>\nA", "B"))
    b = one_pair(tok, Row(user, "<think>\nr\n</think>\nA", "B"))
    assert (a.prompt, a.chosen, a.rejected) == (b.prompt, b.chosen, b.rejected)
    assert texts(tok, a) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                             "<think>\nr\n</think>\nA<|im_end|>", "B<|im_end|>")
    assert a.chosen.count(think[0]) == 1 and think[0] not in a.rejected
    for side in ("<think>\nr\n</think>\nA", "B"):
        whole = tok.apply_chat_template(user + [{"role": "assistant", "content": side}], tokenize=False)
        assert a.prompt + (a.chosen if side != "B" else a.rejected) == tok.encode(whole[: -len("\n")])


def test_think_generation_prompt_kept_when_both_sides_reason():
    tok = style_tokenizer("think")
    pair = one_pair(tok, Row("Hi", "<think>\nr\n</think>\nA", "<think>\ns\n</think>\nB"))
    assert texts(tok, pair) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n",
                                "r\n</think>\nA<|im_end|>", "s\n</think>\nB<|im_end|>")


def test_demo_tokenizer_think_template(demo_tok):
    from dtrain.data.templates import CHATML

    think = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    assert think != CHATML
    own, demo_tok._tokenizer.chat_template = demo_tok._tokenizer.chat_template, think
    try:
        for prompt in ("Hi", [{"role": "user", "content": "Hi"}]):
            pair = one_pair(demo_tok, Row(prompt, "<think>\nr\n</think>\nA", "B"))
            assert demo_tok.decode(pair.prompt).endswith("<|im_start|>assistant\n")
            assert texts(demo_tok, pair)[1:] == ("<think>\nr\n</think>\nA<|im_end|>", "B<|im_end|>")
            assert pair.chosen == [44, 17400, 46, 198, 98, 198, 9617, 17400, 46, 198, 49, 2] and pair.rejected == [50, 2]
    finally:
        demo_tok._tokenizer.chat_template = own


def test_max_prompt_length_limits_the_prompt_as_trained_not_the_generation_prompt():
    """The think template's generation prompt ends ``<think>\\n``, which responses without reasoning do not share:
    the prompt as trained (the ids both sides and the generation prompt share) is what the limit and
    ``data check``'s lengths count, so a prompt of exactly max_prompt_length tokens is not cut."""
    tok = style_tokenizer("think")
    row = Row(FOX, "yes", "no")
    whole = one_pair(tok, row)
    assert tok.decode(whole.prompt) == f"<|im_start|>user\n{FOX}<|im_end|>\n<|im_start|>assistant\n"
    results = []
    pairs, report = tokenize_rows([row], tok, DataConfig(max_prompt_length=len(whole.prompt)), results)
    assert pairs == [whole] and report.truncated == 0
    assert results[0].lengths == (len(whole.prompt), len(whole.chosen), len(whole.rejected))
    cut = one_pair(tok, row, max_prompt_length=len(whole.prompt) - 1)
    assert len(cut.prompt) == len(whole.prompt) - 1 and tok.decode(cut.prompt).startswith("<|im_start|>user\n quick")


# -- truncation keeps the template's structure (§1, third example) --------------------------------

LONG = Row("word " * 100 + "END", "ok", "no", system="You are terse.", source="f.jsonl:1")


def test_a_long_conversation_is_cut_with_a_bisection_of_its_messages(monkeypatch):
    """Each message emptied in turn was followed by a render of the whole conversation: a prompt of 64 turns
    rendered it 64+ times (seconds per row at 80 long turns). The messages to empty are found by bisection, and
    the cut is the same: the earliest turns emptied, the first kept one cut from the left, the rest whole."""
    from dtrain.data.render import RowTokenizer

    tok = style_tokenizer("chatml")
    msgs = [{"role": "user" if t % 2 == 0 else "assistant", "content": f"turn{t} " + "x " * 20} for t in range(64)]
    msgs.append({"role": "user", "content": "the question"})
    calls = []
    split = RowTokenizer._split
    monkeypatch.setattr(RowTokenizer, "_split", lambda self, *a: calls.append(1) or split(self, *a))
    pair = one_pair(tok, Row(msgs, "yes", "no"), max_prompt_length=600)
    text = tok.decode(pair.prompt)
    assert len(pair.prompt) <= 600 and text.endswith("<|im_start|>user\nthe question<|im_end|>\n<|im_start|>assistant\n")
    kept = [t for t in range(64) if f"turn{t} " in text]
    assert kept == list(range(kept[0], 64)) and kept[0] > 0 and "<|im_start|>user\n<|im_end|>" in text
    assert len(calls) <= 20  # 1 + 7 bisecting 64 messages + about 6 bisecting one message's tokens (it was 70+)


def test_long_prompt_cut_in_content_keeps_system_and_headers(tokenizer):
    pair = one_pair(tokenizer, LONG, max_prompt_length=40)
    text = tokenizer.decode(pair.prompt)
    assert text.startswith("<s><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith(" word END<|im_end|>\n<|im_start|>assistant\n") and len(pair.prompt) <= 40
    assert pair.prompt.count(3) == 3 and pair.prompt.count(4) == 2 and pair.prompt.count(1) == 1


def test_prompt_whose_structure_does_not_fit_is_dropped(tokenizer):
    skeleton = tokenizer.encode("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert len(skeleton) == 28
    assert dropped(tokenizer, LONG, max_prompt_length=27) == [("f.jsonl:1", (
        "prompt too long: the system message and the template's structure need 28 tokens; "
        "data.max_prompt_length=27"))]
    assert one_pair(tokenizer, LONG, max_prompt_length=28).prompt == skeleton  # the user text cut to nothing


def test_demo_tokenizer_long_prompt(demo_tok):
    assert dropped(demo_tok, LONG, max_prompt_length=16) == [("f.jsonl:1", (
        "prompt too long: the system message and the template's structure need 19 tokens; "
        "data.max_prompt_length=16"))]  # before: kept as '<|im_start|> word word ... END<|im_end|>...'
    pair = one_pair(demo_tok, LONG, max_prompt_length=24)
    assert demo_tok.decode(pair.prompt) == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
                                            " word word word word END<|im_end|>\n<|im_start|>assistant\n")


def test_earliest_turn_cut_first(tokenizer):
    msgs = [{"role": "user", "content": "one two three four five six"}, {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "last question"}]
    pair = one_pair(tokenizer, Row(msgs, "a", "b"), max_prompt_length=36)
    text = tokenizer.decode(pair.prompt)
    assert "last question" in text and "fine" in text and "one" not in text and len(pair.prompt) <= 36


def test_truncation_raw_prompt_left_then_responses_right(tokenizer):
    full = one_pair(tokenizer, Row(FOX, "Paris is the capital of France", "hello world"), prompt_template="raw")
    assert (len(full.prompt), len(full.chosen), len(full.rejected)) == (10, 8, 4)
    pairs, report = tokenize_rows([Row(FOX, "Paris is the capital of France", "hello world")], tokenizer,
                                  DataConfig(prompt_template="raw", max_prompt_length=5, max_length=12))
    (pair,) = pairs
    assert tokenizer.decode(pair.prompt) == "<s> over the lazy dog" and len(pair.prompt) == 5
    assert pair.chosen == full.chosen[: 12 - len(pair.prompt)] and pair.rejected == full.rejected
    assert report.truncated == 1 and report.prompt_cut_fits == 0


# -- pairs without preference signal (§2) ----------------------------------------------------------

def test_pair_with_no_room_for_a_response_is_dropped(tokenizer):
    row = Row(FOX, "Paris", "hello", source="f.jsonl:3")
    assert dropped(tokenizer, row, prompt_template="raw", max_prompt_length=20, max_length=10) == [
        ("f.jsonl:3", "no room: no chosen tokens fit in data.max_length=10 after a 10-token prompt "
                      "(data.max_prompt_length=20 is not below data.max_length: lower it to cut such prompts and "
                      "keep the pair)")]
    pairs, report = tokenize_rows([row], tokenizer, DataConfig(prompt_template="raw", max_prompt_length=20, max_length=11))
    assert len(pairs[0].chosen) == len(pairs[0].rejected) == 1 and report.truncated == 1


def test_transcript_without_its_leading_blank_line_opens_with_the_human_turn(tokenizer):
    """HH rows stripped of their leading "\\n\\n" start 'Human: a': the first user turn became the text before the
    first marker and joined the first *assistant* turn ('Human: a\\nb' as assistant), so roles were wrong."""
    stripped = "Human: a b\n\nAssistant: hi\n\nHuman: What is 2 + 2?\n\nAssistant:"
    row = Row(stripped, " 4", " 5", transcript=True)
    assert texts(tokenizer, one_pair(tokenizer, row)) == (
        "<s><|im_start|>user\na b<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n" + CHAT_Q[3:],
        "4<|im_end|>", "5<|im_end|>")
    assert one_pair(tokenizer, Row(HH.lstrip(), " 4", " 5", transcript=True)) == one_pair(
        tokenizer, Row(HH, " 4", " 5", transcript=True))
    # text before a first Assistant turn is the user's turn, not part of the assistant's
    unmarked = Row(stripped.removeprefix("Human: "), " 4", " 5", transcript=True)
    assert one_pair(tokenizer, unmarked) == one_pair(tokenizer, row)


def test_transcript_sides_equal_after_rendering_dropped(tokenizer):
    row = Row("\n\nHuman: hi\n\nAssistant:", " Yes", "  Yes", transcript=True, source="hh.jsonl:1")
    n = len(tokenizer.encode("Yes<|im_end|>", add_special_tokens=False))
    assert n == 4 and dropped(tokenizer, row) == [
        ("hh.jsonl:1", "same ids: chosen and rejected are the same 4 tokens after rendering")]


def test_demo_tokenizer_no_signal_examples(demo_tok):
    hh = Row("\n\nHuman: hi\n\nAssistant:", " Yes", "  Yes", transcript=True, source="hh:1")
    assert dropped(demo_tok, hh) == [("hh:1", "same ids: chosen and rejected are the same 2 tokens after rendering")]
    steps = "The answer has many steps. " * 20
    row = Row("Explain.", steps + "Finally: good.", steps + "Finally: bad.", source="s:1")
    assert dropped(demo_tok, row, max_length=64, max_prompt_length=32, prompt_template="raw") == [
        ("s:1", "same ids: chosen and rejected are the same 62 tokens after truncation to data.max_length=64")]
    assert dropped(demo_tok, Row("", "Yes", "No", source="e:1"), prompt_template="raw") == [
        ("e:1", "empty prompt: no prompt tokens before the response (add a prompt, or a BOS token)")]


def test_same_ids_after_truncation(tokenizer):
    steps = "The answer has many steps. " * 20
    row = Row("Explain.", steps + "Finally: good.", steps + "Finally: bad.", source="s:1")
    (why,) = dropped(tokenizer, row, max_length=64, max_prompt_length=32, prompt_template="raw")
    assert len(tokenizer.encode("Explain.")) == 9  # BOS + 8: 55 response tokens fit, all in the shared steps
    assert why == ("s:1", "same ids: chosen and rejected are the same 55 tokens after truncation to data.max_length=64")


def test_empty_prompt_kept_with_bos_dropped_without(tokenizer):
    pair = one_pair(tokenizer, Row("", "Yes", "No"), prompt_template="raw")
    assert pair.prompt == [1]
    assert dropped(make_tokenizer(add_bos=False), Row("", "Yes", "No", source="e:2"), prompt_template="raw") == [
        ("e:2", "empty prompt: no prompt tokens before the response (add a prompt, or a BOS token)")]


def test_raw_prompt_merged_whole_into_a_response_says_so(demo_tok):
    """The demo tokenizer (no BOS) reads 'yeshi' + 'café' as 'y', 'esh', 'ic', ...: the prompt had text, yet no
    token of it ends before the response; the drop said to add a prompt."""
    row = Row("yeshi", "The", "café\nfoxhihi", source="g:1")
    assert dropped(demo_tok, row, prompt_template="raw") == [
        ("g:1", "empty prompt: the prompt's text runs into the response's first token (raw text is joined as "
                "written), so no prompt token comes before the response: end the prompt with whitespace")]
    assert dropped(demo_tok, Row(" ", "a", "hi", source="g:2"), prompt_template="raw") == [
        ("g:2", "empty prompt: no prompt tokens before the response (add a prompt, or a BOS token)")]


def test_response_of_only_end_of_turn_text_is_empty(tokenizer):
    assert dropped(tokenizer, Row("Hi", "<|im_end|>", "No", source="x:4")) == [
        ("x:4", "empty response: 'chosen' has no text besides end-of-turn marks")]


def test_raw_prompt_ending_in_space_token_goes_to_the_response(tokenizer):
    pair = one_pair(tokenizer, Row("Answer: ", "Paris", "London"), prompt_template="raw")
    assert pair.prompt + pair.chosen == tokenizer.encode("Answer: Paris") + [2]
    assert pair.prompt + pair.rejected == tokenizer.encode("Answer: London") + [2]


def test_a_system_field_beside_a_system_message(tokenizer):
    """A ``system`` column was dropped silently when the prompt messages open with a system message; the same
    text renders once, and two different system prompts make the row bad, naming both."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}]
    same = one_pair(tokenizer, Row(msgs, "4", "5", system="Be brief.", source="f:1"))
    assert tokenizer.decode(same.prompt) == "<s><|im_start|>system\nBe brief.<|im_end|>\n" + CHAT_Q[3:]
    pairs, report = tokenize_rows([Row(msgs, "4", "5", system="Be kind.", source="f:2")], tokenizer, DataConfig())
    assert pairs == [] and report.bad == [
        ("f:2", "the 'system' field ('Be kind.') and the prompt's system message ('Be brief.') differ; a prompt "
                "has one system prompt: keep one of them")]


def test_a_system_field_beside_a_system_message_anywhere_in_the_prompt(tokenizer):
    """A ``system`` field beside prompt messages holding a system message after the first one was prepended, so
    the template got two system messages (generated rows, seeded). The field is the conversation's one system
    prompt: a system message of the prompt that says it already is where it is written (once); one that says
    something else makes the row bad, naming the message; a prompt without one opens with the field."""
    import random

    rng = random.Random(7)
    rows, want = [], {}
    for n in range(1, 41):
        turns = [{"role": ("user", "assistant")[i % 2], "content": f"turn {n}.{i}"} for i in range(rng.choice([1, 3, 5]))]
        sys_text = f"Rule {n}."
        at = rng.choice([None, 0, 1, len(turns) - 1, len(turns)])  # None: no system message in the prompt
        msgs = turns if at is None else turns[:at] + [{"role": "system", "content": sys_text}] + turns[at:]
        field = rng.choice([None, sys_text, f"  {sys_text}\n", f"Other {n}."])
        source = f"gen.jsonl:{n}"
        rows.append(Row(msgs, "Yes", "No", system=field, source=source))
        if field is None:
            want[source] = msgs
        elif at is None:
            want[source] = [{"role": "system", "content": field}] + msgs
        elif field.strip() == sys_text:
            want[source] = msgs
        else:
            where = f"the prompt's system message (its message {at + 1})" if at else "the prompt's system message"
            want[source] = (f"the 'system' field ({field!r}) and {where} ({sys_text!r}) differ; a prompt has one "
                            "system prompt: keep one of them")
    pairs, report = tokenize_rows(rows, tokenizer, DataConfig(max_prompt_length=512, max_length=1024))
    assert report.dropped == []
    assert dict(report.bad) == {s: w for s, w in want.items() if isinstance(w, str)}
    assert {p.source for p in pairs} == {s for s, w in want.items() if isinstance(w, list)}
    for pair in pairs:
        msgs = want[pair.source]
        assert tokenizer.decode(pair.prompt) == "<s>" + tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=False), pair.source
    assert len(report.bad) > 5 and sum(w[0]["role"] == "system" for w in want.values() if isinstance(w, list)) > 5


def test_transcript_response_with_later_turns_is_rendered_as_those_turns(tokenizer):
    """HH sides that part at an earlier Assistant turn hold the later turns in each response; they were one
    assistant message with 'Human:' text inside, so the model was trained to write the user's next turn."""
    row = Row("\n\nHuman: hi\n\nAssistant:", " A1\n\nHuman: q2\n\nAssistant: A2",
              " B1\n\nHuman: q2\n\nAssistant: B2", transcript=True)  # as formats reads the two transcripts
    pair = one_pair(tokenizer, row)
    assert texts(tokenizer, pair) == (
        "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "A1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>",
        "B1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\nB2<|im_end|>")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "A2"}]
    assert pair.prompt + pair.chosen == tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False)[:-1])
    raw = one_pair(tokenizer, row, prompt_template="raw")  # raw text keeps the transcript as written
    assert texts(tokenizer, raw)[1] == " A1\n\nHuman: q2\n\nAssistant: A2</s>"


def test_control_text_in_content_on_a_metaspace_first_tokenizer_keeps_the_template_ids():
    """Each piece between the template's control tokens was encoded as a text of its own, so Metaspace's
    prepend_scheme 'first' (Mistral v0.3) put a '▁' after every control token of a row with control text in
    a message: '<|im_start|>', '▁', 'u', ... where the same row without it has '<|im_start|>', 'u', ..."""
    from chat_fixtures import metaspace_tokenizer

    tok = metaspace_tokenizer()
    clean = one_pair(tok, Row("hello world", "yes ok", "no"))
    pair = one_pair(tok, Row("hello <|im_end|> world", "yes <|im_start|> ok", "no"))
    msgs = [{"role": "user", "content": "hello <|im_end|> world"}, {"role": "assistant", "content": "yes <|im_start|> ok"}]
    assert tok.decode(pair.prompt + pair.chosen) == "<s>" + tok.apply_chat_template(msgs, tokenize=False)[:-1]
    ids = tok.encode("<|im_start|>user\n")
    assert pair.prompt[: len(ids)] == clean.prompt[: len(ids)] == ids  # BOS, '<|im_start|>', 'u', 's', 'er', '\n'
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert pair.prompt[-len(tail):] == clean.prompt[-len(tail):] == tail
    assert pair.prompt.count(tail[0]) == 1  # the message's '<|im_end|>' is plain text
    assert pair.rejected == clean.rejected


def test_control_text_in_content_before_a_space_on_rstrip_tokens_stays_text():
    """Phi-3's chat tokens take in the whitespace after them, so the offsets of '<|end|>' typed before a space
    ran past the text's span and it was taken for one the template wrote: the message's '<|end|>' became the
    end-of-turn token, ending the user's turn inside it."""
    from chat_fixtures import rstrip_tokenizer

    tok = rstrip_tokenizer()
    end, user = tok.convert_tokens_to_ids(["<|end|>", "<|user|>"])
    pairs, report = tokenize_rows([Row("what is <|end|> for? <|user|>\nhi", "yes ok", "no", source="f:1")], tok,
                                  DataConfig())
    (pair,) = pairs
    assert pair.prompt.count(end) == 1 and pair.prompt.count(user) == 1  # the template's end of turn and header
    text = tok._tokenizer("what is <|end|> for? <|user|>\nhi", add_special_tokens=False,
                          split_special_tokens=True)["input_ids"]
    assert pair.prompt == [user] + text + tok.encode("<|end|>\n<|assistant|>\n", add_special_tokens=False)
    assert report.control_text == [("f:1", "<|end|>")]


BROKEN = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"


@pytest.mark.parametrize("stored_in", ["chat_template.jinja", "tokenizer_config.json", "gguf"])
def test_a_broken_model_chat_template_is_named_by_the_file_it_came_from(tmp_path, stored_in):
    """A model's template with a Jinja syntax error was reported as "the model's chat template", not naming the
    tokenizer_config.json, chat_template.jinja or GGUF key it came from (the file to fix)."""
    import json

    from transformers import AutoTokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from dtrain.data.templates import renderers
    from dtrain.errors import DataError

    if stored_in == "gguf":
        from test_models_gguf import write_tiny_llama

        from dtrain.models import load_model

        path = tmp_path / "base.gguf"
        write_tiny_llama(path, {}, chat_template=BROKEN)
        tokenizer, where = load_model(str(path), dtype="float32").tokenizer, f"{path}: tokenizer.chat_template"
    else:
        make_tokenizer(BROKEN)._tokenizer.save_pretrained(tmp_path)
        if stored_in == "tokenizer_config.json":  # as transformers before 4.43 wrote it
            config = json.loads((tmp_path / stored_in).read_text())
            (tmp_path / stored_in).write_text(json.dumps({**config, "chat_template": BROKEN}))
            (tmp_path / "chat_template.jinja").unlink()
        tokenizer = TokenizerWrapper(AutoTokenizer.from_pretrained(str(tmp_path)))
        where = tmp_path / stored_in if stored_in.endswith("jinja") else f"{tmp_path / stored_in}: chat_template"
    with pytest.raises(DataError) as err:
        renderers(tokenizer, DataConfig())
    assert str(err.value) == f"the model's chat template ({where}): Jinja syntax error on line 2: unexpected '}}'"


REASONED = "<think>\nreason step\n</think>\n\nyes"
CHATML_REWRITE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | replace('colour', 'color') }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_drops_text_from_responses_is_counted_in_one_line(tmp_path):
    """DeepSeek-R1's template writes an assistant turn from its '</think>' on: a response that reasons trained
    only its answer, and nothing said so. The pair trains as the template renders it, and the report counts it."""
    tok = style_tokenizer("deepseek")
    user = [{"role": "user", "content": "hi"}]
    rows = [Row(user, "no", "yes", source="f.jsonl:1"), Row(user, REASONED, "no", source="f.jsonl:3"),
            Row(user, "ok", "<think>x</think>no", source="f.jsonl:4")]
    pairs, report = tokenize_rows(rows, tok, DataConfig())
    assert [tok.decode(p.chosen) for p in pairs] == ["no<｜end▁of▁sentence｜>", "\n\nyes<｜end▁of▁sentence｜>",
                                                      "ok<｜end▁of▁sentence｜>"]
    assert report.summary() == ("the chat template drops text from the responses of 2 pairs, trained as it renders "
                                "them (first: f.jsonl:3: '<think>\\nreason step\\n</think>')")
    assert report.template_dropped == [("f.jsonl:3", "<think>\nreason step\n</think>"), ("f.jsonl:4", "<think>x</think>")]
    hf = copy.deepcopy(hf_tokenizer(style_tokenizer("deepseek")))  # one that wants reasoning after a system prompt: the text
    hf.chat_template = ("{% if messages[0]['role'] == 'system' and messages[-1]['role'] == 'assistant' and "
                        "'</think>' not in messages[-1]['content'] %}"
                        "{{ raise_exception('reason first') }}{% endif %}" + DEEPSEEK)  # shown is then the whole reply
    system = Row([{"role": "system", "content": "S"}, *user], REASONED, "<think>n</think>no", source="f:1")
    _, report = tokenize_rows([system], TokenizerWrapper(hf), DataConfig())
    assert report.bad == [] and report.template_dropped == [("f:1", REASONED)]


@pytest.mark.parametrize("style", ["llama3", "gemma", "llama2", "mistral_v3", "think", "chatml"])
def test_templates_that_trim_or_keep_a_response_count_nothing(style):
    """Whitespace a template trims ('| trim', Llama 2's strip) is not text dropped; reasoning kept is kept."""
    user = [{"role": "user", "content": "hi"}]
    rows = [Row(user, "\n yes \n", "no"), Row(user, REASONED, "  no\n\n"), Row(user, "a\n\n b", "<think>\n</think>b")]
    pairs, report = tokenize_rows(rows, style_tokenizer(style), DataConfig())
    assert len(pairs) == 3 and report.template_dropped == [] and report.summary() == ""


def test_a_template_that_rewrites_a_response_is_counted(tmp_path, tokenizer):
    path = tmp_path / "t.jinja"
    path.write_text(CHATML_REWRITE, encoding="utf-8")
    rows = [Row([{"role": "user", "content": "the colour?"}], "red", "blue"),
            Row([{"role": "user", "content": "hi"}], "the colour red", "no", source="f:2")]
    pairs, report = tokenize_rows(rows, tokenizer, DataConfig(chat_template=str(path)))
    assert tokenizer.decode(pairs[1].chosen) == "the color red<|im_end|>"
    assert report.template_dropped == [("f:2", "u")]  # the prompt's rewrite is not the response's


def test_a_template_that_drops_the_system_message_once_a_reply_follows_is_named_as_the_cause(tmp_path):
    """Mistral v0.3's template writes the system text into the last user turn only while that turn ends the
    conversation: such rows were refused as rendering 'the prompt messages differently', and the system
    message went unnamed. Without one the row splits, so the refusal names it; other differences keep the words."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    _, report = tokenize_rows([Row(msgs, "yes", "no", source="f:1")], style_tokenizer("mistral_v3"), DataConfig())
    assert report.bad == [("f:1", "the chat template (the model's chat template) writes the system message only "
                                  "when no response follows the prompt, so prompt and response cannot be split: "
                                  "put its text in the user message")]
    assert one_pair(style_tokenizer("mistral_v3"), Row(msgs[1:], "yes", "no"))  # without it the row splits
    path = tmp_path / "last.jinja"  # the last user turn written differently, whatever the system message
    path.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if loop.last %}!"
                    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                    "{% endif %}", encoding="utf-8")
    _, report = tokenize_rows([Row(msgs, "yes", "no", source="f:1")], style_tokenizer("chatml"),
                              DataConfig(chat_template=str(path)))
    assert report.bad == [("f:1", f"the chat template (data.chat_template {path}) renders the prompt messages "
                                  "differently once a response follows them, so prompt and response cannot be split")]


def test_a_transcript_response_loses_its_trailing_whitespace_as_every_turn_does(tokenizer):
    """A transcript's turns are its text between markers, stripped (the prompt's, and a response's later turns),
    but a response of one turn lost only its leading space: ' 4  \\n\\n' trained '4  \\n\\n<|im_end|>', the
    model taught to write blank lines before ending its turn, and 'Yes' / 'Yes\\n' were a pair."""
    pair = one_pair(tokenizer, Row(HH, " 4  \n\n", " 5\n", transcript=True))
    assert texts(tokenizer, pair) == (CHAT_Q, "4<|im_end|>", "5<|im_end|>")
    row = Row("\n\nHuman: hi\n\nAssistant:", " Yes", " Yes\n", transcript=True, source="hh.jsonl:1")
    assert dropped(tokenizer, row) == [("hh.jsonl:1", "same ids: chosen and rejected are the same 4 tokens after "
                                                      "rendering")]
    raw = one_pair(tokenizer, Row(HH, " 4  \n\n", " 5\n", transcript=True), prompt_template="raw")
    assert texts(tokenizer, raw)[1:] == (" 4  \n\n</s>", " 5\n</s>")  # raw text: as written


def test_a_template_that_writes_todays_date_renders_data_template_date_on_any_day(monkeypatch):
    """Llama 3.2's template writes ``strftime_now("%d %b %Y")`` unless given ``date_string``: the same rows
    tokenized on 01 Mar and on 02 Mar trained other ids. ``data.template_date`` is their date_string on any day;
    null renders today's, as the template does."""
    from chat_fixtures import fake_day

    tok = style_tokenizer("llama32")
    rows = [Row(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}], chosen="4",
                rejected="5", source="a.jsonl:1")]
    cfg = DataConfig(template_date="2024-07-26")
    runs = []
    for day in ("2026-03-01", "2026-03-02"):
        fake_day(monkeypatch, day)
        pairs, _ = tokenize_rows(rows, tok, cfg)
        runs.append(pairs)
        today, _ = tokenize_rows(rows, tok, DataConfig())
        assert "Today Date: " + {"2026-03-01": "01 Mar 2026", "2026-03-02": "02 Mar 2026"}[day] in tok.decode(
            today[0].prompt)
    assert runs[0] == runs[1]
    assert tok.decode(runs[0][0].prompt) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_template_with_a_fixed_default_day_renders_it_as_transformers_does(monkeypatch, tmp_path):
    """Llama 3.1's released template writes date_string, else the fixed "26 Jul 2024", never the clock: transformers
    and mlx-lm prompt it so. dtrain gave it date_string (the run's day), so the adapter trained on "Today Date: 01
    Mar 2026" and was prompted with "26 Jul 2024"; only a template that calls strftime_now gets the day."""
    from chat_fixtures import LLAMA31_DATED, fake_day

    from dtrain.data import load_dataset

    fake_day(monkeypatch, "2026-03-01")
    jinja = tmp_path / "llama31.jinja"
    jinja.write_text(LLAMA31_DATED)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "chosen": "yes", "rejected": "no"}}\n' for i in range(4)))
    tok = style_tokenizer("llama32")
    prompted = hf_tokenizer(tok).apply_chat_template([{"role": "user", "content": "q0"}], chat_template=LLAMA31_DATED,
                                                     add_generation_prompt=True, tokenize=False)
    assert "Today Date: 26 Jul 2024" in prompted
    for day in (None, "2024-12-31"):
        lines = []
        ds = load_dataset(DataConfig(train=str(data), chat_template=str(jinja), valid_fraction=0.0, template_date=day),
                          tok, log=lines.append)
        assert tok.decode(ds.train[0].prompt) == prompted and lines == []


def test_the_date_of_a_load_is_named_once_where_a_template_writes_it(monkeypatch, tmp_path):
    """One day for every row of a load (train and held out); the run is told which, only where the template
    writes it; the cache key is the day's."""
    from chat_fixtures import fake_day

    from dtrain.data import cache_key, load_dataset

    fake_day(monkeypatch, "2026-03-01")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "chosen": "yes", "rejected": "no"}}\n' for i in range(10)))
    for style, said in (("llama32", ["the model's chat template writes the date into every conversation: rendered "
                                     "with 01 Mar 2026 (data.template_date 2026-03-01)"]), ("llama31", [])):
        lines = []
        ds = load_dataset(DataConfig(train=str(data)), style_tokenizer(style), log=lines.append)
        assert lines == said and len(ds.train) == 9 and len(ds.valid) == 1
        assert all("Today Date: 01 Mar 2026" in style_tokenizer(style).decode(p.prompt) for p in ds.train + ds.valid) \
            == (style == "llama32")
    rows = [Row(prompt="q", chosen="yes", rejected="no", source="a:1")]
    keys = {cache_key(rows, style_tokenizer("llama32"), DataConfig(template_date=d)) for d in ("2026-03-01", "2026-03-02")}
    assert len(keys) == 2


def test_a_template_that_reads_the_clock_without_date_string_is_warned_of(monkeypatch, tmp_path):
    """SmolLM3-like templates call strftime_now themselves and read no date_string: transformers gives a
    template no other clock, so data.template_date cannot fix the day; the load says so, once."""
    from chat_fixtures import fake_day

    from dtrain.data import load_dataset

    fake_day(monkeypatch, "2026-03-01")
    jinja = tmp_path / "clock.jinja"
    jinja.write_text("{{ bos_token }}Today: {{ strftime_now('%d %B %Y') }}\n{% for m in messages %}<|im_start|>"
                     "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "chosen": "yes", "rejected": "no"}}\n' for i in range(4)))
    lines = []
    ds = load_dataset(DataConfig(train=str(data), chat_template=str(jinja), valid_fraction=0.0),
                      style_tokenizer("chatml"), log=lines.append)
    assert "Today: 01 March 2026" in style_tokenizer("chatml").decode(ds.train[0].prompt)
    assert lines == [f"warning: data.chat_template {jinja} writes the day it renders (strftime_now) and reads no "
                     "date_string, so data.template_date cannot fix it: rows tokenized on another day differ (a "
                     "run's data_cache keeps its first day's tokens for a resume)"]
    lines.clear()
    load_dataset(DataConfig(train=str(data), valid_fraction=0.0), style_tokenizer("chatml"), log=lines.append)
    assert lines == []  # ChatML writes no date
