"""Property tests: what is trained is what the chat template renders (issue 12 §1, §2).

Generated conversations are written in every input format, parsed and
tokenized by dtrain, and compared with an oracle that uses only the
tokenizer's own ``apply_chat_template`` and ``encode``: for each side,
``prompt + response`` equals the ids of the rendered whole conversation up to
the end of the assistant turn, and the prompt ends where both sides' ids and
the generation prompt's ids part. Rows whose messages hold control-token text
are held to the text (decoded ids equal the rendering) and to the template's
structure (the control ids are exactly those the template writes).
"""

from __future__ import annotations

import json
import re

import pytest
from chat_fixtures import CLOSING, END_OF_TURN, STYLES, style_tokenizer
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from dtrain.config import DataConfig
from dtrain.data.formats import parse_rows
from dtrain.data.render import tokenize_rows
from dtrain.data.templates import PLAIN, RAW_TEXT, control_strings, hf_tokenizer

WORDS = ["hi", "yes", "no", "word", "The", "fox", "café", "東京", "🙂", "ok", "42"]
CONTROL = ["<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|start_header_id|>", "<end_of_turn>", "<start_of_turn>",
           "</s>", "<s>", "<eos>", "<bos>", "<|endoftext|>"]
PIECES = WORDS + [" ", "  ", "\n", "\t", "<think>", "</think>", "Human:", "Assistant:"] + CONTROL
FORMATS = ["standard", "fields", "conversational", "implicit", "transcript", "openai", "sharegpt"]
FLAT = {"standard", "fields", "transcript"}  # plain-text prompts (one user turn, or Human:/Assistant: text)
FIELDS = {"prompt": "question", "chosen": "good", "rejected": "bad", "system": "sys"}


def content(pieces):
    part = st.lists(st.sampled_from(pieces), max_size=4).map("".join)
    return st.tuples(part, st.sampled_from(WORDS), part).map("".join)


def conversations(fmt):
    """``(system or None, history turns ending with a user turn, chosen, rejected)``."""
    # transcripts are parsed by their \n\nHuman:/\n\nAssistant: markers, so no newlines or markers inside
    pieces = [p for p in PIECES if "\n" not in p and p not in ("Human:", "Assistant:")] if fmt == "transcript" else PIECES
    # half the rows hold no control-token text at all, so both oracles below see many rows
    return st.booleans().flatmap(lambda ctl: _conversation(fmt, pieces if ctl else [p for p in pieces if p not in CONTROL]))


def _conversation(fmt, pieces):
    text = content(pieces)
    if fmt == "transcript":
        text = text.map(str.strip).filter(bool)
    n_turns = st.integers(0, 0) if fmt in ("standard", "fields") else st.integers(0, 2)
    turns = n_turns.flatmap(lambda n: st.lists(text, min_size=2 * n + 1, max_size=2 * n + 1))
    return st.tuples(st.one_of(st.none(), text), turns, text, text)


def row_object(fmt, system, turns, chosen, rejected):
    """The conversation written in one input format (a JSON-able dict)."""
    hist = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    sys_msg = [{"role": "system", "content": system}] if system is not None else []
    asst = lambda c: [{"role": "assistant", "content": c}]  # noqa: E731
    if fmt == "standard":
        return {"prompt": turns[0], "chosen": chosen, "rejected": rejected, **({"system": system} if system else {})}
    if fmt == "fields":
        return {"question": turns[0], "good": chosen, "bad": rejected, **({"sys": system} if system else {})}
    if fmt == "conversational":
        return {"prompt": sys_msg + hist, "chosen": asst(chosen), "rejected": asst(rejected)}
    if fmt == "implicit":
        return {"chosen": sys_msg + hist + asst(chosen), "rejected": sys_msg + hist + asst(rejected)}
    if fmt == "transcript":
        text = "".join(f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in hist)
        return {"chosen": f"{text}\n\nAssistant: {chosen}", "rejected": f"{text}\n\nAssistant: {rejected}",
                **({"system": system} if system else {})}
    if fmt == "openai":
        return {"input": {"messages": sys_msg + hist}, "preferred_output": asst(chosen),
                "non_preferred_output": asst(rejected)}
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in sys_msg + hist],
            "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected}}


def strip_marks(text, marks):
    """The documented rule: end-of-turn / EOS text at the end of a message is dropped."""
    return re.sub("(?:(?:" + "|".join(map(re.escape, marks)) + ")\\s*)+$", "", text)


class Oracle:
    """Expected ids from the tokenizer's own template and encoder only."""

    def __init__(self, style, raw_text):
        self.tok, self.style = style_tokenizer(style), style
        self.hf = hf_tokenizer(self.tok)
        self.controls = control_strings(self.tok)
        self.control_ids = set(self.tok.convert_tokens_to_ids(list(self.controls)))
        if raw_text:  # plain prompts under prompt_template: raw, or with no template
            self.template, self.closing, self.eos = RAW_TEXT, "", True
        elif STYLES[style][0] is None:  # messages on a base model under prompt_template: raw
            self.template, self.closing, self.eos = PLAIN, "\n\n", True
        else:
            self.template, self.closing, self.eos = None, CLOSING[style], False
        self.marks = [m for m in (END_OF_TURN.get(style), self.tok.eos_token, self.closing.strip()) if m]

    def render(self, msgs, generation=False):
        kw = {"chat_template": self.template} if self.template else {}
        return self.hf.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False, **kw)

    def encode(self, text):
        bos = self.tok.bos_token
        return list(self.tok.encode(text, add_special_tokens=not (bos and text.startswith(bos))))

    def side(self, msgs):
        """``(ids, text)`` of the whole conversation up to the end of the final assistant turn."""
        text = self.render(msgs)
        assert text.endswith(self.closing)
        text = text[: len(text) - len(self.closing)] + self.closing.rstrip()
        return self.encode(text) + ([self.tok.eos_token_id] if self.eos else []), text

    def has_control(self, msgs):
        return any(c in m["content"] for m in msgs for c in self.controls)

    def bare(self, msgs):
        return [{**m, "content": re.sub("|".join(map(re.escape, self.controls)), "", m["content"])} for m in msgs]

    def bos(self, msgs):
        """The BOS text the tokenizer adds: none when the template itself starts with BOS."""
        bos, adds = self.tok.bos_token, STYLES[self.style][4]
        return bos if adds and not self.render(self.bare(msgs)).startswith(bos) else ""

    def structure(self, msgs):
        """Control ids the template itself writes for ``msgs`` (content control text removed)."""
        return [i for i in self.side(self.bare(msgs))[0] if i in self.control_ids]


def expected_messages(fmt, system, turns, chosen, rejected):
    hist = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    if fmt == "transcript":
        hist = [{**m, "content": m["content"].strip()} for m in hist]
        chosen, rejected = chosen.lstrip(), rejected.lstrip()
    sys_msg = [{"role": "system", "content": system}] if system is not None else []
    return sys_msg + hist, chosen, rejected


def common(*seqs):
    n = 0
    while all(n < len(s) for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


def check_row(style, fmt, conv, **cfg):
    """Tokenize one generated row with dtrain and compare with the oracle; returns the pair (None: dropped)."""
    system, turns, chosen, rejected = conv
    data_cfg = DataConfig(fields=FIELDS if fmt == "fields" else None, **cfg)
    raw_text = fmt in FLAT and (STYLES[style][0] is None or data_cfg.prompt_template == "raw")
    oracle = Oracle(style, raw_text)
    obj = json.loads(json.dumps(row_object(fmt, system, turns, chosen, rejected)))
    rows, report = parse_rows([("gen:1", obj)], data_cfg, "gen")
    assume(report.bad == [] and report.dropped == [])  # e.g. chosen == rejected as written: a parse-level drop, tested elsewhere
    prompt_msgs, c, r = expected_messages(fmt, system, turns, chosen, rejected)
    if raw_text:  # one text: the prompt as written (transcripts keep their markers), the response appended
        text = obj["chosen"][: obj["chosen"].rindex("\n\nAssistant:") + 12] if fmt == "transcript" else turns[0]
        prompt_msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        if fmt == "transcript":
            c, r = " " + chosen, " " + rejected
    prompt_msgs = [{**m, "content": strip_marks(m["content"], oracle.marks)} for m in prompt_msgs]
    c, r = (strip_marks(x, oracle.marks) for x in (c, r))
    pairs, tok_report = tokenize_rows(rows, oracle.tok, data_cfg)
    assert tok_report.bad == []
    sides = [prompt_msgs + [{"role": "assistant", "content": x}] for x in (c, r)]
    (full_c, text_c), (full_r, text_r) = (oracle.side(m) for m in sides)
    gen = oracle.encode(oracle.render(prompt_msgs, generation=True))
    event(f"control text: {any(oracle.has_control(m) for m in sides)}, dropped: {not pairs}")
    if any(oracle.has_control(m) for m in sides):
        (pair,) = pairs or [None]
        if pair is None:
            return None
        for resp, text, msgs in ((pair.chosen, text_c, sides[0]), (pair.rejected, text_r, sides[1])):
            ids = pair.prompt + resp
            assert oracle.tok.decode(ids) == oracle.bos(msgs) + text + (oracle.tok.eos_token if oracle.eos else "")
            assert [i for i in ids if i in oracle.control_ids] == oracle.structure(msgs)
        assert tok_report.control_text != []
        return pair
    if full_c == full_r:
        assert pairs == [] and tok_report.dropped[0][1].startswith("same ids:")
        return None
    (pair,) = pairs
    n = common(gen, full_c, full_r)
    assert pair.prompt == full_c[:n] and pair.rejected_prompt is None
    assert pair.prompt + pair.chosen == full_c and pair.prompt + pair.rejected == full_r
    assert pair.chosen.count(pair.chosen[-1]) == 1 or pair.chosen[-1] not in oracle.control_ids  # one end of turn
    return pair


@pytest.mark.parametrize("style", ["chatml", "llama3", "gemma", "think", "base"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_plus_response_is_the_rendered_conversation(style, fmt):
    cfg = {"prompt_template": "raw"} if style == "base" else {}

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
    @given(conversations(fmt))
    def run(conv):
        check_row(style, fmt, conv, **cfg)

    run()


@pytest.mark.parametrize("style", ["chatml", "gemma"])
def test_raw_prompt_template_renders_plain_prompts_as_text(style):
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
    @given(conversations("standard"))
    def run(conv):
        check_row(style, "standard", conv, prompt_template="raw")

    run()


@pytest.mark.parametrize("style", ["chatml", "llama3", "gemma"])
def test_truncation_keeps_structure_and_limits(style):
    tok = style_tokenizer(style)
    controls = set(tok.convert_tokens_to_ids(list(control_strings(tok))))
    long_text = content([w for w in PIECES if w not in CONTROL]).map(lambda s: (s + " ") * 6)

    @settings(max_examples=25, deadline=None)
    @given(st.one_of(st.none(), st.sampled_from(["Be terse.", "You are a fox."])),
           st.integers(0, 2).flatmap(lambda n: st.lists(long_text, min_size=2 * n + 1, max_size=2 * n + 1)),
           st.sampled_from(WORDS), st.sampled_from(WORDS), st.integers(12, 80), st.integers(0, 40))
    def run(system, turns, chosen, rejected, max_prompt, room):
        assume(chosen != rejected)
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        obj = {"prompt": msgs, "chosen": [{"role": "assistant", "content": chosen}],
               "rejected": [{"role": "assistant", "content": rejected}]}
        rows, _ = parse_rows([("gen:1", obj)], DataConfig(), "gen")
        cfg = DataConfig(max_prompt_length=max_prompt, max_length=max_prompt + room)
        pairs, report = tokenize_rows(rows, tok, cfg)
        whole, _ = tokenize_rows(rows, tok, DataConfig(max_prompt_length=10_000, max_length=20_000))
        skeleton = tok.apply_chat_template([{**m, "content": "" if m["role"] != "system" else m["content"]}
                                            for m in msgs], add_generation_prompt=True, tokenize=False)
        n_skeleton = len(tok.encode(skeleton, add_special_tokens=not skeleton.startswith(tok.bos_token)))
        event(f"cut: {bool(whole) and len(whole[0].prompt) > max_prompt}, dropped: {not pairs}")
        if n_skeleton > max_prompt:
            assert pairs == [] and report.dropped[0][1].startswith(f"prompt too long: the system message and the "
                                                                   f"template's structure need {n_skeleton} tokens")
            return
        if not pairs:
            assert report.dropped[0][1].startswith(("no room:", "same ids:"))
            return
        (pair,), (full,) = pairs, whole
        assert len(pair.prompt) <= max_prompt and len(pair.prompt) + len(pair.chosen) <= max_prompt + room
        # only content was cut: the same control tokens, in the same order, as the whole prompt
        assert [i for i in pair.prompt if i in controls] == [i for i in full.prompt if i in controls]
        if system:
            assert system in tok.decode(pair.prompt)
        assert pair.chosen == full.chosen[: len(pair.chosen)] and pair.rejected == full.rejected[: len(pair.rejected)]
        if len(full.prompt) <= max_prompt:
            assert pair.prompt == full.prompt

    run()
