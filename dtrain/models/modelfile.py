"""An Ollama Modelfile for an exported GGUF: ``FROM``, ``TEMPLATE`` from the chat template, ``PARAMETER stop``.

A model without a chat template gets the raw prompt dtrain trained it on (:data:`RAW_PROMPT`).

Ollama renders prompts with Go templates, not Jinja. We do not translate Jinja
code; we read the template's structure off its output. The Jinja template is
rendered on probe conversations whose contents are unique markers, which gives
for each role the text before and after its content, the text that opens the
conversation, the generation prompt, and a default system message the template
inserts when there is none (Ollama's ``SYSTEM``). Those pieces are then checked
to rebuild the Jinja output of further conversations exactly (system or not,
one to three turns, with and without the generation prompt); a template they do
not rebuild (one that branches on content, numbers turns, ...) gets no
``TEMPLATE`` line and a comment saying so, never a wrong one.

Ollama's template syntax: https://github.com/ollama/ollama/blob/main/docs/template.md
(``.Messages`` with ``.Role`` and ``.Content``). Values are quoted the way Ollama's
Modelfile parser reads them back (:func:`ollama_quote`); one it cannot read back is
left out with a notice.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Callable, Optional

_MARK = "\u2063{}\u2063"  # invisible separators around probe contents
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatParts:
    """A chat template as literal pieces: ``open`` + per message ``before[role] + content + after[role]``,
    then ``generation`` when a reply is asked for; ``default_system``: content of the system message
    the template writes when the conversation has none (None: it writes none)."""

    open: str
    before: dict
    after: dict
    generation: str
    default_system: Optional[str]

    def render(self, messages: list, add_generation_prompt: bool) -> str:
        if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.default_system}] + list(messages)
        text = self.open + "".join(self.before[m["role"]] + m["content"] + self.after[m["role"]] for m in messages)
        return text + (self.generation if add_generation_prompt else "")


def _split(text: str, marks: list) -> list:
    """``text`` cut at each marker in order: the pieces between them (len(marks) + 1)."""
    pieces = []
    for m in marks:
        head, sep, text = text.partition(m)
        if not sep:
            raise ValueError(f"the template does not write the content {m!r}")
        pieces.append(head)
    return pieces + [text]


def chat_parts(render: Callable[[list, bool], str]) -> Optional[ChatParts]:
    """The pieces of the template ``render(messages, add_generation_prompt)``, or None when they do not
    rebuild its output on the check conversations (or it refuses them)."""
    msg = lambda role, n: {"role": role, "content": _MARK.format(f"{role}{n}")}  # noqa: E731
    s, u1, a1, u2 = msg("system", 1), msg("user", 1), msg("assistant", 1), msg("user", 2)
    try:
        # [open+sysbefore] S [sysafter+userbefore] U1 [userafter+astbefore] A1 [astafter+userbefore] U2 [userafter] (+gen)
        with_sys = _split(render([s, u1, a1, u2], False), [m["content"] for m in (s, u1, a1, u2)])
        gen = render([s, u1, a1, u2], True)
        no_sys = _split(render([u1], False), [u1["content"]])
        pairs = _split(render([u1, a1], False), [u1["content"], a1["content"]])
    except Exception:  # jinja errors, raise_exception(), a template that drops content
        return None
    if not gen.startswith(render([s, u1, a1, u2], False)):
        return None
    user_after = with_sys[4]
    after = {"user": user_after, "assistant": pairs[2]}
    if not (with_sys[2].startswith(user_after) and with_sys[3].startswith(after["assistant"])):
        return None
    before = {"assistant": with_sys[2][len(user_after):], "user": with_sys[3][len(after["assistant"]):]}
    if not with_sys[1].endswith(before["user"]):
        return None
    after["system"] = with_sys[1][: len(with_sys[1]) - len(before["user"])]
    head = no_sys[0]
    if not head.endswith(before["user"]):
        return None
    head = head[: len(head) - len(before["user"])]
    # the opening text: what precedes the system header when the conversation has one
    candidates = [(with_sys[0][:i], with_sys[0][i:]) for i in range(len(with_sys[0]) + 1)]
    for open_, sys_before in candidates:
        default = None
        if head != open_:
            start, end = open_ + sys_before, after["system"]
            if not (head.startswith(start) and head.endswith(end) and len(head) >= len(start) + len(end)):
                continue
            default = head[len(start): len(head) - len(end)]
        parts = ChatParts(open_, {**before, "system": sys_before}, after,
                          gen[len(render([s, u1, a1, u2], False)):], default)
        if _rebuilds(parts, render, msg):
            return parts
    return None


def trims_content(render: Callable[[list, bool], str]) -> bool:
    """Whether the template ``render(messages, add_generation_prompt)`` drops whitespace around some message's
    content (Jinja's ``| trim``, Python's ``.strip()``, ``.lstrip('\\n')`` ...): read off its output for contents
    padded with spaces and with line ends. False when it refuses the probe."""
    for pad in (" ", "\n"):
        msgs = [{"role": role, "content": pad + _MARK.format(f"{role}{n}") + pad}
                for role, n in (("system", 1), ("user", 1), ("assistant", 1), ("user", 2))]
        try:
            text = render(msgs, False)
        except Exception:  # jinja errors, raise_exception(): chat_parts gives no TEMPLATE then
            return False
        if any(m["content"] not in text for m in msgs):
            return True
    return False


def _rebuilds(parts: ChatParts, render, msg) -> bool:
    # a reply holding its reasoning, as a model's earlier reply comes back in Ollama's history: DeepSeek-R1's and
    # Qwen3's templates drop it (they branch on the content's "</think>")
    reasoned = {"role": "assistant", "content": "<think>\nr\n</think>\n\n" + msg("assistant", 3)["content"]}
    convs = [[msg("user", 1)], [msg("system", 1), msg("user", 1)],
             [msg("user", 1), msg("assistant", 1), msg("user", 2), msg("assistant", 2), msg("user", 3)],
             [msg("system", 1), msg("user", 1), msg("assistant", 1)], [msg("user", 1), reasoned, msg("user", 2)]]
    try:
        return all(parts.render(c, g) == render(c, g) for c in convs for g in (False, True))
    except Exception:
        return False


def go_printable(ch: str) -> bool:
    """Go's ``strconv.IsPrint``: Unicode letters, marks, numbers, punctuation, symbols and the ASCII space."""
    return ch == " " or unicodedata.category(ch)[0] in "LMNPS"


def ollama_quote(text: str, quotes: tuple = ('"', '"""')) -> tuple:
    """``(value, None)``: ``text`` in the first of ``quotes`` that Ollama's Modelfile parser reads back as
    ``text``; ``(None, reason)`` when none does.

    ollama/ollama ``parser/parser.go`` (``ParseFile``, ``unquote``) unescapes nothing: a value ends at
    the first line end where the text so far, trimmed, closes its opening quote (three quotes at the
    start open ``\"\"\"``), and drops each rune ``strconv.IsPrint`` rejects but tab and line ends.
    """
    dropped = next((c for c in text if not go_printable(c) and c not in "\t\r\n"), None)
    if dropped is not None:
        return None, f"Ollama's Modelfile parser drops the character U+{ord(dropped):04X}, so no quoting gives it back"
    lines = [text[:i].rstrip(" \t\r\n") for i, c in enumerate(text) if c in "\r\n"]
    for q in quotes:
        opens = '"""' if (q + text + q).startswith('"""') else q
        if opens == q and not any(line.endswith(q) for line in lines):
            return q + text + q, None
    return None, "Ollama's Modelfile parser cannot quote it (a line of it ends with \"\"\")"


def _go(text: str) -> str:
    """A Go template action writing ``text`` literally (JSON string escapes are Go's; characters Ollama's
    Modelfile parser would drop are written as Go's ``\\u``/``\\U`` escapes)."""
    if not text:
        return ""
    literal = "".join(c if go_printable(c) else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"
                      for c in json.dumps(text, ensure_ascii=False))
    return "{{ " + literal + " }}"


def go_template(parts: ChatParts) -> str:
    """Ollama's TEMPLATE for ``parts`` over ``.Messages`` (a BOS the tokenizer adds is cut from ``parts.open``
    before: ``export.ollama_modelfile``). A last assistant message stays open (prefill), as in Ollama's templates.
    A conversation without a system message gets the template's default one here: Ollama adds ``SYSTEM`` only
    when it is not empty (server/routes.go), and Llama 3's default has empty content."""
    lines = [_go(parts.open)] if parts.open else []
    lines.append("{{- range $i, $_ := .Messages }}")
    lines.append("{{- $last := eq (len (slice $.Messages $i)) 1 }}")
    if parts.default_system is not None:
        default = parts.before["system"] + parts.default_system + parts.after["system"]
        lines.append(f'{{{{- if and (eq $i 0) (ne .Role "system") }}}}{_go(default)}{{{{ end }}}}')
    for n, role in enumerate(ROLES):
        keyword = "if" if n == 0 else "else if"
        close = _go(parts.after[role])
        if role == "assistant" and close:
            close = "{{- if not $last }}" + close + "{{ end }}"
        lines.append(f'{{{{- {keyword} eq .Role "{role}" }}}}{_go(parts.before[role])}{{{{ .Content }}}}{close}')
    lines.append("{{- end }}")
    lines.append("{{- if and $last (ne .Role \"assistant\") }}" + _go(parts.generation) + "{{ end }}")
    lines.append("{{- end }}")
    return "\n".join(lines)


# dtrain's RAW_TEXT (data/templates.py) in Ollama's terms: what a model without a chat template was trained on
RAW_PROMPT = '{{- if .System }}{{ .System }}{{ "\\n\\n" }}{{ end }}{{ .Prompt }}'


def modelfile(gguf_name: str, parts: Optional[ChatParts], stops: list, name: str,
              report: Optional[Callable[[str], None]] = None, has_template: bool = True, trims: bool = False) -> str:
    """The Modelfile text: ``FROM ./gguf_name``, TEMPLATE and SYSTEM from ``parts`` (a comment when
    None; :data:`RAW_PROMPT` when not ``has_template``), one ``PARAMETER stop`` per end text. A value
    :func:`ollama_quote` cannot quote is left out: a comment in its place and one line to ``report``.
    ``trims``: the chat template trims message content (:func:`trims_content`), which the TEMPLATE cannot (a
    comment says so)."""
    name = name.replace("\r", " ").replace("\n", " ")  # a line break would end the comment: Ollama reads on as commands
    out = [f"# {name}: `ollama create NAME -f Modelfile` in this folder", f"FROM ./{gguf_name}"]

    def add(command: str, label: str, text: str, quotes: tuple) -> None:
        value, reason = ollama_quote(text, quotes)
        if value is not None:
            out.append(f"{command} {value}")
            return
        out.append(f"# {label} left out: {reason}")
        if report is not None:
            report(f"Modelfile: {label} left out: {reason}")

    if not has_template:
        out.append("# the model has no chat template: prompts are sent as raw text, as dtrain trains them (the "
                   "system text and a blank line, then the prompt)")
        add("TEMPLATE", "TEMPLATE", RAW_PROMPT, ('"""', '"'))
    elif parts is None:
        out.append("# TEMPLATE: the chat template's structure could not be read off its output; write one by hand")
    else:
        if trims:  # the probe contents have no whitespace to trim, so the pieces rebuild the template without it
            out.append("# the chat template trims the whitespace around message content and this TEMPLATE cannot (Go "
                       "templates have no trim): send messages without leading or trailing whitespace")
        add("TEMPLATE", "TEMPLATE", go_template(parts), ('"""', '"'))
        if parts.default_system:
            add("SYSTEM", f"SYSTEM {parts.default_system!r}", parts.default_system, ('"""', '"'))
    for stop in stops:
        add("PARAMETER stop", f"PARAMETER stop {stop!r}", stop, ('"', '"""'))
    return "\n".join(out) + "\n"
