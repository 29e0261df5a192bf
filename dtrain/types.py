"""Containers passed between the data, engine and trainer layers, and the check on pairs both the
data check and training apply (pairwise objectives refuse rows with one completion)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import DataError


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
