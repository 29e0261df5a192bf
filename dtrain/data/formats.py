"""Normalise every row format to one :class:`Row` (containers are read by sources.py).

Supported row formats (``data.format``; ``auto`` takes, per file, the format
most of the first :data:`DETECT_ROWS` JSON objects have, so a bad first row is
one bad row):

- ``standard``: TRL standard preference, ``prompt``/``chosen``/``rejected``
  strings (https://huggingface.co/docs/trl/dataset_formats#preference); a prompt that is a
  transcript (``Human: … \\n\\nAssistant:``) is read as one.
- ``conversational``: TRL conversational preference, message lists
  ``[{role, content}]`` (a response may be one message object, or ``{"messages": [...]}``, as
  mlx-lm-lora reads them); ``prompt`` is explicit, or implicit as the longest
  common message prefix of ``chosen`` and ``rejected`` (TRL ``extract_prompt``;
  a text ``prompt`` beside lists that hold the whole conversation is ignored, as TRL does, and so are
  prompt messages both lists open with). A response opens and ends with the assistant's message; a text
  prompt or response beside messages is one turn (the user's, the assistant's).
- ``transcript``: ``chosen``/``rejected`` strings only, e.g. Anthropic HH
  (``\\n\\nHuman: … \\n\\nAssistant: …``); the prompt is the longest common
  prefix of both sides that ends at an ``Assistant:`` turn marker; a response ends with the
  model's turn (not an unanswered ``Human:`` one).
- ``openai``: OpenAI preference fine-tuning (``input.messages``,
  ``preferred_output``, ``non_preferred_output``; each output one assistant
  message; https://platform.openai.com/docs/guides/direct-preference-optimization).
- ``sharegpt``: ``conversations`` of ``{from, value}`` plus ``chosen`` and
  ``rejected`` as ``{from, value}``; its speakers (``human``, ``gpt``) read as roles in any
  ``{role, content}`` message too.
- ``mapped``: ``data.fields`` renames columns (``{prompt: question, chosen:
  response_j, rejected: response_k, system: sys}``; for SFT rows ``{prompt:
  instruction, completion: output}``, or a ``messages`` or ``text`` column),
  then the row is read by its keys and the types of its values.

Every format may carry an optional ``system`` string (empty or blank: none); beside prompt messages
that hold a system message (first or later) one of them must say the same (written once, where it stands),
else the row is bad.

Rows with one completion, for ``objective.kind: sft`` (``Row.rejected`` is None):

- ``messages``: mlx-lm's ``chat`` and TRL's conversational language-modeling
  rows, ``{"messages": [...]}``, or ShareGPT's ``{"conversations": [{from, value}]}``; the completion is the last message (an assistant
  turn), the prompt the messages before it (mlx-lm's ``mask_prompt`` split; none
  for a lone assistant message, which TRL's SFTTrainer trains too). An assistant message of OpenAI's
  ``"weight": 0`` is not trained: the completion is the last one of another weight; in a response
  that is trained whole (a pair's, a ``completion``) it makes the row bad.
- ``prompt_completion``: mlx-lm's ``completions`` and TRL's prompt-completion
  rows, ``prompt``/``completion`` strings (a transcript prompt read as one, as in ``standard``) or message
  lists (a text beside messages: one turn). With a boolean ``label`` (TRL's
  unpaired KTO rows) a ``false`` row is dropped (``label false``), one written as text, 1/0 or null
  is a bad row, and a pairwise objective refuses the file (:data:`UNPAIRED`).
- ``text``: mlx-lm's ``text`` rows and TRL's language-modeling rows, ``{"text": ...}``:
  every token is a completion token (no template).

``objective.kind: sft`` trains a preference row's chosen side only (``pairwise`` False in
:func:`parse_rows`): the row becomes one completion, identical sides are kept, and a rejected
side that makes the row bad (missing, empty, unreadable, sharing no prompt with the chosen side)
costs nothing: the row is read with its chosen side in the rejected side's place.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from typing import Optional, Union

from ..errors import BadRow, DataError
from ..types import BadRowReport, Row

FORMATS = ("standard", "conversational", "transcript", "openai", "sharegpt", "mapped", "messages",
           "prompt_completion", "text")
SFT_FORMATS = ("messages", "prompt_completion", "text")  # rows with one completion (Row.rejected None)
FIELD_KEYS = ("prompt", "chosen", "rejected", "system")
SIDE_KEYS = {"openai": ("preferred_output", "non_preferred_output")}  # (chosen, rejected) keys not so named
SFT_FIELD_KEYS = ("completion", "messages", "text")  # data.fields for SFT rows (mlx-lm's prompt/completion_feature)
DETECT_ROWS = 64  # format: auto votes over this many objects from the top of a file
# Anthropic HH turn markers; a transcript prompt ends right after ASSISTANT_MARKER.
HUMAN_MARKER = "\n\nHuman:"
ASSISTANT_MARKER = "\n\nAssistant:"
# How to write data.fields, shown in error messages (README "Preference data" says the same).
FIELDS_SYNTAX = ("e.g. --data.fields '{prompt: question, chosen: response_j, rejected: response_k}' "
                 "on the command line, or the same mapping under data: fields: in YAML")
# mlx-lm, TRL and OpenAI rows may carry tools, which templates render; dtrain renders messages' text only.
NO_TOOLS = "{what}: rows with tools are not read (dtrain renders the messages' role and content only)"
TOOL_KEYS = {"tools": "tool", "functions": "function"}  # tool definitions (functions: OpenAI's older name)
TOOL_CALL_KEYS = ("tool_calls", "function_call")  # a message's calls (function_call: OpenAI's older one)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # a message's reasoning, apart from its content
# TRL's unpaired preference rows (KTOTrainer): one completion judged desirable (label true) or not (false)
UNPAIRED = ("{source}: unpaired preference rows (KTO-style: prompt, completion and a true/false 'label') cannot train "
            "a pairwise objective (orpo, dpo, simpo), which needs a chosen and a rejected response per prompt; pair "
            "the completions into chosen/rejected rows, or set objective.kind: sft to train the label true ones")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "model": "assistant", "system": "system"}


def json_kind(value) -> str:
    """The JSON type of a parsed value, as messages name it: ``object``, ``array``, ``string``, ``number``,
    ``boolean`` or ``null`` (a Python type name for anything else)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    kinds = ((dict, "object"), (list, "array"), (str, "string"), ((int, float), "number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def detect_format(obj: dict, fields: Optional[dict]) -> Optional[str]:
    """The format whose keys ``obj`` has, or None (see module docstring). A key whose value is null counts only when
    the others name no format: a table's empty cell is a key its JSON row lacks (a file of two formats written with
    pandas or datasets has every column in every row)."""
    if fields:
        return "mapped"
    return _keys_format({k: v for k, v in obj.items() if v is not None}) or _keys_format(obj)


def _keys_format(obj: dict) -> Optional[str]:
    if "preferred_output" in obj and "non_preferred_output" in obj:
        return "openai"
    if "conversations" in obj and "chosen" in obj:
        return "sharegpt"
    if "chosen" in obj and "rejected" in obj:
        if isinstance(obj.get("prompt"), list) or any(isinstance(obj[k], (list, dict)) for k in ("chosen", "rejected")):
            return "conversational"
        return "standard" if "prompt" in obj else "transcript"
    if "messages" in obj or "conversations" in obj:  # conversations: ShareGPT's SFT rows
        return "messages"
    if "prompt" in obj and "completion" in obj:
        return "prompt_completion"
    if "text" in obj:
        return "text"
    return None


def rows_under(obj, path: str) -> str:
    """What to say of a file that is one JSON object holding the rows under a key (``{"data": [rows]}``), or "":
    the key's list of objects, when they are rows of a known format or the key is the object's only one and
    they are not messages (one row's turns: ``role``/``content``, ShareGPT's ``from``/``value``)."""
    if not isinstance(obj, dict):
        return ""
    key = next((k for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)
                and (detect_format(v[0], None) or len(obj) == 1 and not
                     all({"role", "content"} <= set(x) or {"from", "value"} <= set(x) for x in v))), None)
    if key is None:
        return ""
    jq = f", e.g. jq -c '.{key}[]' {path}" if key.isidentifier() else ""
    return (f"one JSON object holding {len(obj[key])} rows under {key!r}; dtrain reads a JSON array of rows or one "
            f"row per line (JSONL): write that list as the file{jq}")


def detect_items_format(items: list, fields: Optional[dict], where: str) -> str:
    """The format most of the first :data:`DETECT_ROWS` objects of ``items`` have (the first seen wins a tie).

    ``items`` is ``[(source, obj_or_BadRow)]``; rows of other formats are later
    reported one by one as bad rows.

    Raises:
        DataError: no items, no item is an object, or none of those objects has a known format
            (naming the first one's ``file:line`` and keys).
    """
    if not items:
        raise DataError(f"{where}: no rows")
    objs = [(src, o) for src, o in items if isinstance(o, dict)][:DETECT_ROWS]
    if not objs:
        kinds = sorted({json_kind(o) for _, o in items if not isinstance(o, BadRow)})
        src, first = items[0]  # every row a bad row: JSON, but too deep, too long, a key twice, ...
        what = f"no row is a JSON object (rows are: {', '.join(kinds)})" if kinds else \
            f"no row can be read (first: {src}: {first})"
        raise DataError(f"{where}: {what}; expected one object per line in one of the formats {', '.join(FORMATS)}")
    votes = Counter(f for f in (detect_format(o, fields) for _, o in objs) if f is not None)
    if not votes:
        src, first = objs[0]
        held = rows_under(first, where) if len(items) == 1 else ""
        if held:
            raise DataError(f"{src}: {held}")
        raise DataError(f"{src}: unknown row format (keys of the first row: {sorted(first)}); none of the first "
                        f"{len(objs)} rows is in one of the formats {', '.join(FORMATS)} -- set data.format, or "
                        f"data.fields to map your column names ({FIELDS_SYNTAX})")
    return votes.most_common(1)[0][0]  # most_common keeps first-seen order among equal counts


def fields_problem(fields: dict) -> Optional[str]:
    """What makes a ``data.fields`` mapping unusable, or None: a key that is not one of :data:`FIELD_KEYS` and
    :data:`SFT_FIELD_KEYS`, both a pair's and an SFT row's columns mapped, a column name that is not text."""
    unknown = sorted(set(fields) - set(FIELD_KEYS + SFT_FIELD_KEYS), key=str)
    if unknown:
        return (f"data.fields: unknown key {unknown[0]!r} (known: {', '.join(FIELD_KEYS + SFT_FIELD_KEYS)}); "
                f"{FIELDS_SYNTAX}")
    sft = sorted(set(fields) & set(SFT_FIELD_KEYS))
    if len(sft) > 1 or (sft and {"chosen", "rejected"} & set(fields)):
        named = sorted(set(fields) & {"chosen", "rejected", *SFT_FIELD_KEYS})
        return (f"data.fields maps {', '.join(named)}: a row is a preference pair (chosen, rejected) or one SFT "
                f"completion (completion, messages or text), not both")
    odd = next((k for k, v in fields.items() if not isinstance(v, str)), None)
    if odd is not None:
        return f"data.fields.{odd}: expected a column name, got {fields[odd]!r}; {FIELDS_SYNTAX}"
    return None


def parse_rows(items: list, cfg, where: str, pairwise: bool = True) -> tuple:
    """Normalise parsed objects to rows; returns ``(rows, BadRowReport)``.

    ``items`` is ``[(source, obj_or_BadRow)]`` as from :func:`.sources.read_items`.
    ``pairwise``: the objective trains both sides (every kind but ``sft``); False reads each
    preference row as its chosen side (see the module docstring).

    Raises:
        DataError: ``format: auto`` and no known format (:func:`detect_items_format`),
            or ``data.fields`` that :func:`fields_problem` refuses; ``pairwise`` and
            an unpaired (KTO) row (:data:`UNPAIRED`, naming its ``file:line``).
    """
    fields = cfg.fields or None
    if fields and (problem := fields_problem(fields)):
        raise DataError(problem)
    fmt = cfg.format
    if fields and fmt in ("openai", "sharegpt"):
        raise DataError(f"data.fields renames flat columns; it does not apply to data.format: {fmt}")
    if fmt == "auto":
        fmt = detect_items_format(items, fields, where)
    report, rows = BadRowReport(rows_read=len(items)), []
    for source, obj in items:
        try:
            if isinstance(obj, BadRow):
                raise obj
            if not isinstance(obj, dict):
                raise BadRow(f"expected a JSON object, got {json_kind(obj)}")
            _check_utf8(obj)
            inp = obj.get("input")
            for key, what in TOOL_KEYS.items():
                if _has_tools(obj.get(key), key) or (isinstance(inp, dict) and _has_tools(inp.get(key), key)):
                    raise BadRow(NO_TOOLS.format(what=f"{key!r} ({what} definitions)"))
            row = _parse(obj, fmt, fields, pairwise)
            row = dataclasses.replace(row, prompt=_unweighted(row.prompt),
                                      rejected_prompt=_unweighted(row.rejected_prompt))
            if row.rejected is None and row.prompt is not None and "label" in obj and _is_label(obj["label"]):
                if pairwise:  # read as SFT rows, a pairwise objective would only say 'one completion'
                    raise DataError(UNPAIRED.format(source=source))
                if not isinstance(obj["label"], bool):  # read as is, "false" is true: sft would train it
                    shown = "null" if obj["label"] is None else repr(obj["label"])
                    raise BadRow(f"'label' is {shown}, not true or false: an unpaired (KTO-style) row's label is a "
                                 f"JSON boolean")
                if not obj["label"]:  # an undesirable completion: SFT must not learn it
                    report.dropped.append((source, "label false: an undesirable completion (KTO-style row); sft "
                                                   "trains the label true ones"))
                    continue
            if not pairwise:  # SFT: the rejected side is not trained
                row = dataclasses.replace(row, rejected=None, rejected_prompt=None)
            elif row.chosen == row.rejected and row.rejected_prompt is None:  # read well, but no preference signal
                report.dropped.append((source, "same text: chosen and rejected are identical"))
                continue
            rows.append(dataclasses.replace(row, source=source))
        except BadRow as err:
            report.bad.append((source, str(err)))
    return rows, report


def _is_label(value) -> bool:
    """A KTO row's label: true or false, either written as text or as 1/0, or null (a label missing: not true, and not
    to be trained as if it were); another value names something else."""
    if value is None:
        return True
    if isinstance(value, str):
        return value.strip().lower() in ("true", "false")
    return isinstance(value, (int, float)) and value in (0, 1)


def _parse(obj: dict, fmt: str, fields: Optional[dict], pairwise: bool) -> Row:
    """``obj`` read as ``fmt`` (its columns renamed by ``data.fields``); under SFT a bad row is read again with
    its chosen side as the rejected one (when that fails too, its error stands: the chosen side or the prompt
    is at fault, and the rejected side that sft does not need is not blamed). The re-read names the row's
    own columns: a missing rejected one is a bad row too."""
    def parse(o: dict) -> Row:
        return _PARSERS[fmt](_rename(o, fields) if fields and fmt != "mapped" else o, fields)

    try:
        return parse(obj)
    except BadRow:
        if pairwise:
            raise
        chosen, rejected = SIDE_KEYS.get(fmt, ("chosen", "rejected"))
        if fields:
            chosen, rejected = fields.get(chosen, chosen), fields.get(rejected, rejected)
        if chosen not in obj:  # an SFT row, or no chosen side
            raise
        return parse({**obj, rejected: obj[chosen]})


def _has_tools(value, key: str = "tools") -> bool:
    """A non-empty tools or tool_calls value; some hub datasets keep it as JSON text (``"[]"`` is none). A
    ``functions`` column counts only as OpenAI writes it, a list of objects or one object with a ``name`` (a
    code dataset's may list names, or map names to code)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, an integer too long for int(), nested too deep
            return bool(value.strip()) and key != "functions"
    if key == "functions":
        return (isinstance(value, list) and any(isinstance(v, dict) for v in value)
                or isinstance(value, dict) and isinstance(value.get("name"), str))
    return bool(value)


_SURROGATE = re.compile("[\ud800-\udfff]")  # searched in C: a per-character loop was most of the parse time


def undecodable(text: str, pos: int = 0, endpos: Optional[int] = None) -> Optional[BadRow]:
    """A bad row when ``text[pos:endpos]``, decoded with ``errors="surrogateescape"``, holds a byte that is not
    UTF-8 (each one a surrogate U+DC80..U+DCFF), else None."""
    found = _SURROGATE.search(text, pos, len(text) if endpos is None else endpos)
    return None if found is None else BadRow(f"text is not valid UTF-8 (undecodable byte "
                                             f"0x{ord(found.group()) - 0xDC00:02x})")


def _check_utf8(obj) -> None:
    """Surrogates left in a row are JSON escapes (``\\udc80``): the readers report undecodable bytes themselves."""
    found = _SURROGATE.search(json.dumps(obj, ensure_ascii=False))
    if found is not None:
        raise BadRow(f"text is not valid UTF-8 (lone surrogate escape \\u{ord(found.group()):04x})")


def _get(obj: dict, key: str, kind: type, label: Optional[str] = None):
    label = label or key
    if key not in obj:
        raise BadRow(f"missing field {label!r}")
    if obj[key] is None:  # JSON null, or an empty cell of a table (Parquet, Arrow, a dataset)
        raise BadRow(f"field {label!r} is null")
    value = obj[key]
    if not isinstance(value, kind):
        raise BadRow(f"field {label!r} must be {_KIND_NAMES[kind]}, got {json_kind(value)}")
    return value


_KIND_NAMES = {str: "a string", list: "a list of messages", dict: "an object"}


def _system(obj: dict, key: str = "system") -> Optional[str]:
    if obj.get(key) is None:
        return None
    system = _get(obj, key, str)
    # an empty column (Intel/orca_dpo_pairs) is no system message, not an empty one in place of the template's default
    return system if system.strip() else None


def _text_response(value: str, label: str) -> str:
    if not value.strip():
        raise BadRow(f"empty response in {label!r}")
    return value


def _transcript_response(value: str, label: str) -> str:
    """A transcript's response (its later turns read as turns: render.transcript_messages) that ends with the
    model's turn; an empty last ``Assistant:`` turn is a generation prompt, dropped."""
    text = _text_response(value, label).rstrip()
    text = text[: -len(ASSISTANT_MARKER)] if text.endswith(ASSISTANT_MARKER) else text
    if text.rfind(HUMAN_MARKER) > text.rfind(ASSISTANT_MARKER):  # the user's next words, trained as the model's
        raise BadRow(f"{label!r} ends with a {HUMAN_MARKER.strip()!r} turn: a response is the model's turn, and that "
                     f"turn would be trained as its words")
    return value


def _messages(value: list, label: str) -> list:
    out = []
    for i, m in enumerate(value):
        call = next((k for k in TOOL_CALL_KEYS if isinstance(m, dict) and _has_tools(m.get(k))), None)
        if call is not None:
            raise BadRow(NO_TOOLS.format(what=f"{label}[{i}] {call!r}"))
        reasoning = next((k for k in REASONING_KEYS if isinstance(m, dict) and m.get(k)), None)
        if reasoning is not None:  # templates such as Qwen3's render it as a <think> block; dropped, it would not train
            raise BadRow(f"{label}[{i}] {reasoning!r}: messages with a separate reasoning field are not read (dtrain "
                         f"renders the messages' role and content only); write the reasoning into 'content' as the "
                         f"model's chat template would")
        if isinstance(m, dict) and "from" in m and "role" not in m:  # a ShareGPT turn (data.fields renamed its column)
            m = _sharegpt_message(m, f"{label}[{i}]")
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": _text_parts(m["content"], f"{label}[{i}]")}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow(f"{label}[{i}] must be an object with string 'role' and 'content'")
        if not m["role"].strip():  # a template would render it as a header of no one
            raise BadRow(f"{label}[{i}] 'role' is empty: a message names who speaks (user, assistant, system, ...)")
        weight = m.get("weight")  # OpenAI's fine-tuning rows: 0 marks a message not to train on (null: none given)
        if weight is not None and weight not in (0, 1):
            raise BadRow(f"{label}[{i}] 'weight' is {weight!r}: OpenAI's weight is 0 (not trained on) or 1")
        # ShareGPT's speakers under OpenAI's keys ({"role": "gpt"}) name the roles its {from, value} turns do (case
        # and spaces around ignored, as a converter may leave them)
        out.append({"role": _SHAREGPT_ROLES.get(m["role"].strip().lower(), m["role"]), "content": m["content"],
                    **({"weight": 0} if weight == 0 else {})})  # kept for _response and _messages_row, then dropped
    return out


def _unweighted(msgs):
    """Prompt messages without their weights (a prompt is not trained on, whatever its weight); text as it is."""
    return [{"role": m["role"], "content": m["content"]} for m in msgs] if isinstance(msgs, list) else msgs


def _text_parts(parts: list, label: str) -> str:
    """OpenAI-style content parts ``[{"type": "text", "text": ...}]`` as one string, the parts joined as
    chat templates that take parts write them (back to back); any other part is a bad row."""
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else json_kind(part)
            raise BadRow(f"{label} content[{j}] is not a text part ({kind!r}); dtrain trains on text only")
    return "".join(part["text"] for part in parts)


def _response(msgs: list, label: str) -> Union[str, list]:
    """A completion as text when it is one assistant message, else messages (the first the assistant's)."""
    if any(m.get("weight") == 0 for m in msgs):  # trained whole: a message of weight 0 would be trained on
        raise BadRow(f"{label!r} holds a message that has weight 0 (OpenAI's mark for a message not trained on), and "
                     f"a response is trained: remove the message or its weight")
    if not msgs or not any(m["content"].strip() for m in msgs):
        raise BadRow(f"empty response in {label!r}")
    if not any(m["role"] == "assistant" for m in msgs):
        roles = ", ".join(dict.fromkeys(m["role"] for m in msgs))
        raise BadRow(f"{label!r} has no assistant message (roles: {roles}): a response is the model's turn")
    if msgs[0]["role"] != "assistant":  # trained as the model's, the prompt as trained ending in its header
        raise BadRow(f"{label!r} opens with a {msgs[0]['role']!r} message: a response is the model's turn, written "
                     f"after the prompt")
    if msgs[-1]["role"] != "assistant":  # the user's next words, trained as the model's
        raise BadRow(f"{label!r} ends with a {msgs[-1]['role']!r} message: a response is the model's turn, and that "
                     f"message would be trained as its words")
    if len(msgs) == 1:
        return msgs[0]["content"]
    return msgs


def _is_transcript(prompt: str) -> bool:
    """An HH transcript with its prompt apart (Dahoas/full-hh-rlhf): read as its turns, as the same conversation in
    chosen/rejected is."""
    return prompt.lstrip().startswith(HUMAN_MARKER.strip()) and prompt.rstrip().endswith(ASSISTANT_MARKER)


def _standard(obj: dict, fields=None) -> Row:
    prompt = _get(obj, "prompt", str)
    transcript = _is_transcript(prompt)
    response = _transcript_response if transcript else _text_response
    return Row(prompt=prompt, chosen=response(_get(obj, "chosen", str), "chosen"),
               rejected=response(_get(obj, "rejected", str), "rejected"), system=_system(obj), transcript=transcript)


def _turns(obj: dict, key: str, role: str) -> list:
    """``obj[key]``'s messages; a text beside message lists is one ``role`` turn."""
    value = obj.get(key)
    return _messages(_get({key: [{"role": role, "content": value}] if isinstance(value, str) else value}, key, list),
                     key)


def _conversational(obj: dict, fields=None) -> Row:
    # mlx-lm-lora's responses (ORPODataset): one message object, or the messages under "messages"
    obj = {**obj, **{key: obj[key].get("messages", [obj[key]]) for key in ("chosen", "rejected")
                     if isinstance(obj.get(key), dict)}}
    prompt = obj.get("prompt")
    if prompt is None:  # implicit: the prompt is the lists' shared prefix
        chosen, rejected = (_messages(_get(obj, key, list), key) for key in ("chosen", "rejected"))
    else:  # beside a prompt, a text response is one assistant turn
        chosen, rejected = (_turns(obj, key, "assistant") for key in ("chosen", "rejected"))
    if isinstance(prompt, str) and chosen[:1] and rejected[:1] and "assistant" not in (
            chosen[0]["role"], rejected[0]["role"]):
        prompt = None  # a text copy of a prompt the messages hold (TRL maybe_extract_prompt)
    if prompt is not None:
        prompt = _turns(obj, "prompt", "user")
        held = chosen[:len(prompt)] == prompt and rejected[:len(prompt)] == prompt
        # an empty prompt before the model's replies is their prompt, not lists that hold the conversation
        replies = not prompt and any(side[:1] and side[0]["role"] == "assistant" for side in (chosen, rejected))
        if not held or replies:
            return Row(prompt, _response(chosen, "chosen"), _response(rejected, "rejected"), _system(obj))
        # else both sides open with the prompt: they hold the whole conversation (TRL refuses the row)
    return _implicit_conversation(chosen, rejected, _system(obj))


def _implicit_conversation(chosen: list, rejected: list, system: Optional[str]) -> Row:
    """Prompt = longest common message prefix (TRL ``extract_prompt``).

    When the sides differ before an assistant turn (e.g. different user
    follow-ups), each side's prompt runs up to its first assistant message after
    the common prefix, and the row carries ``rejected_prompt``.
    """
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:  # the last message is a response
        n += 1
    sides = []
    for msgs, label in ((chosen, "chosen"), (rejected, "rejected")):
        k = next((i for i in range(n, len(msgs)) if msgs[i]["role"] == "assistant"), None)
        if k is None:
            raise BadRow(f"empty response in {label!r}: no assistant message after the shared prompt")
        sides.append((msgs[:k], _response(msgs[k:], label)))
    (cp, c), (rp, r) = sides
    if not cp and (cp, c) != (rp, r):  # one conversation twice (sft's chosen side) is a messages row
        raise BadRow("no shared prompt: 'chosen' and 'rejected' start with an assistant message")
    return Row(cp, c, r, system, rejected_prompt=None if rp == cp else rp)


def _transcript(obj: dict, fields=None) -> Row:
    chosen, rejected = _get(obj, "chosen", str), _get(obj, "rejected", str)
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    # The last Assistant marker lying wholly inside the common prefix.
    cut = chosen.rfind(ASSISTANT_MARKER, 0, n)
    if cut < 0:
        # e.g. Intel/orca_dpo_pairs' question/chosen/rejected: without a prompt key the row reads as a transcript
        others = [k for k, v in obj.items() if k not in FIELD_KEYS and isinstance(v, str)]
        if isinstance(obj.get("prompt"), str):  # read by the standard format, not this one (data.format: transcript)
            hint = ("; data.format: transcript reads chosen and rejected whole, and this row has a 'prompt' column: "
                    "set data.format: auto (or standard)")
        elif others:
            hint = f"; name its prompt column with data.fields: {{prompt: COLUMN}} (text columns: {', '.join(others)})"
        else:  # e.g. TRL's implicit-prompt text rows
            hint = (f"; rows of chosen and rejected text alone are read as HH transcripts "
                    f"({(HUMAN_MARKER + ' ... ' + ASSISTANT_MARKER + ' ...')!r}): give the prompt a 'prompt' column")
        raise BadRow(f"no shared prompt ending at an {ASSISTANT_MARKER.strip()!r} turn marker{hint}")
    end = cut + len(ASSISTANT_MARKER)
    return Row(chosen[:end], _transcript_response(chosen[end:], "chosen"),
               _transcript_response(rejected[end:], "rejected"), _system(obj), transcript=True)


def _openai(obj: dict, fields=None) -> Row:
    inp = _get(obj, "input", dict)
    prompt = _messages(_get(inp, "messages", list, "input.messages"), "input.messages")
    outs = []
    for key in ("preferred_output", "non_preferred_output"):
        msgs = _messages(_get(obj, key, list), key)
        if len(msgs) != 1 or msgs[0]["role"] != "assistant":
            got = f"a {msgs[0]['role']!r} message" if len(msgs) == 1 else f"{len(msgs)} messages"
            raise BadRow(f"field {key!r} must hold one assistant message, got {got}")
        outs.append(_response(msgs, key))
    return Row(prompt, outs[0], outs[1], _system(obj))


def _sharegpt(obj: dict, fields=None) -> Row:
    turns = _get(obj, "conversations", list)
    prompt = _messages([_sharegpt_message(t, f"conversations[{i}]") for i, t in enumerate(turns)], "conversations")
    outs = []
    for key in ("chosen", "rejected"):
        value = obj.get(key)
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        outs.append(_response(_messages([_sharegpt_message(_get({key: value}, key, dict), key)], key), key))
    return Row(prompt, outs[0], outs[1], _system(obj))


def _sharegpt_message(turn, label: str) -> dict:
    if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
        raise BadRow(f"{label} must be an object with string 'from' and 'value'")
    role = _SHAREGPT_ROLES.get(turn["from"].strip().lower())
    if role is None:
        raise BadRow(f"{label}: unknown speaker {turn['from']!r} (known: {', '.join(_SHAREGPT_ROLES)})")
    # OpenAI's per-message weight, checked by _messages as on a {role, content} message
    return {"role": role, "content": turn["value"], **({"weight": turn["weight"]} if "weight" in turn else {})}


def _rename(obj: dict, fields: dict) -> dict:
    """Columns renamed by ``data.fields``; unmapped keys keep their names. A column the mapping
    names must be there (a misspelt ``system`` column would otherwise drop every system message), and
    so must a pair's chosen and rejected, or an SFT row's completion (and its prompt)."""
    sft = next((k for k in SFT_FIELD_KEYS if k in fields), None)
    if sft is None and not {"chosen", "rejected"} & (set(fields) | set(obj)):  # an SFT row's own column kept
        sft = next((k for k in SFT_FIELD_KEYS if k in obj), None)
    keys = ("prompt", "system", sft) if sft else FIELD_KEYS
    needed = {"completion": ("completion", "prompt")}.get(sft, (sft,)) if sft else ("chosen", "rejected")
    renamed = {}
    for key in keys:
        src = fields.get(key, key)
        if src in obj:
            renamed[key] = obj[src]
        elif key in needed or key in fields:
            columns = ", ".join(list(obj)[:12]) + (", ..." if len(obj) > 12 else "")
            raise BadRow(f"missing field {src!r} (data.fields.{key}; the row's columns: {columns or 'none'})")
    return renamed


def _mapped(obj: dict, fields: Optional[dict]) -> Row:
    """Rename columns by ``data.fields``, then read by the value types."""
    renamed = _rename(obj, fields or {})
    fmt = detect_format(renamed, None) or "standard"
    if fmt == "transcript":  # no prompt mapped: its hint names the columns left unmapped, as an unmapped row's does
        mapped = set((fields or {}).values())
        renamed = {**{k: v for k, v in obj.items() if k not in mapped}, **renamed}
    return _PARSERS[fmt](renamed, None)


def _messages_row(obj: dict, fields=None) -> Row:
    key = "conversations" if obj.get("conversations") is not None and obj.get("messages") is None else "messages"
    turns = _get(obj, key, list)
    msgs = _messages(turns if key == "messages" else [_sharegpt_message(t, f"{key}[{i}]")
                                                      for i, t in enumerate(turns)], key)
    if not msgs or msgs[-1]["role"] != "assistant":
        raise BadRow(f"{key!r} must end with an assistant message (the completion)")
    # the completion is the last assistant message not of weight 0 (OpenAI's); what follows it is not trained either
    k = next((i for i in reversed(range(len(msgs))) if msgs[i]["role"] == "assistant" and msgs[i].get("weight") != 0),
             None)
    if k is None:
        raise BadRow(f"{key!r} has no assistant message to train on: every one has weight 0 (OpenAI's mark for a "
                     f"message not trained on)")
    return Row(msgs[:k], _response(msgs[k:k + 1], key), None, _system(obj))


def _prompt_completion(obj: dict, fields=None) -> Row:
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        c = _turns(obj, "completion", "assistant")
        return Row(_turns(obj, "prompt", "user"), _response(c, "completion"), None, _system(obj))
    prompt = _get(obj, "prompt", str)
    transcript = _is_transcript(prompt)
    response = _transcript_response if transcript else _text_response
    return Row(prompt, response(_get(obj, "completion", str), "completion"), None, _system(obj), transcript=transcript)


def _text(obj: dict, fields=None) -> Row:
    return Row(None, _text_response(_get(obj, "text", str), "text"), None)


_PARSERS = {"standard": _standard, "conversational": _conversational, "transcript": _transcript,
            "openai": _openai, "sharegpt": _sharegpt, "mapped": _mapped, "messages": _messages_row,
            "prompt_completion": _prompt_completion, "text": _text}
