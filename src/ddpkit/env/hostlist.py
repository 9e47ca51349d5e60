"""Slurm hostlist expansion: ``node[01-03,7],gpu-a[1-2]`` -> one host name per node.

The syntax, as ``scontrol show hostnames`` reads it:

- Host expressions are separated by commas (or whitespace) outside brackets;
  empty expressions are skipped.
- A bracket group lists numbers and ranges separated by commas: ``[1-3,7]``.
- A range keeps the width of its lower bound: ``[08-10]`` -> 08 09 10, while
  ``[8-10]`` -> 8 9 10.
- Several bracket groups expand as a product, the leftmost varying slowest:
  ``rack[1-2]-node[1-2]`` -> rack1-node1 rack1-node2 rack2-node1 rack2-node2.

Unlike scontrol, text after a single bracket group (``n[1-2]-ib``) is accepted.
"""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in Slurm's order.

    Args:
        hostlist: A hostlist such as SLURM_JOB_NODELIST, e.g. ``node[01-03,7],gpu-a[1-2]``.

    Returns:
        The host names, duplicates kept, e.g. ``["node01", "node02", "node03",
        "node7", "gpu-a1", "gpu-a2"]``; empty for an empty hostlist.

    Raises:
        ValueError: unbalanced or nested brackets, an empty or non-numeric
            range, or a range whose end is below its start.
    """
    hosts: list[str] = []
    for expression in _split_expressions(hostlist):
        # re.split with a capturing group alternates literal text and bracket contents.
        pieces = re.split(r"\[([^\[\]]*)\]", expression)
        choices = [[piece] if i % 2 == 0 else _expand_group(piece, hostlist) for i, piece in enumerate(pieces)]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _split_expressions(hostlist: str) -> list[str]:
    """Split at commas and whitespace outside brackets, checking the brackets pair up."""
    expressions, current, inside = [], [], False
    for char in hostlist:
        if char == "[":
            if inside:
                raise ValueError(f"nested '[' in hostlist {hostlist!r}; brackets hold only numbers and ranges")
            inside = True
        elif char == "]":
            if not inside:
                raise ValueError(f"']' without '[' in hostlist {hostlist!r}")
            inside = False
        elif (char == "," or char.isspace()) and not inside:
            expressions.append("".join(current))
            current = []
            continue
        current.append(char)
    if inside:
        raise ValueError(f"unclosed '[' in hostlist {hostlist!r}")
    expressions.append("".join(current))
    return [expression for expression in expressions if expression]


def _expand_group(group: str, hostlist: str) -> list[str]:
    """Expand the contents of one bracket group, "01-03,7" -> ["01", "02", "03", "7"]."""
    numbers: list[str] = []
    for item in group.split(","):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise ValueError(f"invalid range {item!r} in hostlist {hostlist!r}; expected N or N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {item!r} in hostlist {hostlist!r} ends below its start")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return numbers
