"""Containers passed between the data, engine and trainer layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TokenizedPair:
    """One preference pair after rendering and tokenization.

    Token ids are plain Python lists (lengths P, Rc, Rr). ``prompt`` carries the
    chat template and BOS (never doubled); ``chosen`` and ``rejected`` carry the
    response tokens including the end-of-turn token when ``append_eos`` is on.
    Prompt and responses are tokenized separately, so no token straddles the
    boundary. ``rejected_prompt`` is set only when the rejected side renders a
    different prompt (e.g. conversational rows whose histories differ); engines
    then run that pair as two separate sequences. ``source`` is ``file:line``.
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
