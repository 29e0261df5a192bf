"""Render rows with the chat template, tokenize, and truncate to length limits.

The prompt and each response are tokenized separately, so no token straddles
the prompt/response boundary (as TRL's DPO/ORPO collators do). Only the prompt
gets the tokenizer's special tokens, so BOS appears once, at the start; when the
chat template text already begins with the BOS string it is not added again.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import DataError
from ..types import TokenizedPair
from .formats import ASSISTANT_MARKER, HUMAN_MARKER, BadRow, BadRowReport, Row

_SENTINEL = "\u2063dtrain-response\u2063"


def has_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` (HF or mlx-lm ``TokenizerWrapper``) has a chat template."""
    flag = getattr(tokenizer, "has_chat_template", None)
    return bool(flag) if flag is not None else getattr(tokenizer, "chat_template", None) is not None


def end_of_turn(tokenizer) -> tuple:
    """The token that closes an assistant turn: ``(text, [ids])``.

    Renders a user + assistant exchange with the chat template and takes the
    special token that directly follows the assistant content (``<|im_end|>``
    for ChatML, ``<|eot_id|>`` for Llama 3). Falls back to the EOS token when
    there is no template or nothing special follows the content.
    """
    if has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "1"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False)
        except Exception:  # templates may reject this probe; EOS is a safe fallback
            text = ""
        if _SENTINEL in text:
            tail = text.split(_SENTINEL, 1)[1].lstrip(" ")
            specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
            specials |= set((tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}).keys())
            for tok in sorted(specials, key=len, reverse=True):
                if tok and tail.startswith(tok):
                    return tok, [tokenizer.convert_tokens_to_ids(tok)]
    if tokenizer.eos_token is None:
        raise DataError("the tokenizer has neither a chat template end-of-turn token nor an EOS token; set data.append_eos: false")
    return tokenizer.eos_token, [tokenizer.eos_token_id]


def transcript_messages(text: str) -> list:
    """``\\n\\nHuman: a\\n\\nAssistant: b\\n\\nAssistant:`` -> user/assistant messages.

    The trailing empty Assistant turn (the generation prompt) is dropped; text
    before the first marker joins the first turn.
    """
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
        content = text[at + len(marker): end].strip()
        msgs.append({"role": markers[marker], "content": content})
    if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1]["content"]:
        msgs.pop()
    if lead and msgs:
        msgs[0] = {**msgs[0], "content": (lead + "\n" + msgs[0]["content"]).strip()}
    return msgs or [{"role": "user", "content": lead}]


def _with_system(msgs: list, system: Optional[str]) -> list:
    if system is None or (msgs and msgs[0]["role"] == "system"):
        return msgs
    return [{"role": "system", "content": system}] + msgs


def prompt_messages(row: Row, tokenizer, cfg, rejected: bool = False) -> Optional[list]:
    """The chat messages of a row's prompt, or None when it renders as raw text."""
    prompt = row.rejected_prompt if rejected and row.rejected_prompt is not None else row.prompt
    if isinstance(prompt, list):
        if not has_chat_template(tokenizer):
            raise DataError(f"{row.source}: message rows need a chat template, and the tokenizer has none")
        return _with_system(prompt, row.system)
    if cfg.prompt_template == "raw" or not has_chat_template(tokenizer):
        return None
    msgs = transcript_messages(prompt) if row.transcript else [{"role": "user", "content": prompt}]
    return _with_system(msgs, row.system)


def render_prompt(row: Row, tokenizer, cfg, rejected: bool = False) -> str:
    """Prompt text: chat template with ``add_generation_prompt=True``, or raw text.

    Raw text is ``system + "\\n\\n" + prompt`` when the row has a system string.
    """
    msgs = prompt_messages(row, tokenizer, cfg, rejected)
    if msgs is None:
        return (row.system + "\n\n" if row.system else "") + row.prompt
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def render_response(row: Row, response, tokenizer, cfg, eot: str, rejected: bool = False) -> str:
    """Response text without the end-of-turn token.

    A multi-message completion is the template's text for prompt + completion
    after the prompt's generation-prompt text, minus its final end-of-turn.
    Transcript responses lose their leading space when rendered as a chat turn.
    """
    if isinstance(response, str):
        return response.lstrip() if row.transcript and prompt_messages(row, tokenizer, cfg) else response
    msgs = prompt_messages(row, tokenizer, cfg, rejected)
    head = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(msgs + response, tokenize=False)
    if not full.startswith(head):
        raise BadRow("the chat template renders this multi-message completion differently from its prompt")
    text = full[len(head):].rstrip()
    return text[: -len(eot)] if eot and text.endswith(eot) else text


def encode_prompt(text: str, tokenizer) -> list:
    """Prompt ids with the tokenizer's special tokens, unless the text has BOS already."""
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add))


def encode_row(row: Row, tokenizer, cfg, eot: tuple) -> tuple:
    """Untruncated ids ``(prompt, chosen, rejected, rejected_prompt_or_None)``.

    ``eot`` is :func:`end_of_turn`'s ``(text, ids)``; its ids end each response
    when ``cfg.append_eos`` is on.

    Raises:
        BadRow: a multi-message completion the template cannot split.
        DataError: message rows with a tokenizer that has no chat template.
    """
    eot_text, eot_ids = eot
    suffix = list(eot_ids) if cfg.append_eos else []
    prompt = encode_prompt(render_prompt(row, tokenizer, cfg), tokenizer)
    rprompt = None
    if row.rejected_prompt is not None:
        rprompt = encode_prompt(render_prompt(row, tokenizer, cfg, rejected=True), tokenizer)
        rprompt = None if rprompt == prompt else rprompt
    ids = []
    for response, is_rejected in ((row.chosen, False), (row.rejected, True)):
        text = render_response(row, response, tokenizer, cfg, eot_text, is_rejected)
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)) + suffix)
    return prompt, ids[0], ids[1], rprompt


def truncate_prompt(prompt: list, max_prompt_length: int, bos_id: Optional[int]) -> list:
    """Keep the last ``max_prompt_length`` tokens; a leading BOS is kept in place."""
    if len(prompt) <= max_prompt_length:
        return prompt
    if bos_id is not None and prompt and prompt[0] == bos_id and max_prompt_length > 1:
        return prompt[:1] + prompt[len(prompt) - max_prompt_length + 1:]
    return prompt[len(prompt) - max_prompt_length:]


def truncate_pair(prompt: list, chosen: list, rejected: list, rprompt: Optional[list], cfg,
                  bos_id: Optional[int]) -> tuple:
    """Apply the length limits; returns ``(prompt, chosen, rejected, rprompt, truncated)``.

    Rule: each prompt is cut from the left to ``max_prompt_length`` (BOS kept),
    then each response from the right to ``max_length - len(its prompt)``. A
    response may end up empty; the caller drops such pairs.
    """
    p = truncate_prompt(prompt, cfg.max_prompt_length, bos_id)
    rp = truncate_prompt(rprompt, cfg.max_prompt_length, bos_id) if rprompt is not None else None
    c = chosen[: max(cfg.max_length - len(p), 0)]
    r = rejected[: max(cfg.max_length - len(rp if rp is not None else p), 0)]
    truncated = (len(p), len(c), len(r)) != (len(prompt), len(chosen), len(rejected)) or (
        rp is not None and len(rp) != len(rprompt))
    return p, c, r, rp, truncated


def encode_rows(rows: list, tokenizer, cfg) -> tuple:
    """Rows -> untruncated ``(list[TokenizedPair], BadRowReport)``.

    Rows the template cannot render are listed in ``report.bad``.

    Raises:
        DataError: message rows with a tokenizer that has no chat template, or no
            end-of-turn/EOS token while ``append_eos`` is on.
    """
    eot = end_of_turn(tokenizer) if cfg.append_eos else ("", [])
    pairs, report = [], BadRowReport(rows_read=len(rows))
    for row in rows:
        try:
            p, c, r, rp = encode_row(row, tokenizer, cfg, eot)
        except BadRow as err:
            report.bad.append((row.source, str(err)))
            continue
        pairs.append(TokenizedPair(prompt=p, chosen=c, rejected=r, source=row.source, rejected_prompt=rp))
    return pairs, report


def limit_pairs(pairs: list, cfg, bos_id: Optional[int]) -> tuple:
    """Truncate pairs by :func:`truncate_pair`; returns ``(kept, report)``.

    Pairs left with zero response tokens on either side are dropped and listed
    in ``report.dropped``; ``report.truncated`` counts the shortened ones.
    """
    kept, report = [], BadRowReport()
    for pair in pairs:
        p, c, r, rp, truncated = truncate_pair(pair.prompt, pair.chosen, pair.rejected, pair.rejected_prompt, cfg, bos_id)
        if not c or not r:
            report.dropped.append((pair.source, f"no response tokens fit in data.max_length={cfg.max_length} "
                                                f"after a {len(p)}-token prompt"))
            continue
        report.truncated += int(truncated)
        kept.append(TokenizedPair(prompt=p, chosen=c, rejected=r, source=pair.source, rejected_prompt=rp))
    return kept, report


def tokenize_rows(rows: list, tokenizer, cfg) -> tuple:
    """Rows -> ``(list[TokenizedPair], BadRowReport)``: :func:`encode_rows` then :func:`limit_pairs`.

    Each pair's prompt has at most ``cfg.max_prompt_length`` tokens and each side
    at most ``cfg.max_length`` (prompt + response); see :func:`truncate_pair`.

    Raises:
        DataError: as :func:`encode_rows`.
    """
    encoded, report = encode_rows(rows, tokenizer, cfg)
    pairs, limited = limit_pairs(encoded, cfg, getattr(tokenizer, "bos_token_id", None))
    return pairs, report.merge(dataclasses.replace(limited, rows_read=0))
