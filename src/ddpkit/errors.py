"""The one base class of the errors ddpkit raises for its user's input.

A :class:`UserError` (bad configuration, a missing file, a checkpoint that
does not verify, an inconsistent launcher environment...) is the user's to
fix: the command prints its message as one line and exits with status 2, and
a failed worker is reported by that line alone. Any other exception,
a ``ValueError`` from torch or from the user's own model included, is a bug
somewhere and is reported with its traceback and rank.

It derives from ``ValueError`` so that code catching ``ValueError`` around
ddpkit calls keeps working. :func:`check_choice`, :func:`check_positive` and :func:`check_finite`
word the commonest checks of an option once, for the core's options
(the Checkpointer's) and the commands' (``ddpkit.keyvalue``) alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar


class UserError(ValueError):
    """Bad input from the user; the message names the problem and the fix in one line."""

    exit_status: ClassVar[int | None] = None
    """The exit status this error asks for (a full disk: 74, a diverged run: 65); None: the usual one."""


def exit_status(error: BaseException, default: int) -> int:
    """``error``'s own exit status (:attr:`UserError.exit_status`), else ``default`` (the caller's usual one)."""
    own = error.exit_status if isinstance(error, UserError) else None
    return default if own is None else own


def check_choice(name: str, value: str, choices: Sequence[str], error: type[UserError] = UserError) -> None:
    """Raise ``error`` unless ``value`` is one of ``choices``: "name='value' is not valid; choose one of: ..."."""
    if value not in choices:
        raise error(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def check_finite(name: str, value: float, error: type[UserError] = UserError) -> None:
    """Raise ``error`` when ``value`` is NaN or infinite: "name=nan is not valid; it must be a finite number"."""
    if not math.isfinite(value):
        raise error(f"{name}={value} is not valid; it must be a finite number (not nan or inf)")


def check_positive(name: str, value: float, allow_zero: bool = False, error: type[UserError] = UserError) -> None:
    """Raise ``error`` unless ``value`` > 0 (or >= 0 with ``allow_zero``) and finite (NaN and infinity are
    refused: every comparison with NaN is false, so it would pass any bound): "name=value is not valid; it must
    be > 0"."""
    check_finite(name, value, error)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise error(f"{name}={value} is not valid; it must be {bound}")
