"""Slurm hostlist expansion: ``node[01-03,7],gpu-a[1-2]`` -> one host name per node.

The syntax, order and limits are those of Slurm's src/common/hostlist.c
(what ``scontrol show hostnames`` prints):

- Host expressions are separated by commas or whitespace outside brackets;
  empty expressions are skipped.
- A bracket group lists numbers and ranges separated by commas: ``[1-3,7]``.
- A range keeps the width of its lower bound: ``[08-10]`` -> 08 09 10, while
  ``[8-10]`` -> 8 9 10.
- Several bracket groups expand as a product in the order of Slurm's
  ``_push_range_list``: the last group varies fastest; the others are nested
  from the second-to-last (slowest) leftwards to the first. With two groups
  that is the usual order, ``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2; with
  three, ``r[0-1]k[2-3]b[4-5]`` -> r0k2b4 r0k2b5 r1k2b4 r1k2b5 r0k3b4 ...
- Text after the last bracket group is appended to each name, as Slurm
  23.02 and later do: ``n[1-2]-ib`` -> n1-ib n2-ib (Slurm 22.05 and older
  refuse such a hostlist).
- Slurm's limits: a range of more than 65,536 names (MAX_RANGE) is an error,
  and so is a bracket group other than the last with more than 65,536 names
  in all (MAX_PREFIX_CNT). The last group may hold more, and the groups
  multiply: ``a[0-65535]b[0-65535]`` is a legal hostlist of 2**32 names, so
  ``first_host`` and ``count_hosts`` answer without expanding the list.

On malformed input, where Slurm guesses, this module raises ValueError:
unbalanced or nested brackets, empty items, and anything but ASCII digits
and one '-' inside a bracket item (Slurm reads ``[ 1]`` as ``[01]``).
Whitespace other than space and tab also separates expressions here;
Slurm keeps it inside the name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from ddpkit.errors import UserError

MAX_NAMES_PER_RANGE = 65_536
"""Slurm's MAX_RANGE and MAX_PREFIX_CNT (64K): names in one range, and in one bracket group before the last."""

_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_GROUP = re.compile(r"\[([^\[\]]*)\]")


@dataclass(frozen=True)
class _Range:
    """The numbers low..high of a bracket item, zero-padded to width."""

    low: int
    high: int
    width: int


@dataclass(frozen=True)
class _Expression:
    """One host expression: texts[0] group[0] texts[1] ... group[n-1] texts[n]."""

    texts: tuple[str, ...]
    groups: tuple[tuple[_Range, ...], ...]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist into all its host names, in Slurm's order.

    Args:
        hostlist: A hostlist such as SLURM_JOB_NODELIST, e.g. ``node[01-03,7],gpu-a[1-2]``.

    Returns:
        The host names, duplicates kept, e.g. ``["node01", "node02", "node03",
        "node7", "gpu-a1", "gpu-a2"]``; empty for an empty hostlist. A legal
        hostlist can name billions of hosts: use first_host, count_hosts or
        iter_hosts where that may happen.

    Raises:
        ValueError: see iter_hosts.
    """
    return list(iter_hosts(hostlist))


def iter_hosts(hostlist: str) -> Iterator[str]:
    """Check the whole hostlist now, then yield its host names lazily, in Slurm's order.

    Raises:
        ValueError: unbalanced or nested brackets, an empty or non-numeric
            item, a range whose end is below its start, or one of Slurm's
            limits exceeded (see MAX_NAMES_PER_RANGE).
    """
    expressions = _parse(hostlist)  # outside the generator, so errors raise at the call
    return (host for expression in expressions for host in _expression_hosts(expression))


def first_host(hostlist: str) -> str | None:
    """The first host name of the hostlist (None when it is empty), without expanding the rest.

    Raises:
        ValueError: as iter_hosts; the whole hostlist is checked, not only its first name.
    """
    return next(iter_hosts(hostlist), None)


def count_hosts(hostlist: str) -> int:
    """The number of host names in the hostlist, duplicates counted, without expanding it.

    Raises:
        ValueError: as iter_hosts.
    """
    return sum(math.prod(_group_size(group) for group in e.groups) for e in _parse(hostlist))


def _parse(hostlist: str) -> list[_Expression]:
    """Parse and check every expression of the hostlist."""
    expressions = []
    for expression in _split_expressions(hostlist):
        # re.split with a capturing group alternates literal text and bracket contents.
        pieces = _GROUP.split(expression)
        texts, contents = pieces[0::2], pieces[1::2]
        groups = [_parse_group(c, hostlist, last=i == len(contents) - 1) for i, c in enumerate(contents)]
        expressions.append(_Expression(tuple(texts), tuple(groups)))
    return expressions


def _split_expressions(hostlist: str) -> list[str]:
    """Split at commas and whitespace outside brackets, checking the brackets pair up."""
    expressions: list[str] = []
    current: list[str] = []
    inside = False
    for char in hostlist:
        if char == "[":
            if inside:
                raise UserError(f"nested '[' in hostlist {hostlist!r}; brackets hold only numbers and ranges")
            inside = True
        elif char == "]":
            if not inside:
                raise UserError(f"']' without '[' in hostlist {hostlist!r}")
            inside = False
        elif (char == "," or char.isspace()) and not inside:
            expressions.append("".join(current))
            current = []
            continue
        current.append(char)
    if inside:
        raise UserError(f"unclosed '[' in hostlist {hostlist!r}")
    expressions.append("".join(current))
    return [expression for expression in expressions if expression]


def _parse_group(group: str, hostlist: str, last: bool) -> tuple[_Range, ...]:
    """Parse the contents of one bracket group, "01-03,7" -> ranges 1..3 (width 2) and 7..7."""
    ranges = tuple(_parse_item(item, hostlist) for item in group.split(","))
    # Slurm expands every group but the last into name prefixes, hence its cap there (MAX_PREFIX_CNT).
    if not last and _group_size(ranges) > MAX_NAMES_PER_RANGE:
        raise UserError(
            f"bracket group [{group}] in hostlist {hostlist!r} has {_group_size(ranges):,} names, more than "
            f"the {MAX_NAMES_PER_RANGE:,} Slurm allows in a group before the last; Slurm refuses this "
            "hostlist too: split the expression at commas into smaller ones"
        )
    return ranges


def _parse_item(item: str, hostlist: str) -> _Range:
    """Parse one bracket item, "N" or "N-M", checking Slurm's MAX_RANGE."""
    match = _ITEM.fullmatch(item)
    if match is None:
        raise UserError(f"invalid range {item!r} in hostlist {hostlist!r}; expected N or N-M")
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if high < low:
        raise UserError(f"range {item!r} in hostlist {hostlist!r} ends below its start")
    if high - low + 1 > MAX_NAMES_PER_RANGE:
        raise UserError(
            f"range {item!r} in hostlist {hostlist!r} has {high - low + 1:,} names, more than the "
            f"{MAX_NAMES_PER_RANGE:,} Slurm allows in one range; Slurm refuses this hostlist too: "
            f"split the range into ranges of at most {MAX_NAMES_PER_RANGE:,} names"
        )
    return _Range(low, high, len(match.group(1)))


def _group_size(ranges: tuple[_Range, ...]) -> int:
    """Number of names a bracket group yields."""
    return sum(r.high - r.low + 1 for r in ranges)


def _group_numbers(ranges: tuple[_Range, ...]) -> Iterator[str]:
    """The numbers of a bracket group as text, in order, zero-padded to each range's width."""
    for r in ranges:
        for number in range(r.low, r.high + 1):
            yield str(number).zfill(r.width)


def _slurm_nesting(group_count: int) -> list[int]:
    """Group indices from the outermost loop to the innermost, as Slurm nests them.

    Slurm's _push_range_list takes the last group as the ranges to push, then
    loops over the last group left in the prefix and recurses into the prefix
    with that number filled in: the second-to-last group is the outermost
    loop, then the groups before it leftwards, then the last group.
    """
    if group_count == 0:
        return []
    return [*range(group_count - 2, -1, -1), group_count - 1]


def _expression_hosts(expression: _Expression) -> Iterator[str]:
    """Yield the names of one expression in Slurm's order, one at a time."""
    nesting = _slurm_nesting(len(expression.groups))
    numbers = [""] * len(expression.groups) + [""]  # one more, to pair with the last text

    def fill(depth: int) -> Iterator[str]:
        if depth == len(nesting):
            yield "".join(text + number for text, number in zip(expression.texts, numbers))
            return
        index = nesting[depth]
        for number in _group_numbers(expression.groups[index]):
            numbers[index] = number
            yield from fill(depth + 1)

    return fill(0)
