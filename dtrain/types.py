"""Containers passed between the data, engine and trainer layers (a row before rendering, the bad-row report,
the tokenized pair), and the checks on pairs both the
data check and training apply (pairwise objectives refuse rows with one completion; no token id past the model's
vocabulary)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

from .errors import DataError


@dataclass(frozen=True)
class Row:
    """One preference pair before rendering.

    ``prompt`` is plain text (str) or messages ``[{role, content}]``. ``chosen``
    and ``rejected`` are the response text (str) or, for multi-message
    completions, the messages that follow the prompt. ``rejected_prompt`` is set
    (messages) only when the rejected side has a different history.
    ``transcript`` marks a prompt written with Human:/Assistant: markers.
    ``rejected`` None: an SFT row (one completion); ``prompt`` None: a ``text``
    row, whose ``chosen`` is the whole text.
    ``source`` is ``file:line`` (JSON arrays: ``file:line[index]``).
    """

    prompt: Union[str, list, None]
    chosen: Union[str, list]
    rejected: Union[str, list, None]
    system: Optional[str] = None
    source: str = ""
    rejected_prompt: Optional[list] = None
    transcript: bool = False


@dataclass
class BadRowReport:
    """Rows that were skipped or dropped, with ``(source, reason)`` for each.

    ``bad``: rows that could not be read or rendered (invalid JSON, missing
    fields, a template that fails, ...); ``data.on_bad_row: error`` stops on them.
    ``dropped``: pairs without preference signal or room, found after rendering
    and truncation; each reason starts with its kind (``"same ids: ..."``,
    ``"empty prompt: ..."``, ``"empty response: ..."``, ``"no room: ..."``,
    ``"prompt too long: ..."``; under SFT ``"label false: ..."``, a KTO row's undesirable completion).
    ``truncated``: pairs whose prompt or a response was shortened;
    ``prompt_cut_fits``: of those, prompts cut to ``max_prompt_length`` although
    prompt + response would fit ``max_length``.
    ``control_text``: ``(source, text)`` of kept rows whose messages hold
    control-token text, tokenized as plain text.
    ``template_dropped``: ``(source, text)`` of kept rows whose response the chat template renders without
    some of its text (DeepSeek-R1's drops the reasoning up to ``</think>``), with the first text it drops;
    whitespace it trims is not counted.
    ``rows_read``: rows seen in the input (good and bad).
    """

    rows_read: int = 0
    bad: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    truncated: int = 0
    prompt_cut_fits: int = 0
    control_text: list = field(default_factory=list)
    template_dropped: list = field(default_factory=list)

    def merge(self, other: "BadRowReport") -> "BadRowReport":
        """A new report holding both reports' counts and entries."""
        return BadRowReport(self.rows_read + other.rows_read, self.bad + other.bad, self.dropped + other.dropped,
                            self.truncated + other.truncated, self.prompt_cut_fits + other.prompt_cut_fits,
                            self.control_text + other.control_text, self.template_dropped + other.template_dropped)

    def dropped_kinds(self) -> str:
        """``"2 same ids, 1 label false"``: the dropped rows counted by kind, first seen first."""
        kinds = Counter(reason.split(":", 1)[0] for _, reason in self.dropped)
        return ", ".join(f"{n} {kind}" for kind, n in kinds.items())

    def summary(self, limit: int = 5, bad: str = "skipped (bad rows)", noun: str = "pair") -> str:
        """Readable lines: counts, then the first ``limit`` entries of each kind (``bad``: what bad rows
        are called; a run that stops at one skips none; ``noun``: what an example is, sft's row or a pair)."""
        lines = []
        for what, entries in ((bad, self.bad), ("dropped", self.dropped)):
            if not entries:
                continue
            if entries is self.dropped:
                what += f" ({self.dropped_kinds()})"
            lines.append(f"{len(entries)} of {self.rows_read} rows {what}:")
            lines += [f"  {src}: {reason}" for src, reason in entries[:limit]]
            if len(entries) > limit:
                lines.append(f"  ... and {len(entries) - limit} more")
        if self.truncated:
            lines.append(f"{self.truncated} {noun}{'s' * (self.truncated > 1)} truncated to data.max_prompt_length / "
                         "data.max_length")
        if self.prompt_cut_fits:
            lines.append(f"{self.prompt_cut_fits} of them had the prompt cut to data.max_prompt_length although "
                         "prompt + response fit data.max_length (raise data.max_prompt_length to keep them whole)")
        if self.control_text:
            src, text = self.control_text[0]
            many = len(self.control_text) > 1
            lines.append(f"{len(self.control_text)} {noun}{'s have' if many else ' has'} control-token text in a "
                         f"message, tokenized as plain text (first: {src}: {text!r})")
        if self.template_dropped:  # trained as rendered; the user may not know the template rewrites responses
            src, text = self.template_dropped[0]
            n = len(self.template_dropped)
            shown = text if len(text) <= 40 else text[:40] + "..."
            lines.append(f"the chat template drops text from the responses of {n} {noun}{'s' * (n > 1)}, trained as "
                         f"it renders them (first: {src}: {shown!r})")
        return "\n".join(lines)


@dataclass(frozen=True)
class TokenizedPair:
    """One preference pair after rendering and tokenization.

    Token ids are plain Python lists (lengths P, Rc, Rr). ``prompt`` carries the
    chat template and BOS (never doubled); ``chosen`` and ``rejected`` carry the
    response tokens including the end-of-turn token when ``append_eos`` is on.
    ``prompt + chosen`` are the tokenizer's ids of the whole rendered conversation
    (``data.render``): a token that straddles the prompt/response text belongs to
    the response. ``rejected_prompt`` is set only when the rejected side renders a
    different prompt (e.g. conversational rows whose histories differ); engines
    then run that pair as two separate sequences. ``source`` is ``file:line``.
    An empty ``rejected`` marks an SFT row (a prompt and one completion).
    ``extra``: per-pair inputs an objective needs beyond the tokens (name -> float,
    e.g. a reference model's summed log-probabilities); None for ORPO.
    """

    prompt: list
    chosen: list
    rejected: list
    source: str = ""
    rejected_prompt: Optional[list] = None
    extra: Optional[dict] = None

    @property
    def shared_prompt(self) -> bool:
        return self.rejected_prompt is None

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the pair as two sequences, ``[prompt; chosen]`` and ``[rejected prompt; rejected]`` (an SFT
        row: the first alone), whatever layout an engine runs: what TRL's ``num_tokens`` counts (its attention
        mask). Prefix sharing runs the prompt once (``Layout.input_tokens``); this count does not change with it."""
        rejected = len(self.rejected_prompt or self.prompt) + len(self.rejected) if self.rejected else 0
        return len(self.prompt) + len(self.chosen) + rejected


def example_noun(kind: str) -> str:
    """What messages call one training example of ``objective.kind``: ``row`` for sft (a prompt and one
    completion), else ``pair`` (config keys keep their names: ``train.global_batch_pairs``)."""
    return "row" if kind == "sft" else "pair"


def refuse_single_completions(pairs, kind: str, where: str = "?") -> None:
    """Refuse rows with one completion (empty ``rejected``: SFT rows) under the pairwise objective
    ``kind``, as ``dtrain train`` and ``dtrain data check`` both do.

    Raises:
        DataError: naming the first such row's ``file:line`` (``where`` when it has none).
    """
    single = next((p for p in pairs if not p.rejected), None)
    if single is not None:
        raise DataError(f"{single.source or where}: a row with one completion (no rejected response) cannot train "
                        f"objective.kind {kind}; set objective.kind: sft (configs/sft.yaml), or give "
                        f"preference rows (chosen and rejected)")


def refuse_ids_past_vocabulary(pairs, model) -> None:
    """Refuse ``pairs`` holding a token id that ``model`` has no embedding row for (``>= args.vocab_size``; a model
    that does not give one is not checked), as ``dtrain train`` and ``dtrain data check`` both do: MLX does not
    check a gather's bounds, so such an id would read memory past the embedding and the LM head (PyTorch raises).

    Raises:
        DataError: naming the first such pair's ``file:line``, its largest id and the vocabulary size.
    """
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if not isinstance(size, int):
        return
    for p in pairs:
        top = max(max(ids, default=-1) for ids in (p.prompt, p.chosen, p.rejected, p.rejected_prompt or ()))
        if top >= size:
            raise DataError(f"{p.source or '?'}: token id {top} is past the model's embedding: the model's vocabulary "
                            f"has {size} ids (0-{size - 1}), its tokenizer more; use the tokenizer the model was "
                            "trained with")
