"""The Ollama Modelfile's quoting (dtrain/models/modelfile.py), read back by a model of Ollama's parser.

``ollama_read`` restates the behaviour of ollama/ollama ``parser/parser.go`` (``ParseFile``,
``unquote``) for the commands dtrain writes: a value runs to the first line end at which the
text so far, trimmed, is complete (``\"\"\"...\"\"\"`` of 6+ characters, ``"..."`` of 2+, or not
quoted), the quotes are cut off and nothing is unescaped; runes Go's ``strconv.IsPrint`` rejects
are dropped, except tab and the line ends inside an open quote.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtrain.models.modelfile import ROLES, ChatParts, go_template, modelfile

COMMANDS = ("from", "template", "system", "parameter")


def _unquote(value: str):
    """``(ok, text)``: a value is complete when its quotes close (Ollama's ``unquote``)."""
    for q, least in (('"""', 6), ('"', 2)):
        if value.startswith(q):
            return (True, value[len(q):-len(q)]) if len(value) >= least and value.endswith(q) else (False, "")
    return True, value


def ollama_read(text: str) -> list:
    """``[(command, value)]`` as Ollama's Modelfile parser reads ``text`` (PARAMETER as its name).

    Raises:
        ValueError: the parser's errors (an unknown command, a quote never closed).
    """
    out, state, buf, name = [], "nil", "", ""
    for ch in text:
        if state == "comment":
            state = "nil" if ch in "\r\n" else "comment"
        elif state == "nil":
            if ch == "#":
                state = "comment"
            elif ch not in " \t\r\n":
                state, buf = "name", ch
        elif state in ("name", "parameter"):
            if ch.isascii() and (ch.isalpha() or (state == "parameter" and (ch.isdigit() or ch == "_"))):
                buf += ch
            elif ch in " \t" and state == "name":
                if buf.lower() not in COMMANDS:
                    raise ValueError(f"unknown command {buf!r}")
                state, name, buf = ("parameter" if buf.lower() == "parameter" else "value"), buf.lower(), ""
            elif ch in " \t":
                state, name, buf = "value", buf, ""
            else:
                raise ValueError(f"bad character {ch!r} in {state}")
        elif ch in "\r\n":
            ok, value = _unquote(buf.strip(" \t\r\n"))
            if ok:
                out.append((name, value))
                state, buf = "nil", ""
            else:
                buf += ch
        elif ch in " \t" or ch.isprintable():
            buf += ch
    if state == "value":
        ok, value = _unquote(buf.strip(" \t\r\n"))
        if not ok:
            raise ValueError("unexpected end of file in a quoted value")
        out.append((name, value))
    elif state not in ("nil", "comment"):
        raise ValueError("unexpected end of file")
    return out


def read_or_none(text: str):
    try:
        return ollama_read(text)
    except ValueError:
        return None


def go_literals(template: str) -> list:
    """The texts of the template's ``{{ "..." }}`` actions, as Go reads its string constants."""
    literals = re.findall(r'\{\{ ("(?:[^"\\]|\\.)*") \}\}', template)
    wide = lambda m: chr(int(m.group(1), 16))  # noqa: E731  Go's \U; json.loads reads the rest alike
    return [json.loads(re.sub(r"\\U([0-9a-fA-F]{8})", wide, lit)) for lit in literals]


def test_the_parser_model_reads_what_ollama_documents():
    assert ollama_read('FROM ./m.gguf\nPARAMETER stop "<|im_end|>"\nPARAMETER stop </s>\n') == [
        ("from", "./m.gguf"), ("stop", "<|im_end|>"), ("stop", "</s>")]
    assert ollama_read('# c\nTEMPLATE """a\n"b"\n"""\nSYSTEM "x\ny"\n') == [("template", 'a\n"b"\n'),
                                                                          ("system", "x\ny")]
    assert ollama_read('PARAMETER stop "a\\"b"\n') == [("stop", 'a\\"b')]  # no unescaping


def test_stop_texts_with_quotes_and_backslashes_reach_ollama_as_they_are():
    """JSON escapes were written (``"a\\"b\\\\c"``), which Ollama reads with the backslashes in."""
    notes = []
    text = modelfile("m.gguf", None, ['a"b\\c', "</s>", 'x"\ny', "\u2063"], "n", notes.append)
    assert ollama_read(text) == [("from", "./m.gguf"), ("stop", 'a"b\\c'), ("stop", "</s>"), ("stop", 'x"\ny')]
    assert 'PARAMETER stop "a"b\\c"\n' in text and 'PARAMETER stop """x"\ny"""\n' in text
    assert notes == ["Modelfile: PARAMETER stop '\\u2063' left out: Ollama's Modelfile parser drops the character "
                     "U+2063, so no quoting gives it back"]
    assert "# PARAMETER stop '\\u2063' left out" in text


STOP_CHARS = st.sampled_from(['"', "\\", "\n", "\r", "\t", " ", "a", "<", "|", "\x00", "\x1b", "\x7f", "\u00a0",
                              "\u2063", "\u2028", "é", "\U0001f600"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(STOP_CHARS, min_size=1, max_size=8), min_size=1, max_size=4))
def test_every_stop_is_read_back_exactly_or_left_out_with_a_notice(stops):
    notes = []
    text = modelfile("m.gguf", None, stops, "n", notes.append)
    kept = [v for k, v in ollama_read(text) if k == "stop"]
    left_out = [s for s in stops if s not in kept]
    assert kept == [s for s in stops if s not in left_out]
    assert len(notes) == len(left_out)
    for stop, note in zip(left_out, notes):
        assert note.startswith(f"Modelfile: PARAMETER stop {stop!r} left out: ")
        for q in ('"', '"""'):  # neither quoting carries it
            assert read_or_none(f"PARAMETER stop {q}{stop}{q}\n") != [("stop", stop)]


PIECE = st.lists(st.sampled_from(['"', '"""', "\\", "\n", "\t", " ", "<|x|>", "}}", "{{", "\x00", "\x7f", "\u00a0",
                                  "\u2063", "é", "\U0001f600"]), max_size=6).map("".join)


@settings(max_examples=200, deadline=None)
@given(st.tuples(*[PIECE] * 8), st.one_of(st.none(), PIECE))
def test_template_and_system_are_read_back_exactly(pieces, default_system):
    """Every literal piece of the template reaches Ollama's Go template as written, also characters Ollama's
    parser drops (written as Go escapes) and quotes; the default system message is written by the template
    too; SYSTEM is the default system text or left out."""
    open_, gen, *rest = pieces
    parts = ChatParts(open_, dict(zip(ROLES, rest[:3])), dict(zip(ROLES, rest[3:])), gen, default_system)
    notes = []
    read = dict(ollama_read(modelfile("m.gguf", parts, [], "n", notes.append)))
    assert read["template"] == go_template(parts)
    default = [] if default_system is None else [parts.before["system"] + default_system + parts.after["system"]]
    want = [open_] + default + [p for r in ROLES for p in (parts.before[r], parts.after[r])] + [gen]
    assert go_literals(read["template"]) == [p for p in want if p]
    if "system" in read:
        assert read["system"] == default_system and not notes
    elif default_system:  # an empty one is not written: Ollama adds SYSTEM only when it is not empty
        assert len(notes) == 1 and notes[0].startswith(f"Modelfile: SYSTEM {default_system!r} left out: ")
        for q in ('"', '"""'):  # neither quoting carries it
            assert read_or_none(f"SYSTEM {q}{default_system}{q}\n") != [("system", default_system)]


def test_a_system_text_ollama_cannot_quote_is_left_out_with_a_notice():
    parts = ChatParts("", dict.fromkeys(ROLES, ""), dict.fromkeys(ROLES, "\n"), "", 'say """hi"""\nthen \u2063')
    notes = []
    text = modelfile("m.gguf", parts, [], "n", notes.append)
    assert [k for k, _ in ollama_read(text)] == ["from", "template"]
    assert notes == ["Modelfile: SYSTEM 'say \"\"\"hi\"\"\"\\nthen \\u2063' left out: Ollama's Modelfile parser "
                     "drops the character U+2063, so no quoting gives it back"]


@pytest.mark.parametrize("stop, written", [('""\n"', '"""""\n""""'), ('"a"\nb', '""""a"\nb"""'),
                                          ('say """\nbye', None)])
def test_a_quote_ending_a_line_needs_the_other_quoting_or_leaves_the_stop_out(stop, written):
    """``""`` opens ``\"\"\"`` for Ollama, and a line ending in the closing quote ends the value there."""
    notes = []
    text = modelfile("m.gguf", None, [stop], "n", notes.append)
    if written is None:
        assert notes == [f"Modelfile: PARAMETER stop {stop!r} left out: Ollama's Modelfile parser cannot quote it "
                         '(a line of it ends with """)'] and "PARAMETER stop \"" not in text
    else:
        assert f"PARAMETER stop {written}\n" in text and not notes
    assert ollama_read(text)[1:] == ([] if written is None else [("stop", stop)])


def test_a_name_with_line_breaks_stays_in_its_comment():
    """The first line comments the model's name (the base GGUF's general.name + the adapter folder): a line break
    in it ended the comment, and Ollama read the rest as a command ('+' is no command; 'FROM x' a second FROM)."""
    text = modelfile("m.gguf", None, ["</s>"], "Base\r\nFROM x + run/adapters")
    assert ollama_read(text) == [("from", "./m.gguf"), ("stop", "</s>")]
    assert text.splitlines()[0] == "# Base  FROM x + run/adapters: `ollama create NAME -f Modelfile` in this folder"
