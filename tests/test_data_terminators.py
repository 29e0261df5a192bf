"""Exactly one terminator per response, whatever the tokenizer adds (issue 22 §1).

Tokenizers of every chat_fixtures style are rebuilt with each post-processor
(nothing, BOS, EOS, BOS + EOS) as an HF ``tokenizer.json`` template and as
GGUF ``add_bos_token``/``add_eos_token`` flags, and rows of several formats go
through every template choice. The oracle uses only the tokenizer's template
and ``encode(text, add_special_tokens=False)``: each side is the BOS the
tokenizer adds (unless the template wrote one), the rendered conversation up to
the end of the assistant turn, and the EOS dtrain appends when the template
writes no control token there; never the EOS of the tokenizer's own
post-processing. Exact ids of the issue's examples use the demo GGUF.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache

import pytest
from chat_fixtures import CLOSING, END_OF_TURN, NO_SYSTEM, STYLES, demo_tokenizer, style_tokenizer, turn_end
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from dtrain.config import DataConfig
from dtrain.data.formats import parse_rows
from dtrain.data.render import RowTokenizer, tokenize_rows
from dtrain.data.templates import CHATML, PLAIN, RAW_TEXT, control_strings, end_of_turn, hf_tokenizer
from dtrain.types import Row

POST = {"none": (False, False), "bos": (True, False), "eos": (False, True), "bos+eos": (True, True)}
WORDS = ["hi", "yes", "no", "word", "The", "fox", "café", "東京", "🙂", "ok", "42", " ", "\n"]


@lru_cache(maxsize=None)
def variant(style: str, source: str, post: str):
    """The ``style`` tokenizer with the post-processor ``post``, as a tokenizer.json (``hf``) or a GGUF (``gguf``)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from dtrain.models.tokenizer import build_tokenizer, eos_token_ids

    base = hf_tokenizer(style_tokenizer(style))
    add_bos, add_eos = POST[post]
    bos, eos = base.bos_token, base.eos_token
    if source == "gguf":
        spec = json.loads(base.backend_tokenizer.to_str())
        vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
        md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": [3 if t in specials else 4 if t not in spec["model"]["vocab"] else 1
                                            for t in tokens],
              "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]],
              "tokenizer.ggml.eos_token_id": vocab[eos], "tokenizer.ggml.add_bos_token": add_bos,
              "tokenizer.ggml.add_eos_token": add_eos}
        if bos is not None:
            md["tokenizer.ggml.bos_token_id"] = vocab[bos]
        if base.chat_template:
            md["tokenizer.chat_template"] = base.chat_template
        return TokenizerWrapper(build_tokenizer(md), eos_token_ids=eos_token_ids(md))
    tok = Tokenizer.from_str(base.backend_tokenizer.to_str())
    names = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
    if len(names) > 1:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(names), special_tokens=[(t, tok.token_to_id(t)) for t in names if t != "$A"])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                 additional_special_tokens=[t for t in STYLES[style][1] if t not in (bos, eos)])
    hf.chat_template = base.chat_template
    return TokenizerWrapper(hf)


CASES = [(style, source, post) for style in STYLES for source in ("hf", "gguf") for post in POST
         if not (STYLES[style][2] is None and POST[post][0])]  # "think" has no BOS token
FAMILIES = [style for style in STYLES if style in END_OF_TURN]  # the styles with a chat template


def expected_side(tok, template, closing, msgs, add_bos, kept=None):
    """The oracle: BOS the tokenizer adds + the rendered turn + dtrain's EOS when no control token closes it.

    ``kept``: what is trained of ``closing``, the turn's end (default: ``closing`` less trailing whitespace).
    """
    hf = hf_tokenizer(tok)
    kw = {"chat_template": template} if template else {}
    text = hf.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False, **kw)
    assert text.endswith(closing)
    kept = closing.rstrip() if kept is None else kept
    text = text[: len(text) - len(closing)] + kept
    bos = [hf.bos_token_id] if add_bos and not text.startswith(hf.bos_token or "\0") else []
    controls = control_strings(tok)
    eos = [] if any(kept.endswith(c) for c in controls if kept) else [hf.eos_token_id]
    return bos + hf.encode(text, add_special_tokens=False) + eos


def rendering(style, template_choice, messages_row):
    """``(DataConfig kwargs, template source or None for the model's own, closing)`` of one choice."""
    own = STYLES[style][0]
    if template_choice == "own":
        return {}, None, CLOSING.get(style, "")
    if template_choice in ("chatml", "plain"):
        return {"chat_template": template_choice}, {"chatml": CHATML, "plain": PLAIN}[template_choice], \
            {"chatml": "<|im_end|>\n", "plain": "\n\n"}[template_choice]
    # prompt_template raw: text rows are raw text; message rows use the model's template, else plain
    if not messages_row:
        return {"prompt_template": "raw"}, RAW_TEXT, ""
    return {"prompt_template": "raw"}, (None if own else PLAIN), (CLOSING.get(style, "") if own else "\n\n")


@pytest.mark.parametrize("style, source, post", CASES, ids=["-".join(c) for c in CASES])
def test_one_terminator_per_response_for_every_post_processor_and_template(style, source, post):
    tok = variant(style, source, post)
    hf = hf_tokenizer(tok)
    add_bos = POST[post][0]
    terminators = {hf.eos_token_id, *(hf.convert_tokens_to_ids([c])[0] for c in control_strings(tok)
                                      if c in (CLOSING.get(style, "") + "<|im_end|>"))}
    own_turn_end = turn_end(style) if STYLES[style][0] else None
    choices = ["chatml", "plain", "raw"] + (["own"] if STYLES[style][0] else [])
    text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map("".join).filter(lambda s: s.strip())

    @settings(max_examples=6, deadline=None)
    @given(st.sampled_from(choices), st.sampled_from(["standard", "conversational", "implicit"]),
           st.one_of(st.none(), text), text, text, text)
    @example("raw", "standard", None, "hi", "hi", "no")  # no BOS: "hihi" may be one token, no prompt token left
    def run(choice, fmt, system, prompt, chosen, rejected):
        assume(chosen.strip() != rejected.strip())
        messages_row = fmt != "standard"
        if not messages_row and choice == "own" and STYLES[style][0] is None:
            return
        cfg_kw, template, closing = rendering(style, choice, messages_row)
        sys_msg = [{"role": "system", "content": system}] if system is not None else []
        if fmt == "implicit":  # the whole conversation on each side
            user = sys_msg + [{"role": "user", "content": prompt}]
            obj = {"chosen": user + [{"role": "assistant", "content": chosen}],
                   "rejected": user + [{"role": "assistant", "content": rejected}]}
        elif messages_row:
            obj = {"prompt": sys_msg + [{"role": "user", "content": prompt}],
                   "chosen": [{"role": "assistant", "content": chosen}],
                   "rejected": [{"role": "assistant", "content": rejected}]}
        else:
            obj = {"prompt": prompt, "chosen": chosen, "rejected": rejected, **({"system": system} if system else {})}
        cfg = DataConfig(**cfg_kw)
        rows, report = parse_rows([("gen:1", obj)], cfg, "gen")
        assume(report.bad == [])
        pairs, report = tokenize_rows(rows, tok, cfg)
        if report.bad:  # the template's refusal of a system message, named
            assert style in NO_SYSTEM and system is not None and template is None, report.bad
            assert NO_SYSTEM[style] in report.bad[0][1]
            return
        if not pairs:
            why = report.dropped[0][1] if report.dropped else ""
            # without a BOS, raw text's prompt can merge into the response's first token: nothing to split at
            assert why.startswith("same ids") or (not add_bos and why.startswith("empty prompt")), why
            return
        (pair,) = pairs
        msgs = sys_msg + [{"role": "user", "content": prompt}]
        for resp, content in ((pair.chosen, chosen), (pair.rejected, rejected)):
            side = msgs + [{"role": "assistant", "content": content}]
            kept = own_turn_end if template is None else None
            assert pair.prompt + resp == expected_side(tok, template, closing, side, add_bos, kept)
            assert resp[-1] in terminators and (len(resp) == 1 or resp[-2] not in terminators)
        assert pair.prompt[-1] not in terminators  # no stray EOS at the end of a prompt
        # a prompt of exactly max_prompt_length tokens is not cut: no room spent on a terminator
        kw = {"chat_template": template} if template else {}
        gen = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
        bos = [hf.bos_token_id] if add_bos and not gen.startswith(hf.bos_token or "\0") else []
        limit = len(bos + hf.encode(gen, add_special_tokens=False))
        tight, _ = tokenize_rows(rows, tok, DataConfig(**cfg_kw, max_prompt_length=limit))
        assert tight == pairs

    run()


def plain_control_oracle(tok, msgs, closing, add_bos, kept=None, generation=False):
    """Ids of ``msgs`` + the closing control token, control text in contents read as plain text.

    Each piece of control text in a content is rendered as a placeholder, so the
    control tokens in the rendering are the template's own (what it does to a
    content, trimming, applies as to the text); the text between them (contents
    included) gets the tokenizer's own ids with ``split_special_tokens``.
    ``kept``: what is trained of ``closing`` (default: ``closing`` less trailing
    whitespace); ``generation``: the prompt's rendering, with the generation prompt, instead.
    """
    hf = hf_tokenizer(tok)
    controls = control_strings(tok)
    typed = []

    def hold(found):
        typed.append(found.group(0))
        return f"\ue000{len(typed) - 1}\ue001"

    control = re.compile("|".join(map(re.escape, controls)))
    held = [{**m, "content": control.sub(hold, m["content"])} for m in msgs]
    skeleton = hf.apply_chat_template(held, tokenize=False, add_generation_prompt=generation)
    if not generation:
        assert skeleton.endswith(closing)
        skeleton = skeleton[: len(skeleton) - len(closing)] + (closing.rstrip() if kept is None else kept)
    ids = [hf.bos_token_id] if add_bos and not skeleton.startswith(hf.bos_token or "\0") else []
    for part in re.split("(" + control.pattern + ")", skeleton):
        if part in controls:
            ids += hf.convert_tokens_to_ids([part])
        elif part:
            text = re.sub("\ue000(\\d+)\ue001", lambda m: typed[int(m.group(1))], part)
            ids += hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


@pytest.mark.parametrize("style", FAMILIES)
@pytest.mark.parametrize("post", ["none", "bos+eos"])
def test_control_text_in_messages_gets_the_tokenizers_own_plain_ids(style, post):
    """Control text typed anywhere in a message, after a space or not: the ids are the tokenizer's own split."""
    if STYLES[style][2] is None and POST[post][0]:
        post = "eos"
    tok = variant(style, "hf", post)
    controls = [c for c in control_strings(tok)]
    piece = st.sampled_from(["hi", "yes", " ", "  ", "\n", "word", "42", *controls, *(" " + c for c in controls)])
    text = st.lists(piece, min_size=1, max_size=6).map(lambda xs: "x" + "".join(xs) + "y")

    @settings(max_examples=12, deadline=None)
    @given(text, text, text)
    def run(prompt, chosen, rejected):
        assume(chosen != rejected)
        msgs = [{"role": "user", "content": prompt}]
        pairs, report = tokenize_rows([Row(msgs, chosen, rejected)], tok, DataConfig())
        assert report.bad == []
        if not pairs:
            return
        (pair,) = pairs
        for resp, content in ((pair.chosen, chosen), (pair.rejected, rejected)):
            side = msgs + [{"role": "assistant", "content": content}]
            assert pair.prompt + resp == plain_control_oracle(tok, side, CLOSING[style], POST[post][0],
                                                              turn_end(style))

    run()


def strip_marks(text, marks):
    """The documented rule: end-of-turn / EOS text at the end of a message is dropped."""
    return re.sub("(?:(?:" + "|".join(map(re.escape, marks)) + ")\\s*)+$", "", text)


def family_row(fmt, system, turns, chosen, rejected, fork):
    """``(JSON row, prompt messages, [chosen messages, rejected messages], SFT)`` of one generated conversation."""
    hist = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    sys_msg = [{"role": "system", "content": system}] if system is not None else []
    asst = lambda c: [{"role": "assistant", "content": c}]  # noqa: E731
    if fmt == "standard":
        obj = {"prompt": turns[0], "chosen": chosen, "rejected": rejected, **({"system": system} if system else {})}
        return obj, sys_msg + hist[:1], [asst(chosen), asst(rejected)], False
    if fmt == "completion":
        return {"prompt": turns[0], "completion": chosen}, hist[:1], [asst(chosen)], True
    if fmt == "messages":
        return {"messages": sys_msg + hist + asst(chosen)}, sys_msg + hist, [asst(chosen)], True
    if fmt == "fork":  # the sides part at an earlier reply; the chosen one goes on for another exchange
        more = asst(chosen) + [{"role": "user", "content": fork}] + asst(rejected + chosen)
        obj = {"chosen": sys_msg + hist + more, "rejected": sys_msg + hist + asst(rejected)}
        return obj, sys_msg + hist, [more, asst(rejected)], False
    obj = {"prompt": sys_msg + hist, "chosen": asst(chosen), "rejected": asst(rejected)}
    return obj, sys_msg + hist, [asst(chosen), asst(rejected)], False


@pytest.mark.parametrize("style", FAMILIES)
def test_every_family_trains_one_end_of_turn_per_response_at_the_templates_boundary(style):
    """Each chat family's responses end with the token that ends its assistant turn, once: Phi-3's and a
    ChatML's EOS after the whole conversation is not the turn's; content that ends in that text (or EOS)
    loses it. Multi-turn prompts, system prompts, trailing whitespace, end-of-turn text inside a reply, SFT
    rows and sides that fork: prompt + response is the template's rendering up to the turn's end (content
    control text read as text) and the prompt ends where the generation prompt and the sides part."""
    tok = style_tokenizer(style)
    hf = hf_tokenizer(tok)
    end, eos = END_OF_TURN[style], hf.eos_token
    end_id, adds_bos = hf.convert_tokens_to_ids(end), STYLES[style][4]
    assert end_of_turn(tok) == (end, [end_id])  # the token export stops generation at
    marks = [end, eos]
    word = st.sampled_from(WORDS[:-2])
    tail = st.sampled_from(["", " ", "\n", "\n\n", " \n ", end, end + "\n", " " + end + " ", eos, end + eos])
    text = st.tuples(word, st.lists(st.sampled_from(WORDS + [end, " " + end + " ", eos]), max_size=3).map("".join),
                     tail).map("".join)
    turns = st.integers(0, 2).flatmap(lambda n: st.lists(text, min_size=2 * n + 1, max_size=2 * n + 1))

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.sampled_from(["standard", "conversational", "fork", "completion", "messages"]),
           st.one_of(st.none(), text), turns, text, text, text)
    def run(fmt, system, turns, chosen, rejected, fork):
        assume(strip_marks(chosen, marks).strip() != strip_marks(rejected, marks).strip())
        obj, prompt, sides, sft = family_row(fmt, system, turns, chosen, rejected, fork)
        rows, report = parse_rows([("gen:1", json.loads(json.dumps(obj)))], DataConfig(), "gen", pairwise=not sft)
        assert report.bad == []
        pairs, report = tokenize_rows(rows, tok, DataConfig())
        if style in NO_SYSTEM and prompt[0]["role"] == "system":  # refused, in the words NO_SYSTEM holds
            assert pairs == [] and NO_SYSTEM[style] in report.bad[0][1]
            return
        assert report.bad == [] and report.dropped == [] and report.template_dropped == []  # trims drop no text
        (pair,) = pairs
        prompt = [{**m, "content": strip_marks(m["content"], marks)} for m in prompt]
        full = [plain_control_oracle(tok, prompt + [{**m, "content": strip_marks(m["content"], marks)} for m in side],
                                     CLOSING[style], adds_bos, turn_end(style)) for side in sides]
        gen = plain_control_oracle(tok, prompt, "", adds_bos, generation=True)
        n = min(len(pair.prompt), len(full[0]))
        assert pair.prompt == full[0][:n] == gen[:n] and n == len(pair.prompt)
        assert pair.prompt + pair.chosen == full[0]
        responses = [pair.chosen] if sft else [pair.chosen, pair.rejected]
        assert pair.rejected == ([] if sft else full[1][n:])
        for resp, side in zip(responses, sides):
            assert resp[-1] == end_id and resp[-2] not in (end_id, hf.eos_token_id)  # one end of turn, last
            if len(side) == 1:  # one reply: that turn's end only
                assert resp.count(end_id) == 1 and hf.decode(resp).endswith(turn_end(style))

    run()


def test_a_template_that_requires_a_system_message_ends_each_response_once():
    """The closing is probed with a user + assistant exchange; a template that refuses it (a system message
    required) left the closing unknown, so its '<|im_end|>\\n' stayed in each response and EOS followed."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = copy.deepcopy(hf_tokenizer(variant("qwen25", "hf", "none")))  # the cached one stays as it is
    hf.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('A system message is "
                        "required') }}{% endif %}" + CHATML)
    tok = TokenizerWrapper(hf)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    pairs, report = tokenize_rows([Row(msgs, "yes", "no")], tok, DataConfig())
    (pair,) = pairs
    end = hf.convert_tokens_to_ids("<|im_end|>")
    assert (tok.decode(pair.chosen), tok.decode(pair.rejected)) == ("yes<|im_end|>", "no<|im_end|>")  # before:
    assert pair.chosen.count(end) == pair.rejected.count(end) == 1  # 'yes<|im_end|>\n<|im_end|>'
    assert pair.prompt + pair.chosen == hf.encode(hf.apply_chat_template(msgs + [{"role": "assistant", "content": "yes"}],
                                                                          tokenize=False)[:-1])



def test_a_template_that_refuses_every_probe_ends_each_response_once():
    """A template that refuses both probe conversations (it wants a system message of its own kind) left the
    closing unknown: responses kept its '<|im_end|>\n' and EOS followed ('yes<|im_end|>\n<|im_end|>'). Each
    row's own conversation is then the probe; rows it refuses are bad rows in its words."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = copy.deepcopy(hf_tokenizer(variant("qwen25", "hf", "none")))  # the cached one stays as it is
    hf.chat_template = ("{% if not messages[0]['content'].startswith('You are') %}{{ raise_exception('Open with "
                        "a persona') }}{% endif %}" + CHATML)
    tok = TokenizerWrapper(hf)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    rows = [Row(msgs, "yes", "no", source="f:1"), Row(msgs[1:], "yes", "no", source="f:2")]
    pairs, report = tokenize_rows(rows, tok, DataConfig())
    (pair,) = pairs
    assert (tok.decode(pair.chosen), tok.decode(pair.rejected)) == ("yes<|im_end|>", "no<|im_end|>")
    assert pair.prompt + pair.chosen == hf.encode(hf.apply_chat_template(msgs + [{"role": "assistant", "content": "yes"}],
                                                                          tokenize=False)[:-1])
    assert report.bad == [("f:2", "the chat template (the model's chat template) cannot render this row: Open with a "
                                  "persona")]

def test_own_additions_read_from_the_post_processor():
    for source in ("hf", "gguf"):
        tok = variant("chatml", source, "bos+eos")
        assert RowTokenizer.own_additions(tok) == ((1,), (2,))
        assert RowTokenizer.own_additions(variant("chatml", source, "eos")) == ((), (2,))
        assert RowTokenizer.own_additions(variant("chatml", source, "none")) == ((), ())


# -- the examples, demo GGUF (<|im_end|> = 2) -------------------------------------------


@pytest.fixture(scope="module")
def demo_md(demo_path):
    from dtrain.models.gguf import read_gguf

    return read_gguf(demo_path)[0]


def test_demo_gguf_with_add_eos_token_ends_each_response_once(demo_md):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from dtrain.models.tokenizer import build_tokenizer, eos_token_ids

    md = {**demo_md, "tokenizer.ggml.add_eos_token": True}
    tok = TokenizerWrapper(build_tokenizer(md), eos_token_ids=eos_token_ids(md))
    assert tok.encode("Yes") == [10539, 2]  # the tokenizer's own post-processing appends <|im_end|>
    pairs, _ = tokenize_rows([Row("Hi", "Yes<|im_end|>", "No")], tok, DataConfig(prompt_template="raw"))
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected) == ([26843], [10539, 2], [5230, 2])  # before: 2, 2


def test_a_reply_opening_with_newlines_after_a_template_that_ends_conversations_with_eos(demo_path):
    """A reply's leading newline merges with the generation prompt's ('\\n' + '\\n\\n' is one token), so the split
    checks that the prompt renders alike with a reply after it; a template that writes EOS after a whole
    conversation (Phi-3's way, here on ChatML) ends the prompt's own rendering with it, and the row was refused:
    'renders the prompt messages differently once a response follows them'."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = hf_tokenizer(demo_tokenizer(demo_path))
    chatml = TokenizerWrapper(hf)
    (chatml_pair,), _ = tokenize_rows([Row("hi", "\n\nyes", "no")], chatml, DataConfig(chat_template="chatml"))
    assert chatml.decode(chatml_pair.chosen) == "\n\n\nyes<|im_end|>"  # the prompt's last '\n' joined the reply
    template = CHATML.replace("{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
                              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% else %}"
                              "{{ '<|endoftext|>' }}{% endif %}")
    assert template != CHATML
    hf = hf_tokenizer(demo_tokenizer(demo_path))
    hf.chat_template = template
    pairs, report = tokenize_rows([Row("hi", "\n\nyes", "no")], TokenizerWrapper(hf), DataConfig())
    assert report.bad == [] and pairs[0].chosen[-1] == 2  # before: the row was bad
    assert (pairs[0].prompt, pairs[0].chosen) == (chatml_pair.prompt, chatml_pair.chosen)


@pytest.fixture
def folder_tok(demo_md, tmp_path):
    """The tokenizer files of `dtrain convert demo OUT` (written by save_pretrained, as convert does) with a
    tokenizer.json post-processor that appends <|im_end|>, loaded as mlx-lm loads a folder."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dtrain.models.tokenizer import build_tokenizer

    out = tmp_path / "demo-mlx"
    build_tokenizer(demo_md).save_pretrained(str(out))
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                                                         {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return load_tokenizer(out)


def test_demo_folder_whose_tokenizer_json_appends_eos(folder_tok):
    """data.chat_template plain on the folder whose post-processor appends <|im_end|>."""
    tok = folder_tok
    assert tok.encode("Yes") == [10539, 2]  # the folder's own post-processing appends <|im_end|>
    row = Row("What is two?", "Yes", "No")
    prompt = [11126, 42, 1812, 314, 827, 47, 198, 198, 9519, 9531, 42]  # "User: What is two?\n\nAssistant:"
    for limit in (512, 11):
        pairs, _ = tokenize_rows([row], tok, DataConfig(chat_template="plain", max_prompt_length=limit))
        # before: chosen [9230, 2, 2], rejected [2838, 2, 2]; at max_prompt_length 11 the prompt was cut to 10
        assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected) == (prompt, [9230, 2], [2838, 2])


def test_control_text_typed_after_a_space_gets_the_tokenizers_own_ids(demo_path):
    tok = demo_tokenizer(demo_path)
    text = "Please write the literal string <|im_end|> back to me."
    own = hf_tokenizer(tok)(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert own[4:6] == [4928, 2067]
    pairs, report = tokenize_rows([Row(text, "ok", "no", source="f:1")], tok, DataConfig())
    prompt = pairs[0].prompt
    at = prompt.index(own[0])
    assert prompt[at: at + len(own)] == own  # before: [..., 4928, 216, 44, ...]
    assert prompt[at + len(own):] == [2, 198, 1, 520, 9531, 198] and report.control_text == [("f:1", "<|im_end|>")]


def test_data_check_show_prints_one_terminator_in_each_case(demo_md, demo_path, folder_tok, tmp_path):
    """`dtrain data check --show` on the three examples: each response shown ends with one <|im_end|>."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from dtrain.data.check import check_file
    from dtrain.models.tokenizer import build_tokenizer, eos_token_ids

    md = {**demo_md, "tokenizer.ggml.add_eos_token": True}
    add_eos = TokenizerWrapper(build_tokenizer(md), eos_token_ids=eos_token_ids(md))
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "chosen": "Yes<|im_end|>", "rejected": "No"}) + "\n")
    out, _, _ = check_file(str(path), DataConfig(prompt_template="raw"), add_eos, show=1)
    assert out.splitlines()[-6:] == [
        '  prompt       1 tokens  "Hi"', "            ids [26843]",
        '  chosen       2 tokens  "Yes<|im_end|>"', "            ids [10539, 2]",
        '  rejected     2 tokens  "No<|im_end|>"', "            ids [5230, 2]"]
    typed = "Please write the literal string <|im_end|> back to me."
    path.write_text(json.dumps({"prompt": typed, "chosen": "ok", "rejected": "no"}) + "\n")
    shown = check_file(str(path), DataConfig(), demo_tokenizer(demo_path), show=1)[0].splitlines()
    assert shown[-6].endswith(f'{typed}<|im_end|>\\n<|im_start|>assistant\\n"')  # typed text once, one end of turn
    assert shown[-5].count(", 2,") == 2 and "4928, 2067, 108" in shown[-5]  # system turn + user turn
    assert shown[-3].endswith("ids [2231, 2]") and shown[-1].endswith("ids [4607, 2]")
    path.write_text(json.dumps({"prompt": "What is two?", "chosen": "Yes", "rejected": "No"}) + "\n")
    shown = check_file(str(path), DataConfig(chat_template="plain", max_prompt_length=11), folder_tok, show=1)[0]
    assert shown.splitlines()[-6:] == [
        '  prompt      11 tokens  "User: What is two?\\n\\nAssistant:"',
        "            ids [11126, 42, 1812, 314, 827, 47, 198, 198, 9519, 9531, 42]",
        '  chosen       2 tokens  " Yes<|im_end|>"', "            ids [9230, 2]",
        '  rejected     2 tokens  " No<|im_end|>"', "            ids [2838, 2]"]
