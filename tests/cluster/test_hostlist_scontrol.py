"""ddpkit's hostlist expansion against Slurm's own: ``scontrol show hostnames`` is the oracle.

scontrol expands a hostlist without any daemon; it only needs a slurm.conf
with ClusterName and SlurmctldHost, written here into a temporary folder and
passed through SLURM_CONF to its subprocesses alone. Where scontrol is
missing the test skips, except in CI (CI=true), where that is a failure: the
oracle must not go away unnoticed. scripts/cluster-setup.sh installs it
(Debian's slurm-client).

Suffixes: since Slurm 23.02, text after the last bracket group is appended
to every name of its expression (``n[1-2]-ib`` -> n1-ib n2-ib: the suffix
argument of _push_range_list in src/common/hostlist.c); Slurm 22.05, the
scontrol of Debian 12, refuses such a hostlist. ddpkit follows 23.02. Where
the scontrol at hand refuses ``n[1-2]-ib``, the expected names of an
expression with a suffix are scontrol's names for the expression without it,
each followed by the suffix: the 23.02 rule, with scontrol still giving the
order and padding. Where scontrol accepts it, whole hostlists go to scontrol
as they are.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.env.hostlist import count_hosts, expand_hostlist, first_host

pytestmark = [pytest.mark.cluster]

SEED = 16
"""Seed of the generated hostlists; failures name it."""

GENERATED_LISTS = 400

# Each also in tests/env/test_hostlist.py with its expected names written out.
EDGE_CASES = [
    "row[0,1]_rack[2-3]_blade[4,5]",
    "x01[0-1]y01[0-1]z01[0-1]",
    "a[1-2]b[3-4]c[5-6]d[7-8]",
    "c[0-1]-[3-4]-ib[5,7]",
    "n[1-2][3-4][5,06]",
    "node[01-03,7],gpu-a[1-2]",
    "rack[1-2]-node[1-3]",
    "n[1-2,5]y[1-2]",
    "n[9-11]",
    "n[09-11]",
    "n[8-010]",
    "n[001-3]",
    "n[1,1]",
    "n007,n[7-8]",
    "a,,b",
    "a[1-2] b\tc",
    "[1-2]",
    "n1[2-3]",
    "host-1.example.org,host-2.example.org",
    "n[0-65535]",  # the largest range Slurm allows
    "a[0-65535]b[0]",  # a group before the last at Slurm's cap
    "b[0-40000,0-40000]",  # the last group as a whole is not capped
]

# Expressions as (text up to the last bracket group, text after it), joined by commas.
SUFFIX_CASES = [
    [("n[1-2]", "-ib")],
    [("c[0-1]-[3-4]-ib[5,7]", "-eth")],
    [("n[1-2]", "-ib"), ("m[3]", "x"), ("gpu[08-10]", ".cluster"), ("cpu[1-2]", "")],
]

# Slurm refuses each of these (MAX_RANGE, or MAX_PREFIX_CNT for a group before the last).
REFUSED = [
    "n[0-65536]",
    "n[1-1000000]",
    "foo[0-1048576]",
    "n[0-9999999]",
    "ok,n[1-2,0-65536]y[1]",
    "a[0-40000,0-40000]b[1]",
    "a[0-65536]b[1]",
]


@dataclass(frozen=True)
class Scontrol:
    """scontrol with a throwaway slurm.conf."""

    path: str
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.path, *args], env=self.env, capture_output=True, text=True, timeout=60, check=False)

    def hostnames(self, hostlist: str) -> list[str] | None:
        """The names scontrol expands the hostlist into; None where it refuses it."""
        result = self.run("show", "hostnames", hostlist)
        if "Invalid hostlist" in result.stderr:
            return None
        assert result.returncode == 0 and not result.stderr, f"scontrol on {hostlist!r}: {result.stderr}"
        return result.stdout.splitlines()

    def version(self) -> str:
        return self.run("--version").stdout.strip()


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory: pytest.TempPathFactory) -> Scontrol:
    path = shutil.which("scontrol")
    if path is None:
        reason = "scontrol is missing: run scripts/cluster-setup.sh (Debian's slurm-client)"
        if os.environ.get("CI", "").lower() in {"true", "1"}:
            pytest.fail(f"{reason}; in CI the Slurm oracle must run")
        pytest.skip(reason)
    conf = Path(tmp_path_factory.mktemp("slurm")) / "slurm.conf"
    # All scontrol 22.05 needs to expand hostlists without a controller.
    conf.write_text("ClusterName=ddpkit\nSlurmctldHost=localhost\n")
    return Scontrol(path, {**os.environ, "SLURM_CONF": str(conf)})


@dataclass(frozen=True)
class Expression:
    """A generated host expression and the text after its last bracket group."""

    body: str
    suffix: str = ""


def test_generated_hostlists_match_scontrol(scontrol: Scontrol):
    rng = random.Random(SEED)
    accepts_suffix = scontrol.hostnames("n[1-2]-ib") is not None
    print(f"seed {SEED}, {scontrol.version()}, suffixes {'by scontrol' if accepts_suffix else 'by the 23.02 rule'}")
    generated = [_generate_hostlist(rng) for _ in range(GENERATED_LISTS)]
    hostlists = [_join(expressions, separators) for expressions, separators in generated]
    # One scontrol process per hostlist (or per expression), a few at a time: each mostly waits to start.
    with ThreadPoolExecutor(max_workers=4) as pool:
        expected_lists = list(
            pool.map(lambda case: _expected(scontrol, case[0][0], case[1], accepts_suffix), zip(generated, hostlists))
        )
    mismatches, names = [], 0
    for hostlist, expected in zip(hostlists, expected_lists):
        names += len(expected)
        if expand_hostlist(hostlist) != expected or count_hosts(hostlist) != len(expected):
            mismatches.append((hostlist, expected[:8], expand_hostlist(hostlist)[:8]))
    assert not mismatches, f"seed {SEED}: {len(mismatches)} hostlists differ from scontrol, e.g. {mismatches[:3]}"
    assert names > 10 * GENERATED_LISTS


@pytest.mark.parametrize("hostlist", EDGE_CASES)
def test_edge_cases_match_scontrol(scontrol: Scontrol, hostlist: str):
    expected = scontrol.hostnames(hostlist)
    assert expected is not None, f"scontrol refuses {hostlist!r}"
    assert expand_hostlist(hostlist) == expected
    assert count_hosts(hostlist) == len(expected)
    assert first_host(hostlist) == expected[0]


@pytest.mark.parametrize("parts", SUFFIX_CASES)
def test_suffixes_follow_slurm_23_02(scontrol: Scontrol, parts: list[tuple[str, str]]):
    expressions = [Expression(body, suffix) for body, suffix in parts]
    hostlist = _join(expressions, [","] * (len(expressions) - 1))
    accepts_suffix = scontrol.hostnames("n[1-2]-ib") is not None
    assert expand_hostlist(hostlist) == _expected(scontrol, expressions, hostlist, accepts_suffix)


def test_scontrol_refuses_suffixes_only_before_23_02(scontrol: Scontrol):
    major, minor = map(int, re.search(r"(\d+)\.(\d+)", scontrol.version()).groups())
    assert (scontrol.hostnames("n[1-2]-ib") is not None) == ((major, minor) >= (23, 2))


@pytest.mark.parametrize("hostlist", REFUSED)
def test_ddpkit_refuses_what_slurm_refuses(scontrol: Scontrol, hostlist: str):
    assert scontrol.hostnames(hostlist) is None
    with pytest.raises(ValueError, match="65,536 Slurm allows"):
        first_host(hostlist)


def _expected(scontrol: Scontrol, expressions: list[Expression], hostlist: str, accepts_suffix: bool) -> list[str]:
    """What Slurm 23.02 expands the hostlist into, asking scontrol per expression where it refuses suffixes."""
    if accepts_suffix or not any(e.suffix for e in expressions):
        expected = scontrol.hostnames(hostlist)
        assert expected is not None, f"seed {SEED}: scontrol refuses {hostlist!r}"
        return expected
    expected = []
    for expression in expressions:
        names = scontrol.hostnames(expression.body)
        assert names is not None, f"seed {SEED}: scontrol refuses {expression.body!r} of {hostlist!r}"
        expected.extend(name + expression.suffix for name in names)
    return expected


def _join(expressions: list[Expression], separators: list[str]) -> str:
    parts = [expressions[0].body + expressions[0].suffix]
    for separator, expression in zip(separators, expressions[1:]):
        parts += [separator, expression.body + expression.suffix]
    return "".join(parts)


def _generate_hostlist(rng: random.Random) -> tuple[list[Expression], list[str]]:
    """One to three expressions and the separators between them (',', ' ', or ',,' for an empty one)."""
    expressions = [_generate_expression(rng) for _ in range(rng.randint(1, 3))]
    separators = [rng.choice([",", ",", ",", " ", ",,"]) for _ in expressions[1:]]
    return expressions, separators


def _generate_expression(rng: random.Random) -> Expression:
    """A name, or a prefix and 1-4 bracket groups with text between them and maybe a suffix."""
    groups = rng.choice([0, 1, 1, 2, 2, 3, 3, 4])
    if groups == 0:
        return Expression(_text(rng, first=True, minimum=1))
    # Bounds per group count keep a hostlist to a few hundred names.
    span, items = {1: (12, 3), 2: (4, 2), 3: (2, 2), 4: (1, 2)}[groups]
    prefix = "" if rng.random() < 0.1 else _text(rng, first=True, minimum=1)
    body = prefix + "".join(
        (_text(rng) if i else "") + "[" + ",".join(_item(rng, span) for _ in range(rng.randint(1, items))) + "]"
        for i in range(groups)
    )
    suffix = _text(rng, minimum=1) if rng.random() < 0.3 else ""
    return Expression(body, suffix)


def _text(rng: random.Random, first: bool = False, minimum: int = 0) -> str:
    """Literal name text; a hostlist's first character is a letter, lest scontrol take it for an option."""
    chars = [rng.choice("abcnrxyz-_.0123456789") for _ in range(rng.randint(minimum, 4))]
    if first and chars:
        chars[0] = rng.choice("abcnrxyz")
    return "".join(chars)


def _item(rng: random.Random, span: int) -> str:
    """A bracket item: a number or a range, with zero padding now and then."""
    low = rng.choice([rng.randint(0, 12), rng.randint(0, 120), rng.randint(90, 1100)])
    low_text = str(low).zfill(rng.choice([0, 0, 0, 2, 3, 4]))
    if rng.random() < 0.4:
        return low_text
    high_text = str(low + rng.randint(0, span)).zfill(rng.choice([0, 0, len(low_text)]))
    return f"{low_text}-{high_text}"
