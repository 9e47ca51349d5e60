"""A worker's log: ddpkit's lines and other libraries' Python warnings, one line each with the rank."""

from __future__ import annotations

import warnings

from ddpkit.log import setup_logging


def test_a_library_warning_is_one_line_with_the_rank():
    previous = warnings.formatwarning
    try:
        setup_logging(1, 2)
        line = warnings.formatwarning("something odd\n  happened in torch", UserWarning, "/x/y/torch/z.py", 12, "code")
    finally:
        warnings.formatwarning = previous
    assert line == "[rank 1/2] warning: something odd happened in torch (UserWarning, z.py:12)\n"
