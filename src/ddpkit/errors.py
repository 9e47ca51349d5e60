"""The one base class of the errors ddpkit raises for its user's input.

A :class:`UserError` (bad configuration, a missing file, a checkpoint that
does not verify, an inconsistent launcher environment...) is the user's to
fix: the command prints its message as one line and exits with status 2, and
a failed worker is reported by that line alone. Any other exception,
a ``ValueError`` from torch or from the user's own model included, is a bug
somewhere and is reported with its traceback and rank.

It derives from ``ValueError`` so that code catching ``ValueError`` around
ddpkit calls keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message names the problem and the fix in one line."""
