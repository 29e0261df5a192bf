"""User-facing notices: the one way dtrain tells the user something that is not an error.

Code with something to say takes a ``report`` callable (None: silent) and never prints, so the
caller decides who speaks: a run passes :func:`for_rank` of its group, :func:`notice` on rank 0
and None elsewhere, so each notice is shown once.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional


def notice(message: str) -> None:
    """Show ``message`` as one line on stderr, above the progress bars when there are any
    (``tqdm.write`` clears them, prints and draws them again)."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


def for_rank(is_main: bool) -> Optional[Callable[[str], None]]:
    """:func:`notice` on rank 0 (``is_main``), None (silent) on the other ranks."""
    return notice if is_main else None
