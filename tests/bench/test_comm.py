"""``ddpkit bench comm``: the formulas, the plan, and a real smoke run of 2 workers through the CLI."""

from __future__ import annotations

import json
import math
import sys

import pytest

from ddpkit.bench import comm
from ddpkit.bench.comm import (
    CommBenchConfig,
    algbw,
    bus_factor,
    busbw,
    iterations_for,
    message_count,
    parse_config,
    plan_algorithms,
    sweep_sizes,
    target_ratios,
)
from ddpkit.bench.comm_report import plot_report, render_markdown
from ddpkit.bench.report import write_report
from ddpkit.comm import available_allreduce_algorithms
from ddpkit.figures import format_bytes
from ddpkit.keyvalue import ConfigError
from tests.bench.in_process import run_main
from tests.cluster.test_multinode import run_on_two_hosts
from tests.helpers.netns import netns_hosts  # noqa: F401  (a fixture)

MIB = 1 << 20


# --- formulas ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op,n,factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 1, 0.0),
        ("all_gather", 2, 0.5),
        ("all_gather_into_tensor", 4, 0.75),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 3, 2 / 3),
        ("gather", 4, 0.75),
        ("scatter", 2, 0.5),
        ("broadcast", 4, 1.0),
        ("reduce", 8, 1.0),
    ],
)
def test_bus_factor_follows_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidths_are_bytes_over_time_in_gb_per_s():
    assert algbw(1_000_000_000, 0.5) == pytest.approx(2.0)
    assert busbw("all_reduce", 32 * MIB, 0.01, 4) == pytest.approx(32 * MIB / 0.01 / 1e9 * 1.5)
    assert busbw("broadcast", 1000, 1e-6, 8) == pytest.approx(algbw(1000, 1e-6))
    assert busbw("all_gather", 4096, 2e-6, 2) == pytest.approx(4096 / 2e-6 / 1e9 / 2)


def test_sweep_sizes_default_covers_4_bytes_to_64_mib_with_32_mib():
    sizes = sweep_sizes(4, 64 * MIB, 2)
    assert sizes[0] == 4 and sizes[-1] == 64 * MIB and 32 * MIB in sizes and len(sizes) == 25
    assert sweep_sizes(4, 64 << 10, 4) == [4, 16, 64, 256, 1024, 4096, 16384, 65536]
    assert sweep_sizes(100, 100, 2) == [100]


@pytest.mark.parametrize(
    "op,num_bytes,n,count",
    [
        ("all_reduce", 4, 2, 1),
        ("all_reduce", 2, 2, 1),
        ("broadcast", 1024, 3, 256),
        ("all_gather", 4, 2, 2),
        ("all_gather", 1024, 3, 255),
        ("reduce_scatter", 64, 4, 16),
        ("all_to_all", 4, 4, 4),
        ("all_to_all_single", 40, 3, 9),
        ("gather", 8, 2, 2),
    ],
)
def test_message_count_rounds_split_buffers_to_whole_pieces(op, num_bytes, n, count):
    assert message_count(op, num_bytes, n, 4) == count


def test_iterations_for_fills_the_target_and_stays_bounded():
    assert iterations_for(1e-3, 0.2, 5) == 40
    assert iterations_for(1.0, 0.2, 5) == 1
    assert iterations_for(0.0, 0.2, 5) == comm.MAX_ITERATIONS
    assert iterations_for(1e-9, 0.2, 5) == comm.MAX_ITERATIONS


def test_format_bytes():
    assert [format_bytes(b) for b in (4, 1024, 1536, 64 * MIB)] == ["4 B", "1 KiB", "1.5 KiB", "64 MiB"]


# --- configuration and plan ----------------------------------------------------------------------


def test_smoke_presets_yield_to_explicit_words():
    cfg = parse_config(["smoke=true"])
    assert (cfg.max_bytes, cfg.iterations, cfg.repeats, cfg.step_factor) == (64 << 10, 2, 2, 4)
    assert parse_config(["smoke=true", "max_bytes=1024", "repeats=3"]).max_bytes == 1024
    assert parse_config([]).max_bytes == 64 * MIB and parse_config([]).iterations == 0


@pytest.mark.parametrize(
    "words,message",
    [
        (["ops=[all_reduce,barrier]"], "ops: 'barrier' is not an op this benchmark runs"),
        (["ops=[]"], "ops is empty"),
        (["ops=[reduce,reduce]"], "names an op twice"),
        (["step_factor=1"], "step_factor=1 is not valid"),
        (["min_bytes=1024", "max_bytes=4"], "max_bytes=4 is below min_bytes=1024"),
        (["dtype=float8"], "dtype='float8' is not valid"),
        (["repeats=0"], "repeats=0 is not valid"),
    ],
)
def test_bad_config_is_a_config_error(words, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(words)


def test_plan_runs_every_available_algorithm_with_the_builtin_first():
    plan, skipped = plan_algorithms(CommBenchConfig(), num_nodes=1)
    assert plan["all_reduce"] == ["builtin"] + [a for a in available_allreduce_algorithms() if a != "builtin"]
    assert plan["broadcast"] == ["builtin", "tree"] and plan["all_to_all"] == ["builtin", "pairwise"]
    assert "pingpong" not in plan
    assert ("all_reduce/shm" in skipped) == ("shm" not in available_allreduce_algorithms())


def test_plan_filters_by_name_and_leaves_shm_out_across_nodes():
    plan, _ = plan_algorithms(CommBenchConfig(ops=["all_reduce", "all_gather"], algorithms=["ring"]), 1)
    assert plan == {"all_reduce": ["ring"], "all_gather": ["ring"]}
    plan, skipped = plan_algorithms(CommBenchConfig(ops=["all_reduce"]), num_nodes=2)
    assert "shm" not in plan["all_reduce"] and skipped["all_reduce/shm"] == "the job spans 2 nodes"
    with pytest.raises(ValueError, match="shm needs every rank on one node"):
        plan_algorithms(CommBenchConfig(ops=["all_reduce"], algorithms=["builtin", "shm"]), num_nodes=2)
    with pytest.raises(ValueError, match="'rings' is not an algorithm of all_reduce"):
        plan_algorithms(CommBenchConfig(ops=["all_reduce"], algorithms=["rings"]), 1)
    with pytest.raises(ValueError, match="names none of broadcast's algorithms"):
        plan_algorithms(CommBenchConfig(ops=["all_reduce", "broadcast"], algorithms=["ring"]), 1)


def _row(algorithm, num_bytes, median_us):
    return {"op": "all_reduce", "algorithm": algorithm, "bytes": num_bytes, "time_us": {"median": median_us}}


def test_targets_are_ratios_of_medians_over_their_size_ranges():
    sizes = sweep_sizes(4, 64 * MIB, 4) + [32 * MIB]
    rows = [_row("builtin", s, 100.0 + s / 1e4) for s in sizes]
    rows += [_row("shm", s, (100.0 + s / 1e4) / (4.0 if s == 1024 else 6.0)) for s in sizes]
    rows += [_row("ring", s, (100.0 + s / 1e4) * (1.6 if s == 4 * MIB else 1.2)) for s in sizes]
    targets = target_ratios(rows, 2, "float32")
    t3, t4 = targets["T3"], targets["T4"]
    assert t3["worst"] == pytest.approx(4.0) and t3["worst_bytes"] == 1024 and not t3["met"]
    assert t3["covers_range"] and str(64 * MIB) not in t3["per_size"] and t3["sizes"] == [4, 32 * MIB]
    assert t4["worst"] == pytest.approx(1.6) and t4["worst_bytes"] == 4 * MIB and not t4["met"]
    assert min(int(s) for s in t4["per_size"]) == MIB
    assert "not_applicable" in target_ratios(rows, 4, "float32")["T3"]
    assert target_ratios([r for r in rows if r["algorithm"] != "builtin"], 2, "float32") == {}


# --- a real run ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``ddpkit bench comm smoke=true nproc=2`` (in-process; 2 workers launched as always): its output and report."""
    folder = tmp_path_factory.mktemp("comm")
    code, stdout = run_main("bench", "comm", "smoke=true", "nproc=2", f"output_dir={folder}")
    assert code == 0
    [json_path] = folder.glob("comm-*-2r-*-smoke.json")
    return stdout, json_path, json.loads(json_path.read_text())


@pytest.mark.slow
def test_smoke_run_measures_every_op_and_algorithm(smoke_run):
    _, json_path, report = smoke_run
    plan, _ = plan_algorithms(CommBenchConfig(), num_nodes=1)
    assert report["algorithms"] == plan
    assert report["world_size"] == 2 and report["num_nodes"] == 1 and report["dtype"] == "float32"
    assert {"torch", "cpu_model", "cores", "date"} <= set(report["machine"])
    assert report["config"]["smoke"] is True and report["command_words"][0] == "smoke=true"
    sizes = sweep_sizes(4, 64 << 10, 4)
    for op, algorithms in plan.items():
        want = sorted({message_count(op, s, 2, 4) * 4 for s in sizes})
        for algorithm in algorithms:
            rows = [r for r in report["collectives"] if r["op"] == op and r["algorithm"] == algorithm]
            assert [r["bytes"] for r in rows] == want, (op, algorithm)
    for row in report["collectives"]:
        t, seconds = row["time_us"], row["time_us"]["median"] / 1e6
        assert 0 < t["min"] <= t["median"] <= t["max"] and t["n"] == 2 and row["iterations"] == 2
        # The slowest rank's median is at least every rank's own median.
        assert all(t["median"] >= r * (1 - 1e-9) for r in row["rank_median_us"]) and len(row["rank_median_us"]) == 2
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / seconds / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(row["op"], 2))
        builtin = next(
            r
            for r in report["collectives"]
            if (r["op"], r["bytes"], r["algorithm"]) == (row["op"], row["bytes"], "builtin")
        )
        assert row["vs_builtin"] == pytest.approx(t["median"] / builtin["time_us"]["median"])
    assert [r["bytes"] for r in report["pingpong"]] == sizes
    for row in report["pingpong"]:
        assert row["peer"] == 1 and row["same_node"] and row["peer_host"] == report["nodes"][1]["host"]
        assert row["bandwidth_gbps"] == pytest.approx(row["bytes"] / (row["latency_us"]["median"] / 1e6) / 1e9)
    t3 = report["targets"]["T3"] if "shm" in plan["all_reduce"] else None
    assert t3 is None or (t3["sizes"] == [4, 64 << 10] and not t3["covers_range"])
    assert report["targets"]["T4"]["per_size"] == {}


@pytest.mark.slow
def test_smoke_run_prints_a_table_and_writes_markdown_and_png(smoke_run):
    stdout, json_path, report = smoke_run
    assert "# all_reduce, float32, 2 ranks" in stdout and "# pingpong" in stdout
    builtin_4b = next(line for line in stdout.splitlines() if line.split()[:3] == ["4", "1", "builtin"])
    assert builtin_4b.split()[-1] == "1.00x"
    markdown = json_path.with_suffix(".md").read_text()
    for op in report["algorithms"]:
        assert f"## {op}" in markdown
    assert "## pingpong" in markdown and "rank 1, same node" in markdown
    assert f"]({json_path.with_suffix('.png').name})" in markdown
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_without_matplotlib_skips_the_png_with_one_warning(smoke_run, tmp_path, monkeypatch, capsys):
    _, _, report = smoke_run
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    paths = write_report(report, str(tmp_path), "comm-test", render_markdown, plot_report)
    assert [p.name for p in paths] == ["comm-test.json", "comm-test.md"]
    assert not (tmp_path / "comm-test.png").exists()
    assert "![" not in (tmp_path / "comm-test.md").read_text()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed" in err
    assert math.isclose(json.loads((tmp_path / "comm-test.json").read_text())["runtime_s"], report["runtime_s"])


@pytest.mark.cluster
@pytest.mark.slow
def test_across_two_hosts_pingpong_tells_peers_apart_and_shm_is_left_out(netns_hosts, tmp_path):
    words = ["bench", "comm", "smoke=true", "ops=[all_reduce,pingpong]", "max_bytes=64", f"output_dir={tmp_path}"]
    a, b = run_on_two_hosts(netns_hosts, 2, words, tmp_path, timeout=300)
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    [path] = tmp_path.glob("comm-*-4r-*-smoke.json")
    report = json.loads(path.read_text())
    assert report["num_nodes"] == 2 and [n["node_rank"] for n in report["nodes"]] == [0, 0, 1, 1]
    assert "shm" not in report["algorithms"]["all_reduce"]
    assert report["skipped"] == {"all_reduce/shm": "the job spans 2 nodes"}
    peers = {(r["peer"], r["same_node"], r["peer_node_rank"]) for r in report["pingpong"]}
    assert peers == {(1, True, 0), (2, False, 1), (3, False, 1)}
    assert "rank 2, node 1" in a.stdout
