"""Generated demo preference pairs with a preference that can be checked.

Each prompt is a small arithmetic question ("What is 7 plus 5?"). The chosen
response gives the correct result in a fixed format a chat model does not
produce by itself (``ANSWER: 12``); the rejected response is a natural sentence
with a wrong number ("The answer is 13."). A base instruct model prefers the
natural sentence (higher mean log-prob per token), so held-out accuracy starts
low, and the fixed format is learnt within a few dozen ORPO steps. Sequences are
short: with SmolLM2's ChatML template a pair is about 50 tokens per side.

Rows use the TRL standard format, so they go through the same rendering path as
files do. Generation uses :class:`random.Random` seeded with ``seed``, whose
integer seeding is stable across Python versions.
"""

from __future__ import annotations

import random
import re

_PROMPTS = {
    "+": ("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
          "How much is {a} plus {b}?", "What do you get when you add {a} and {b}?"),
    "-": ("What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.", "How much is {a} minus {b}?"),
    "*": ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.", "How much is {a} times {b}?"),
}
_REJECTED = ("The answer is {w}.", "It is {w}.", "{a} {op} {b} = {w}.", "That would be {w}.",
             "I think the result is {w}.", "Sure! The answer is {w}.")
_OPS = {"+": ("+", "plus", "add"), "-": ("-", "minus"), "*": ("*", "times", "multiply")}
CHOSEN_FORMAT = "ANSWER: {answer}"


def _operands(rng: random.Random, op: str) -> tuple:
    if op == "+":
        return rng.randint(2, 60), rng.randint(2, 60)
    if op == "-":
        a = rng.randint(10, 90)
        return a, rng.randint(1, a)
    return rng.randint(2, 12), rng.randint(2, 12)


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def demo_pairs(n: int, seed: int) -> list:
    """``n`` rows ``{prompt, chosen, rejected}`` (TRL standard format), fixed by ``seed``.

    The same ``(n, seed)`` always gives the same rows, and the first ``k`` rows of
    ``demo_pairs(n, seed)`` equal ``demo_pairs(k, seed)``.
    """
    rng, rows = random.Random(seed), []
    for _ in range(n):
        op = rng.choice(tuple(_PROMPTS))
        a, b = _operands(rng, op)
        answer = _apply(op, a, b)
        wrong = answer + rng.choice((-3, -2, -1, 1, 2, 3))
        wrong = wrong if wrong >= 0 else answer + 1
        prompt = rng.choice(_PROMPTS[op]).format(a=a, b=b)
        rejected = rng.choice(_REJECTED).format(a=a, b=b, op=op, w=wrong)
        rows.append({"prompt": prompt, "chosen": CHOSEN_FORMAT.format(answer=answer), "rejected": rejected})
    return rows


def demo_answer(prompt: str) -> int:
    """The correct result of a demo prompt.

    Raises:
        ValueError: ``prompt`` is not a demo question.
    """
    nums = [int(x) for x in re.findall(r"\d+", prompt)]
    words = prompt.lower()
    for op, keys in _OPS.items():
        if len(nums) == 2 and any(re.search(rf"(^|\s){re.escape(k)}(\s|$)", words) for k in keys):
            return _apply(op, *nums)
    raise ValueError(f"not a demo prompt: {prompt!r}")


def is_preferred_response(prompt: str, response: str) -> bool:
    """True when ``response`` states the correct result in the chosen format."""
    return response.strip() == CHOSEN_FORMAT.format(answer=demo_answer(prompt))
