"""Chat templates: the tokenizer's own, a named one, a Jinja file, or raw text.

A :class:`Renderer` turns messages ``[{role, content}]`` into text with one
Jinja chat template, rendered by ``transformers``' ``apply_chat_template`` (the
model's own template goes through mlx-lm's ``TokenizerWrapper``, as
``mlx_lm.generate`` renders it, including its ``enable_thinking`` default).

Templates besides the model's own (``data.chat_template``):

- ``chatml``: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
  ``<|im_start|>assistant\\n`` as the generation prompt. On a vocabulary
  without these tokens they are plain text, and EOS ends each response.
- ``plain``: ``{Role}: {content}\\n\\n`` per message (``System``, ``User``,
  ``Assistant``), ``Assistant:`` as the generation prompt; EOS ends each
  response. Message rows use it when there is no template and
  ``data.prompt_template`` is ``raw``.
- a path to a Jinja file in the same dialect as Hugging Face chat templates.

Plain-text prompts under ``prompt_template: raw`` (or with no template at all)
use :data:`RAW_TEXT`: ``system + "\\n\\n" + prompt``, the response appended
as is, EOS at its end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from ..errors import BadRow, DataError

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN = (
    "{% for message in messages %}{{ message['role'] | capitalize + ': ' + message['content'] + '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
NAMED_TEMPLATES = {"chatml": CHATML, "plain": PLAIN}
# Plain-text prompts without a chat template: no roles, no end-of-turn text. (transformers renders
# templates with trim_blocks, so literal newlines sit in {{ }} expressions, never after a block tag.)
RAW_TEXT = ("{% for message in messages %}{{ message['content'] }}{% if message['role'] == 'system' %}{{ '\n\n' }}"
            "{% endif %}{% endfor %}")

_SENTINEL = "\u2063dtrain-response\u2063"
# how Llama 3.2's template writes the day when no date_string is given (transformers' strftime_now)
DATE_FORMAT = "%d %b %Y"


def template_date(cfg) -> str:
    """``data.template_date`` of a DataConfig (YYYY-MM-DD), or where it is null today's, by the local clock as
    transformers' ``strftime_now``."""
    return cfg.template_date or datetime.now().date().isoformat()


def date_string(day: str) -> str:
    """A YYYY-MM-DD day as :data:`DATE_FORMAT` writes it (``2024-07-26`` -> ``26 Jul 2024``)."""
    return datetime.strptime(day, "%Y-%m-%d").strftime(DATE_FORMAT)


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (or ``tokenizer`` itself)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def model_template_name(tokenizer) -> str:
    """How messages name the tokenizer's own chat template, with where it was read: a GGUF's
    ``tokenizer.chat_template``, a folder's ``chat_template.jinja`` (transformers prefers it) or
    ``tokenizer_config.json``'s ``chat_template`` (``name_or_path``: the file or folder it was loaded from)."""
    name = getattr(hf_tokenizer(tokenizer), "name_or_path", None)
    loaded_from = Path(name) if isinstance(name, str) and name else None  # "": built in memory, not the cwd
    if loaded_from is None:
        return "the model's chat template"
    if loaded_from.is_file():
        where = f"{loaded_from}: tokenizer.chat_template"
    elif (loaded_from / "chat_template.jinja").is_file():
        where = str(loaded_from / "chat_template.jinja")
    elif (loaded_from / "tokenizer_config.json").is_file():
        where = f"{loaded_from / 'tokenizer_config.json'}: chat_template"
    else:  # a hub id
        return "the model's chat template"
    return f"the model's chat template ({where})"


def has_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` (HF or mlx-lm ``TokenizerWrapper``) has a chat template."""
    flag = getattr(tokenizer, "has_chat_template", None)
    return bool(flag) if flag is not None else getattr(tokenizer, "chat_template", None) is not None


def control_strings(tokenizer) -> tuple:
    """Text of every special (control) token, longest first.

    Special means the tokenizer's ``all_special_tokens`` plus added tokens
    flagged ``special`` (GGUF CONTROL tokens). Added tokens that are not special
    (``<think>`` in Qwen3, GGUF USER_DEFINED) are ordinary vocabulary, and so is a
    named one the tokenizer does not match whole (a GGUF pad id on a NORMAL token:
    models/tokenizer.py runs BPE over its text, as llama.cpp does).
    """
    hf = hf_tokenizer(tokenizer)
    added = {t.content: t.special for t in getattr(hf, "added_tokens_decoder", {}).values()}
    found = {t for t in getattr(hf, "all_special_tokens", []) or [] if not added or t in added}
    found |= {t for t, special in added.items() if special}
    return tuple(sorted((t for t in found if t), key=lambda t: (-len(t), t)))


def template_source(value: str) -> str:
    """Jinja text for a ``data.chat_template`` value: a name of :data:`NAMED_TEMPLATES` or a file.

    Raises:
        DataError: neither a known name nor a readable UTF-8 file.
    """
    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    if "{{" in value or "{%" in value:  # as mlx_lm.server --chat-template takes it
        raise DataError("data.chat_template: the template's text was given; it takes a template name "
                        f"({', '.join(NAMED_TEMPLATES)}) or a Jinja file: save the text to a .jinja file and name it")
    try:
        path = Path(value).expanduser()
        found = path.is_file()
    except (OSError, RuntimeError):  # a name too long for the file system; ~user of no user here
        found = False
    if not found:
        raise DataError(f"data.chat_template: {value!r} is neither a template name ({', '.join(NAMED_TEMPLATES)}) "
                        "nor a Jinja file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data.chat_template: {value}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:  # no read permission, a disk error
        raise DataError(f"data.chat_template: {value}: cannot be read: {err.strerror or err}") from None


@dataclass(frozen=True)
class Renderer:
    """Messages -> text with one chat template.

    ``template``: Jinja source, or None for the tokenizer's own template.
    ``closing``: the text the template writes after the content of a final
    assistant message (``"<|im_end|>\\n"`` for ChatML, ``""`` for raw text),
    found by rendering a probe conversation once.
    ``turn_end``: the part of ``closing`` that ends the turn, up to its first control
    token (Phi-3's ``"<|end|>"`` of ``"<|end|>\\n<|endoftext|>"``: the EOS after it
    ends the whole conversation, not the turn); all of it where there is none.
    ``name``: how messages name this template.
    ``probed``: False where the template refused every probe conversation (:func:`make_renderer`), so
    ``closing`` and ``turn_end`` are unknown and each row's are probed from its own conversation.
    ``date``: the ``date_string`` every render is given (:data:`DATE_FORMAT`; None: none); ``dated``: the probe
    conversation's text changes with it.
    """

    tokenizer: Any
    template: Optional[str]
    closing: str = ""
    name: str = ""
    turn_end: str = ""
    probed: bool = True
    date: Optional[str] = None
    dated: bool = False

    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``.

        Raises:
            BadRow: the template rejects the messages (e.g. roles that do not alternate).
            DataError: the template is not valid Jinja (naming it and the line), whatever the row.
        """
        from jinja2 import TemplateSyntaxError

        # a Jinja template sees the keyword arguments as variables; mlx-lm's Python renderers take none of them
        own_python = self.template is None and getattr(self.tokenizer, "_chat_template", None) is not None
        date = {} if self.date is None or own_python else {"date_string": self.date}
        try:
            if self.template is None:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False, **date)
            return hf_tokenizer(self.tokenizer).apply_chat_template(
                messages, chat_template=self.template, add_generation_prompt=add_generation_prompt, tokenize=False,
                **date)
        except TemplateSyntaxError as err:
            raise DataError(f"{self.name}: Jinja syntax error on line {err.lineno}: {err.message}") from None
        except Exception as err:  # jinja2 errors, raise_exception() in templates
            raise BadRow(f"the chat template ({self.name}) cannot render this row: {err}") from None

    def ending(self, messages: list) -> tuple:
        """``(closing, turn_end)`` the template writes after the content of the final (assistant) message of
        ``messages``, found by rendering them with a sentinel for that content.

        Raises:
            BadRow, DataError: as :meth:`render`.
        """
        text = self.render([*messages[:-1], {**messages[-1], "content": _SENTINEL}])
        closing = text.split(_SENTINEL, 1)[1] if _SENTINEL in text else ""
        controls = control_strings(self.tokenizer)
        first = re.search("|".join(map(re.escape, controls)), closing) if controls else None
        return closing, closing[: first.end()] if first else closing

    def dropped_text(self, messages: list, index: int) -> str:
        """What the template leaves out of message ``index``'s content (as much of it as the text written in
        its place does not begin or end with, whitespace aside): DeepSeek-R1's drops ``"<think>...</think>"``."""
        content = messages[index]["content"].strip()
        try:
            probe = self.render([*messages[:index], {**messages[index], "content": _SENTINEL}, *messages[index + 1:]])
        except BadRow:  # the template refuses other text in its place: what it wrote is unknown
            return content
        real = self.render(messages)
        before, _, after = probe.partition(_SENTINEL)
        if not (_SENTINEL in probe and real.startswith(before) and real.endswith(after)):
            return content  # written elsewhere, or the rest of the conversation changes with it
        written = real[len(before): len(real) - len(after)].strip()
        start = next((i for i, (a, b) in enumerate(zip(content, written)) if a != b), min(len(content), len(written)))
        rest, written = content[start:], written[start:]
        end = next((i for i, (a, b) in enumerate(zip(rest[::-1], written[::-1])) if a != b), min(len(rest), len(written)))
        return rest[: len(rest) - end].strip()


def reads_clock(tokenizer, template: Optional[str]) -> bool:
    """Whether ``template`` (None: the tokenizer's) calls ``strftime_now``, the one clock transformers gives it."""
    own = getattr(hf_tokenizer(tokenizer), "chat_template", None)
    return "strftime_now" in str(template if template is not None else own)


def run_reads_clock(tokenizer, cfg) -> bool:
    """Whether the chat template a run renders messages with (``data.chat_template``'s, else the tokenizer's)
    :func:`reads_clock`: the one case ``data.template_date`` reaches the tokens."""
    return reads_clock(tokenizer, template_source(cfg.chat_template) if cfg.chat_template is not None else None)


def make_renderer(tokenizer, template: Optional[str], name: str, date: Optional[str] = None) -> Renderer:
    """A :class:`Renderer` with its ``closing`` and ``turn_end`` texts probed from a user + assistant exchange
    (a system message first where the template refuses it without one); where it refuses both, ``probed`` is
    False and each row's own conversation is its probe (:meth:`Renderer.ending`). ``date``: the
    ``date_string`` it renders with (:data:`DATE_FORMAT`) where the template :func:`reads_clock` (Llama 3.2's; Llama
    3.1's fixed default day is left to it, as transformers renders it), ``dated`` where the probe's text shows it.

    Raises:
        DataError: a template that is not valid Jinja (the probe compiles it once, before any row).
    """
    if not reads_clock(tokenizer, template):
        date = None  # its own text is every day's
    probe = Renderer(tokenizer, template, name=name, probed=False, date=date)
    exchange = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _SENTINEL}]
    for opening in ([], [{"role": "system", "content": "0"}]):  # some templates require a system message
        try:
            closing, turn_end = probe.ending(opening + exchange)
        except BadRow:
            continue
        found = Renderer(tokenizer, template, closing, name, turn_end, date=date)
        other = replace(found, date="01 Jan 1970" if date != "01 Jan 1970" else "02 Jan 1970")
        dated = date is not None and found.render(opening + exchange) != other.render(opening + exchange)
        return replace(found, dated=dated)
    return probe


def renderers(tokenizer, cfg) -> tuple:
    """``(messages, text)`` renderers for a DataConfig.

    ``messages`` renders message rows: ``data.chat_template`` when set, else the
    tokenizer's template, else ``plain`` under ``prompt_template: raw``, else
    None (message rows are then an error). ``text`` renders plain-text prompts:
    the same template under ``prompt_template: chat``, else :data:`RAW_TEXT`.

    Raises:
        DataError: a ``data.chat_template`` that is neither a name nor a file, or a
            template that is not valid Jinja.
    """
    date = date_string(template_date(cfg))
    if cfg.chat_template is not None:
        chat = make_renderer(tokenizer, template_source(cfg.chat_template), f"data.chat_template {cfg.chat_template}",
                             date)
    elif has_chat_template(tokenizer):
        chat = make_renderer(tokenizer, None, model_template_name(tokenizer), date)
    else:
        chat = None
    raw = make_renderer(tokenizer, RAW_TEXT, "raw text", date)
    if cfg.prompt_template == "raw":
        return chat or make_renderer(tokenizer, PLAIN, "plain", date), raw
    return chat, chat or raw


def date_notice(tokenizer, cfg) -> Optional[str]:
    """The line saying which day a chat template that writes the date renders into every conversation
    (``cfg``: a DataConfig whose ``template_date`` is set), or None where no template of the run writes one.
    Renders probes only where the template reads the clock (a resume that reads its data_cache renders nothing)."""
    if not run_reads_clock(tokenizer, cfg):
        return None
    used = [r for r in renderers(tokenizer, cfg) if r is not None]
    dated = next((r for r in used if r.dated), None)
    if dated is None:
        clock = next((r for r in used if reads_clock(tokenizer, r.template)), None)  # and reads no date_string
        return None if clock is None else (
            f"warning: {clock.name} writes the day it renders (strftime_now) and reads no date_string, so "
            "data.template_date cannot fix it: rows tokenized on another day differ (a run's data_cache keeps its "
            "first day's tokens for a resume)")
    return (f"{dated.name} writes the date into every conversation: rendered with {dated.date} (data.template_date "
            f"{cfg.template_date})")


def trained_template(tokenizer, cfg, messages: bool) -> Optional[str]:
    """The Jinja text the training prompts were rendered with (:func:`renderers`) where it is not the model's own;
    None where it is, or where it is raw text on a model without a template (prompted as raw text anyway).

    ``messages``: most training prompts are message rows. ``adapter_config.json`` records it so
    ``dtrain export`` prompts the merged model as it was trained.
    """
    own = template_source(cfg.chat_template) if cfg.chat_template is not None else None
    templated = own is not None or has_chat_template(tokenizer)
    if not messages and cfg.prompt_template == "raw":
        return RAW_TEXT if templated else None
    return PLAIN if messages and not templated else own


def end_of_turn(tokenizer, renderer: Optional[Renderer] = None) -> tuple:
    """The token that closes an assistant turn: ``(text, [ids])``.

    The control token the template writes right after the assistant content
    (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<|end|>`` for Phi-3:
    ``Renderer.turn_end``); the EOS token when there is no template or no control
    token follows the content.

    Raises:
        DataError: neither such a control token nor an EOS token exists.
    """
    if renderer is None and has_chat_template(tokenizer):
        renderer = make_renderer(tokenizer, None, model_template_name(tokenizer))
    tail = renderer.turn_end if renderer is not None else ""
    tok = next((t for t in control_strings(tokenizer) if tail.endswith(t)), None)
    if tok is not None:
        return tok, [tokenizer.convert_tokens_to_ids(tok)]
    if tokenizer.eos_token is None:
        raise DataError("the tokenizer has neither a chat template end-of-turn token nor an EOS token; "
                        "set data.append_eos: false")
    return tokenizer.eos_token, [tokenizer.eos_token_id]
