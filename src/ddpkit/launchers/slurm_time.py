"""A Slurm time limit (``time=``, ``#SBATCH --time``) read as seconds, with one-line errors for the forms Slurm refuses."""

from __future__ import annotations

import re

from ddpkit.errors import UserError

_TIME = re.compile(r"(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)")
"""Slurm's forms: minutes[:seconds], hours:minutes:seconds, days-hours[:minutes[:seconds]]."""


def time_limit_seconds(value: str) -> int:
    """Seconds in a Slurm time limit, or ValueError naming the accepted formats."""
    match = _TIME.fullmatch(value)
    if match is None:
        raise UserError(
            f"time={value!r} is not a Slurm time limit; use minutes, minutes:seconds, hours:minutes:seconds, "
            "days-hours, days-hours:minutes or days-hours:minutes:seconds (e.g. 90, 2:00:00, 1-12:00)"
        )
    days, d_hours, d_minutes, d_seconds, first, second, third = (int(g) if g else 0 for g in match.groups())
    parts: tuple[int, ...]
    limits: tuple[int, ...]
    if match.group(1) is not None:
        parts, limits = (d_hours, d_minutes, d_seconds), (24, 60, 60)
        seconds = ((days * 24 + d_hours) * 60 + d_minutes) * 60 + d_seconds
    elif match.group(7) is not None:  # hours:minutes:seconds
        parts, limits = (second, third), (60, 60)
        seconds = (first * 60 + second) * 60 + third
    else:  # minutes[:seconds]
        parts, limits = (second,), (60,)
        seconds = first * 60 + second
    if any(p >= limit for p, limit in zip(parts, limits)):
        raise UserError(
            f"time={value!r} has a field out of range: minutes and seconds must be < 60, and hours < 24 after days-"
        )
    if seconds == 0:
        raise UserError(f"time={value!r} is zero; give a positive time limit, or none for the partition's")
    return seconds
