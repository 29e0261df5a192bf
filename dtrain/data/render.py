"""Rows -> token ids: what is trained is what the chat template renders.

For each side the whole conversation (prompt messages + the response) is
rendered once with the template and tokenized once. The prompt is the longest
token prefix shared by both sides' renderings and the prompt's own rendering
with the generation prompt (for no prompt messages, a lone assistant message:
what the template writes before the reply's content, a default system message
too), so ``prompt + chosen`` is exactly the tokenizer's
ids for the rendered chosen conversation, up to the end of its assistant turn
(the closing control token kept, the whitespace the template writes after it
not, nor an EOS it writes after the whole conversation: Phi-3's
``<|end|>\n<|endoftext|>`` ends a response with ``<|end|>``), and likewise
``prompt + rejected``. A generation prompt that opens a
reasoning block (``<|im_start|>assistant\\n<think>\\n``) thus never doubles
``<think>``, and a token that straddles the prompt/response text boundary
(a raw prompt ending in a space) belongs to the response, as the tokenizer
reads the whole text. When the template writes no control token after a
response (raw text, ``plain``), the EOS id is appended.

Of what the tokenizer's own post-processing adds (an HF ``tokenizer.json``
post-processor, GGUF ``add_bos_token``/``add_eos_token``) only the prefix is
kept, and only when the template writes no BOS itself; the suffix (an EOS
appended to every text) never is. So every response ends with exactly one
terminator, and a prompt neither carries an EOS nor counts one against
``max_prompt_length``.

Message content is data. Control-token text inside a message (``<|im_end|>``
typed by a user) is tokenized as plain text, never as the control token, so
it cannot end a turn or open one; its ids are the tokenizer's own for that
text (``split_special_tokens``), so ``" <|im_end|>"`` is split as the
tokenizer splits it, space included. Such rows are counted in the report. A
message that *ends* with the template's end-of-turn text or the EOS text (data
written pre-formatted, ``"Yes<|im_end|>"``) loses it: the template writes the
one end-of-turn itself.

Truncation keeps the template's structure: a prompt over
``max_prompt_length`` loses message content from the left, earliest
non-system message first, and is rendered again; the system message and every
role header stay. A prompt whose structure and system message alone exceed the
limit is dropped. Responses are then cut from the right to ``max_length`` minus
the prompt.

Pairs with no preference signal are dropped at load time with their
``file:line`` and a reason (``report.dropped``): same token ids on both sides,
an empty prompt or response, no room for a response, a prompt too long to cut.
A row with one completion (every row under ``objective.kind: sft``, see
``formats.parse_rows``) has no rejected side to compare.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

from ..errors import BadRow, DataError
from ..types import BadRowReport, Row, TokenizedPair
from .formats import ASSISTANT_MARKER, HUMAN_MARKER
from .templates import RAW_TEXT, Renderer, control_strings, end_of_turn, hf_tokenizer, renderers


class Drop(Exception):
    """A pair with no preference signal or no room; its message starts with the kind (``"same ids: ..."``)."""


def transcript_messages(text: str) -> list:
    """``\\n\\nHuman: a\\n\\nAssistant: b\\n\\nAssistant:`` -> user/assistant messages.

    The trailing empty Assistant turn (the generation prompt) is dropped; text
    before the first marker joins the first turn, or is one before a first
    Assistant turn. A transcript that opens with ``Human:`` (its leading blank
    line stripped) opens with that turn.
    """
    if text.lstrip().startswith(HUMAN_MARKER.strip()):
        text = HUMAN_MARKER + text.lstrip()[len(HUMAN_MARKER.strip()):]
    parts, pos, msgs = [], 0, []
    markers = {HUMAN_MARKER: "user", ASSISTANT_MARKER: "assistant"}
    while True:
        hits = [(text.find(m, pos), m) for m in markers if text.find(m, pos) >= 0]
        if not hits:
            break
        at, marker = min(hits)
        parts.append((at, marker))
        pos = at + len(marker)
    lead = text[: parts[0][0]].strip() if parts else text.strip()
    for i, (at, marker) in enumerate(parts):
        end = parts[i + 1][0] if i + 1 < len(parts) else len(text)
        msgs.append({"role": markers[marker], "content": text[at + len(marker): end].strip()})
    if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1]["content"]:
        msgs.pop()
    if lead and msgs and msgs[0]["role"] == "user":
        msgs[0] = {**msgs[0], "content": (lead + "\n" + msgs[0]["content"]).strip()}
    elif lead or not msgs:  # text before a first Assistant turn is what the user said
        msgs.insert(0, {"role": "user", "content": lead})
    return msgs


def _with_system(msgs: list, system: Optional[str]) -> list:
    """``msgs`` opened by the row's ``system`` text, unless a system message of theirs says it already (where it
    stands): a conversation gets one system prompt, written once.

    Raises:
        BadRow: the messages hold a system message, and none says the same (which one is meant is unknown).
    """
    if system is None:
        return list(msgs)
    held = [(i, m["content"]) for i, m in enumerate(msgs) if m["role"] == "system"]
    if any(content.strip() == system.strip() for _, content in held):
        return list(msgs)
    if held:
        i, content = held[0]
        where = f"the prompt's system message (its message {i + 1})" if i else "the prompt's system message"
        raise BadRow(f"the 'system' field ({_short(system)}) and {where} ({_short(content)}) differ; a prompt has "
                     "one system prompt: keep one of them")
    return [{"role": "system", "content": system}] + list(msgs)


def _short(text: str, chars: int = 40) -> str:
    return repr(text if len(text) <= chars else text[:chars] + "...")


def row_messages(row: Row, chat: Optional[Renderer], text: Renderer) -> tuple:
    """``(renderer, [chosen prompt, rejected prompt or None], [chosen response, rejected response])`` as messages.

    Plain-text prompts become a user turn (transcripts: their turns; raw text:
    one message, the transcript markers kept). A text response is one
    assistant message; a transcript's whitespace around it goes when it becomes a turn,
    and a transcript response holding later ``Human:`` turns becomes those turns.

    Raises:
        DataError: a message row and no template to render it.
    """
    if isinstance(row.prompt, list):
        if chat is None:
            raise DataError(f"{row.source}: message rows need a chat template, and the tokenizer has none: set "
                            "data.chat_template (chatml, plain or a Jinja file), or data.prompt_template: raw "
                            "to write messages as plain 'User: ...' text")
        rprompt = _with_system(row.rejected_prompt, row.system) if row.rejected_prompt is not None else None
        return chat, [_with_system(row.prompt, row.system), rprompt], [_response(r, False) for r in (row.chosen, row.rejected)]
    raw = text.template is RAW_TEXT
    msgs = transcript_messages(row.prompt) if row.transcript and not raw else [{"role": "user", "content": row.prompt}]
    strip = row.transcript and not raw
    return text, [_with_system(msgs, row.system), None], [_response(r, strip) for r in (row.chosen, row.rejected)]


def _response(response, transcript: bool) -> list:
    if isinstance(response, list):
        return list(response)
    if transcript and HUMAN_MARKER in response:  # sides that part at an earlier turn: the later turns, as TRL reads HH
        return transcript_messages(ASSISTANT_MARKER + response)
    # a transcript's turn is its text between markers, stripped, as transcript_messages cuts the others
    return [{"role": "assistant", "content": response.strip() if transcript else response}]


def _prefix_first_only(node) -> bool:
    """Turns each Metaspace ``prepend_scheme: first`` in a pre-tokenizer's JSON into ``never``; True if one was."""
    if isinstance(node, list):
        return any([_prefix_first_only(n) for n in node])
    if not isinstance(node, dict):
        return False
    found = node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first"
    if found:
        node["prepend_scheme"] = "never"
    return any([found] + [_prefix_first_only(v) for v in node.values()])


def prefixes_first_fragment(tokenizer) -> bool:
    """True where the tokenizer writes ``▁`` before a text's first fragment only (Metaspace ``prepend_scheme:
    first``, Mistral v0.3's tokenizer.json), so text after a control token gets none."""
    pre = getattr(getattr(hf_tokenizer(tokenizer), "backend_tokenizer", None), "pre_tokenizer", None)
    return pre is not None and _prefix_first_only(json.loads(pre.__getstate__()))


def _first(last: int, fits) -> int:
    """The least ``k`` in ``0..last`` where ``fits(k)``, by bisection (``fits`` grows with ``k`` and holds at ``last``)."""
    lo, hi = 0, last
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return hi


def _common_prefix(*seqs) -> int:
    """The length of the longest prefix all ``seqs`` (id lists or texts) share."""
    lo, hi = 0, min(map(len, seqs))
    while lo < hi:  # binary search: slices compare in C, a character or id at a time in Python is slow on long texts
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if all(s[:mid] == seqs[0][:mid] for s in seqs[1:]) else (lo, mid - 1)
    return lo


def _first_rewritten(contents: list, rendered: str) -> Optional[int]:
    """The index of the first of ``contents`` (a response's messages, in order) that ``rendered`` (the template's
    text for them) does not hold, or None; whitespace is not compared (a ``| trim`` drops no text)."""
    bare, pos = "".join(rendered.split()), 0
    for i, content in enumerate(contents):
        want = "".join(content.split())
        at = bare.find(want, pos)
        if at < 0:
            return i
        pos = at + len(want)
    return None


@dataclass
class RowResult:
    """One row's outcome: the pair, or why it was dropped, and what ``data check`` reports.

    ``lengths``: untruncated ``(prompt, chosen, rejected)`` token counts (zeros
    when the row never reached tokenization). ``prompt_cut_fits``: the prompt was
    cut although prompt + the longer response fit ``max_length``.
    ``control_text``: the first control-token text found in a message, if any.
    ``template_dropped``: the first text of a response the chat template does not render, if any.
    """

    source: str
    pair: Optional[TokenizedPair] = None
    drop: Optional[str] = None
    lengths: tuple = (0, 0, 0)
    truncated: bool = False
    prompt_cut_fits: bool = False
    control_text: Optional[str] = None
    template_dropped: Optional[str] = None


@dataclass(frozen=True)
class RowTokenizer:
    """Renders, tokenizes and truncates rows for one tokenizer and DataConfig; see the module docstring."""

    tokenizer: Any
    cfg: Any
    chat: Optional[Renderer]
    text: Renderer
    controls: tuple  # control-token strings, longest first
    control_re: Optional[re.Pattern]  # matches any of them
    control_ids: frozenset
    marks: tuple  # end-of-turn texts removed from the end of message content
    prefix: tuple  # ids the tokenizer's own post-processing puts before a text (BOS); its suffix (EOS) is never used

    @staticmethod
    def own_additions(tokenizer) -> tuple:
        """``(prefix, suffix)``: the ids ``encode(text)`` adds before and after ``encode(text, add_special_tokens=False)``.

        The tokenizer's post-processor (an HF ``tokenizer.json`` template, GGUF
        ``add_bos_token``/``add_eos_token``) decides them; dtrain keeps the
        prefix where the template writes no BOS itself and drops the suffix,
        since the template or dtrain ends each response with one terminator.
        """
        hf = hf_tokenizer(tokenizer)
        bare = hf("a", add_special_tokens=False)["input_ids"]
        full = hf("a", add_special_tokens=True)["input_ids"]
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i: i + len(bare)] == bare), None)
        if not bare or at is None:
            return (), ()
        return tuple(full[:at]), tuple(full[at + len(bare):])

    @classmethod
    def build(cls, tokenizer, cfg) -> "RowTokenizer":
        """Raises DataError for a bad ``data.chat_template``."""
        chat, text = renderers(tokenizer, cfg)
        controls = control_strings(tokenizer)
        ids = frozenset(tokenizer.convert_tokens_to_ids(list(controls))) if controls else frozenset()
        marks = {r.turn_end.strip() for r in (chat, text) if r is not None} | {tokenizer.eos_token or ""}
        pattern = re.compile("|".join(map(re.escape, controls))) if controls else None
        return cls(tokenizer, cfg, chat, text, controls, pattern, ids,
                   tuple(sorted((m for m in marks if m), key=len, reverse=True)), cls.own_additions(tokenizer)[0])

    @cached_property
    def after_control(self):
        """A copy of the tokenizer's backend that encodes text as the tokenizer does after a control token, or
        None where that is how it encodes any text: Metaspace with ``prepend_scheme: first`` (Mistral v0.3's
        tokenizer.json) prefixes ``▁`` to a text's first fragment only. Control text in a message is text."""
        from tokenizers import Tokenizer

        if not prefixes_first_fragment(self.tokenizer):
            return None
        state = json.loads(hf_tokenizer(self.tokenizer).backend_tokenizer.to_str())
        _prefix_first_only(state["pre_tokenizer"])
        copy = Tokenizer.from_str(json.dumps(state))
        copy.encode_special_tokens = True
        return copy

    # -- text --------------------------------------------------------------
    def _strip_marks(self, content: str) -> str:
        """``"Yes<|im_end|>\\n"`` -> ``"Yes"``: end-of-turn text the data wrote itself."""
        while True:
            tail = content.rstrip()
            mark = next((m for m in self.marks if tail.endswith(m)), None)
            if mark is None:
                return content
            content = tail[: -len(mark)]

    def _escape(self, msgs: list) -> tuple:
        """Messages with control-token text replaced by ``<marker><index><marker>``.

        Returns ``(messages, marker or None, first control text found or None)``;
        the marker is a private-use character absent from the row.
        """
        pattern = self.control_re
        hit = next((m for m in (pattern.search(x["content"]) for x in msgs) if m), None) if pattern else None
        found = hit.group(0) if hit else None
        if found is None:
            return msgs, None, None
        used = "".join(m["content"] for m in msgs)
        marker = next(chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in used)
        index = {c: i for i, c in enumerate(self.controls)}
        sub = lambda m: f"{marker}{index[m.group(0)]}{marker}"  # noqa: E731
        return [{**m, "content": pattern.sub(sub, m["content"])} for m in msgs], marker, found

    def _unescape(self, text: str, marker: Optional[str]) -> tuple:
        """``(plain text, {(start, end): control text})``: escaped control text put back, with its spans."""
        if marker is None:
            return text, {}
        plain, spans, pos = [], {}, 0
        for m in re.finditer(f"{marker}(\\d+){marker}", text):
            plain.append(text[pos: m.start()])
            start = sum(map(len, plain))
            control = self.controls[int(m.group(1))]
            spans[(start, start + len(control))] = control
            plain.append(control)
            pos = m.end()
        plain.append(text[pos:])
        return "".join(plain), spans

    def _encode(self, text: str, spans: dict, add: bool) -> list:
        """Token ids of rendered text, without the tokenizer's own suffix (a post-processor's EOS).

        ``add``: put the tokenizer's own prefix (BOS) first, false when the
        template wrote BOS itself. Control text at ``spans`` (typed in messages)
        is plain text: the pieces between the control tokens the template wrote
        get the tokenizer's own ids with ``split_special_tokens`` (as it encodes
        them after a control token, :attr:`after_control`), so
        ``"string <|im_end|>"`` gives the ids the tokenizer gives that text.
        """
        prefix = list(self.prefix) if add else []
        if not spans:
            return prefix + list(self.tokenizer.encode(text, add_special_tokens=False))
        hf = hf_tokenizer(self.tokenizer)
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)

        def plain(start: int, end: int) -> list:  # a piece after a control token is not the text's start
            if start == 0 or self.after_control is None:
                return hf(text[start:end], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            return self.after_control.encode(text[start:end], add_special_tokens=False).ids

        def written(start: int, end: int) -> bool:  # an lstrip/rstrip token's offsets take in the spaces beside it
            return not any(start <= s and e <= end for s, e in spans)

        out, pos = prefix, 0
        for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
            if tid in self.control_ids and written(start, end):  # written by the template
                out += (plain(pos, start) if start > pos else []) + [tid]
                pos = end
        return out + (plain(pos, len(text)) if pos < len(text) else [])

    def _text(self, r: Renderer, msgs: list, generation: bool) -> str:
        """The template's text for ``msgs`` as :meth:`_render` renders it, without tokenizing it."""
        escaped, marker, _ = self._escape([{**m, "content": self._strip_marks(m["content"])} for m in msgs])
        return self._unescape(r.render(escaped, add_generation_prompt=generation), marker)[0]

    def _render(self, r: Renderer, msgs: list, generation: bool, response: bool = False) -> tuple:
        """``(ids, text, control text found)`` for ``msgs``; ``response``: end after the final assistant turn.

        Raises:
            BadRow: the template fails, or does not end the conversation with its closing text.
            DataError: an EOS id is needed and the tokenizer has none.
        """
        msgs = [{**m, "content": self._strip_marks(m["content"])} for m in msgs]
        escaped, marker, found = self._escape(msgs)
        text = r.render(escaped, add_generation_prompt=generation)
        extra = []
        if response:
            closing, turn_end = (r.closing, r.turn_end) if r.probed else r.ending(escaped)
            if closing and not text.endswith(closing):
                raise BadRow(f"the chat template ({r.name}) does not end this conversation with {closing!r}")
            keep = turn_end.rstrip() if self.cfg.append_eos else ""
            text = text[: len(text) - len(closing)] + keep
            if self.cfg.append_eos and not any(keep.endswith(c) for c in self.controls):
                if self.tokenizer.eos_token_id is None:
                    raise DataError(f"the template ({r.name}) writes no end-of-turn token and the tokenizer has no "
                                    "EOS token; set data.append_eos: false")
                extra = [self.tokenizer.eos_token_id]
        # BOS is the template's when its own text starts with it (content's "<s>" is escaped here)
        bos = getattr(self.tokenizer, "bos_token", None)
        add = not (bos and text.startswith(bos))
        text, spans = self._unescape(text, marker)
        return self._encode(text, spans, add) + extra, text, found

    def _reply_opening(self, r: Renderer) -> list:
        """The prompt of no messages (a lone assistant message): the ids the template writes before the
        reply's content, i.e. the shared prefix of two one-reply conversations (transformers renders no
        empty conversation, so there is no generation prompt of nothing to render)."""
        a, b = (self._render(r, [{"role": "assistant", "content": c}], False)[0] for c in ("A", "B"))
        return a[:_common_prefix(a, b)]

    def _prompt_text(self, r: Renderer, msgs: list) -> str:
        """The text a conversation that goes on after ``msgs`` starts with: what their renderings with and
        without the generation prompt share (not an EOS written only after a whole conversation, as Phi-3's)."""
        own, gen = (self._text(r, msgs, generation) for generation in (False, True))
        return own[: _common_prefix(own, gen)]

    def _unsplit(self, r: Renderer, msgs: list, response: list) -> str:
        """Why prompt ``msgs`` cannot be split off ``response``: the system message where the row splits without it
        (Mistral v0.3's template writes it into the last user turn only while no reply follows), else the rendering."""
        plain = [m for m in msgs if m["role"] != "system"]
        try:
            if plain and plain != msgs and self._text(r, plain + response, False).startswith(self._prompt_text(r, plain)):
                return (f"the chat template ({r.name}) writes the system message only when no response follows the "
                        "prompt, so prompt and response cannot be split: put its text in the user message")
        except BadRow:  # the template refuses the row without it: the rendering is the reason
            pass
        return (f"the chat template ({r.name}) renders the prompt messages differently once a response follows them, "
                "so prompt and response cannot be split")

    # -- truncation --------------------------------------------------------
    def _split(self, r: Renderer, msgs: list, responses: list) -> tuple:
        """``(generation prompt ids, [(ids, text, control text)] of msgs + each response, prompt length)``: the
        prompt as trained is the ids the generation prompt and every whole rendering share."""
        gen = self._render(r, msgs, True)[0] if msgs else self._reply_opening(r)
        fulls = [self._render(r, msgs + resp, False, response=True) for resp in responses]
        return gen, fulls, _common_prefix(gen, *(ids for ids, _, _ in fulls))

    def _fit_prompt(self, r: Renderer, msgs: list, responses: list) -> tuple:
        """``(messages, *split, untruncated length)`` (:meth:`_split`): content cut from the left until the
        prompt as trained fits (a generation prompt's ``<think>`` that no response shares is not counted).

        Raises:
            Drop: the system message and the template's structure alone do not fit.
        """
        limit = self.cfg.max_prompt_length
        split = self._split(r, msgs, responses)
        full = split[2]
        if full <= limit:
            return (msgs, *split, full)
        original = msgs
        msgs = [dict(m) for m in msgs]
        cuttable = [i for i, m in enumerate(msgs) if m["role"] != "system" and m["content"]]

        def empty(k):  # the first k cuttable messages emptied, the rest as given
            for n, i in enumerate(cuttable):
                msgs[i]["content"] = "" if n < k else original[i]["content"]

        def emptied(k):
            empty(k)
            return self._split(r, msgs, responses)

        # the fewest messages emptied from the left for the prompt to fit, by bisection (rendering all of them
        # once per message made a long conversation quadratic); then the fewest leading tokens of the next one
        split = emptied(len(cuttable))
        if split[2] > limit:
            raise Drop(f"prompt too long: the system message and the template's structure need {split[2]} tokens; "
                       f"data.max_prompt_length={limit}")
        n = _first(len(cuttable) - 1, lambda k: emptied(k + 1)[2] <= limit)
        empty(n)  # messages before cuttable[n] emptied; it is the one cut
        i = cuttable[n]
        content = original[i]["content"]
        offsets = hf_tokenizer(self.tokenizer)(content, add_special_tokens=False, return_offsets_mapping=True,
                                               split_special_tokens=True)["offset_mapping"]
        starts = sorted({s for s, _ in offsets} | {len(content)})

        def cut(j):
            msgs[i]["content"] = content[starts[j]:]
            return self._split(r, msgs, responses)

        return (msgs, *cut(_first(len(starts) - 1, lambda j: cut(j)[2] <= limit)), full)  # fewest tokens removed

    # -- one row -----------------------------------------------------------
    def __call__(self, row: Row) -> RowResult:
        """Tokenize one row.

        Raises:
            BadRow: the template cannot render or split the row.
            DataError: message rows with no template; no EOS while ``append_eos`` needs one.
        """
        if row.prompt is None:
            return self._text_row(row)
        sft = row.rejected is None  # one completion: rendered as a pair with itself, kept as the chosen side
        if sft:
            row = dataclasses.replace(row, rejected=row.chosen)
        r, prompts, responses = row_messages(row, self.chat, self.text)
        out, shared = RowResult(row.source), prompts[1] is None
        for label, resp in zip(("chosen", "rejected"), responses):
            if not any(self._strip_marks(m["content"]).strip() for m in resp):
                out.drop = f"empty response: {label!r} has no text besides end-of-turn marks"
                return out
        try:  # each fit: (prompt messages, generation prompt ids, whole renderings, prompt length, untruncated)
            fits = ([self._fit_prompt(r, prompts[0], responses)] * 2 if shared else
                    [self._fit_prompt(r, p, [resp]) for p, resp in zip(prompts, responses)])
        except Drop as why:
            out.drop = str(why)
            return out
        fulls = fits[0][2] if shared else [f[2][0] for f in fits]
        out.control_text = fulls[0][2] or fulls[1][2]
        cuts = [n for _, _, _, n, _ in fits]
        # each side's prompt as text: a response is what the template writes after it, to the turn's end
        befores = [self._prompt_text(r, f[0]) if f[0] else "" for f in fits[: 2 - shared]] * (1 + shared)
        for (pm, g, _, n, _), (_, text, _), before, resp in zip(fits, fulls, befores, responses):
            if pm and n < len(g) and not text.startswith(before):
                raise BadRow(self._unsplit(r, pm, resp))
            lost = _first_rewritten([self._strip_marks(m["content"]) for m in resp], text[_common_prefix(text, before):])
            if lost is not None and out.template_dropped is None:  # trained as rendered, and counted
                msgs = [{**m, "content": self._strip_marks(m["content"])} for m in pm + resp]
                out.template_dropped = r.dropped_text(msgs, len(pm) + lost)
        (fc, _, _), (fr, _, _) = fulls
        prompt, rprompt, full_c, full_r = fc[: cuts[0]], fr[: cuts[1]], fc[cuts[0]:], fr[cuts[1]:]
        untruncated_prompt = max(full for *_, full in fits)
        out.lengths = (untruncated_prompt, len(full_c), len(full_r))
        limit = self.cfg.max_length
        c, rj = full_c[: max(limit - len(prompt), 0)], full_r[: max(limit - len(rprompt), 0)]
        cut_prompt = untruncated_prompt > self.cfg.max_prompt_length
        out.truncated = cut_prompt or (len(c), len(rj)) != (len(full_c), len(full_r))
        out.prompt_cut_fits = cut_prompt and untruncated_prompt + max(len(full_c), len(full_r)) <= limit
        out.drop = self._no_signal(prompt, rprompt, c, rj, (full_c, full_r), sft)
        if out.drop and out.drop.startswith("empty prompt") and any(m["content"].strip() for m in prompts[0]):
            out.drop = ("empty prompt: the prompt's text runs into the response's first token (raw text is joined as "
                        "written), so no prompt token comes before the response: end the prompt with whitespace")
        if out.drop and out.drop.startswith("no room") and self.cfg.max_prompt_length >= limit:
            out.drop += (f" (data.max_prompt_length={self.cfg.max_prompt_length} is not below data.max_length: "
                         "lower it to cut such prompts and keep the pair)")
        if out.drop is None:
            out.pair = (TokenizedPair(prompt, c, [], row.source) if sft else
                        TokenizedPair(prompt, c, rj, row.source, None if rprompt == prompt else rprompt))
        if sft:
            out.lengths = out.lengths[:2] + (0,)
        return out

    def _text_row(self, row: Row) -> RowResult:
        """A ``text`` row: the tokenizer's ids of the whole text (BOS as the tokenizer adds it, its
        own EOS suffix not, control-token text as plain text) and one EOS; the first token is the
        prompt, the rest the completion, cut to ``max_length`` (none left: dropped as ``no room``)."""
        out = RowResult(row.source)
        text = self._strip_marks(row.chosen)
        found = self.control_re.search(text) if self.control_re else None
        out.control_text = found.group(0) if found else None
        ids = list(self.prefix) + hf_tokenizer(self.tokenizer)(text, add_special_tokens=False,
                                                               split_special_tokens=True)["input_ids"]
        if self.cfg.append_eos:
            if self.tokenizer.eos_token_id is None:
                raise DataError("text rows need an EOS token to end them and the tokenizer has none; set "
                                "data.append_eos: false")
            ids = list(ids) + [self.tokenizer.eos_token_id]
        out.lengths = (1, max(len(ids) - 1, 0), 0)
        if len(ids) < 2:
            out.drop = "empty response: the text is one token"
            return out
        limit = self.cfg.max_length
        prompt, completion = list(ids[:1]), list(ids[1:limit])
        out.truncated = len(ids) > limit
        out.drop = self._no_signal(prompt, prompt, completion, completion, (ids, ids), sft=True)
        if out.drop is None:
            out.pair = TokenizedPair(prompt, completion, [], row.source)
        return out

    def _no_signal(self, prompt, rprompt, chosen, rejected, untruncated, sft: bool = False) -> Optional[str]:
        """Why a truncated pair carries no preference signal (``sft``: no completion), or None."""
        if not prompt or not rprompt:
            return "empty prompt: no prompt tokens before the response (add a prompt, or a BOS token)"
        for label, ids, p in (("chosen", chosen, prompt), ("rejected", rejected, rprompt)):
            if not ids:
                return (f"no room: no {label} tokens fit in data.max_length={self.cfg.max_length} "
                        f"after a {len(p)}-token prompt")
        if not sft and prompt == rprompt and chosen == rejected:
            when = "after rendering" if untruncated[0] == untruncated[1] else \
                f"after truncation to data.max_length={self.cfg.max_length}"
            return f"same ids: chosen and rejected are the same {len(chosen)} tokens {when}"
        return None


def tokenize_rows(rows: list, tokenizer, cfg, results: Optional[list] = None) -> tuple:
    """Rows -> ``(list[TokenizedPair], BadRowReport)``; see the module docstring for the rules.

    ``report.bad`` lists rows the template cannot render; ``report.dropped`` the
    pairs without signal or room (``(source, "kind: reason")``). Each pair's
    prompt has at most ``cfg.max_prompt_length`` tokens and each side at most
    ``cfg.max_length``. ``results``, when given, receives every
    :class:`RowResult` (for ``dtrain data check``).

    Raises:
        DataError: message rows with no chat template, a bad ``data.chat_template``,
            or no end-of-turn/EOS token while ``append_eos`` is on.
    """
    tok = RowTokenizer.build(tokenizer, cfg)
    pairs, report = [], BadRowReport(rows_read=len(rows))
    for row in rows:
        try:
            res = tok(row)
        except BadRow as err:
            report.bad.append((row.source, str(err)))
            continue
        if results is not None:
            results.append(res)
        if res.drop is not None:
            report.dropped.append((row.source, res.drop))
            continue
        report.truncated += int(res.truncated)
        report.prompt_cut_fits += int(res.prompt_cut_fits)
        if res.control_text is not None:
            report.control_text.append((row.source, res.control_text))
        if res.template_dropped is not None:
            report.template_dropped.append((row.source, res.template_dropped))
        pairs.append(res.pair)
    return pairs, report


__all__ = ["Drop", "RowResult", "RowTokenizer", "end_of_turn", "prefixes_first_fragment", "row_messages",
           "tokenize_rows", "transcript_messages"]
