"""ddpkit bench scaling: the alpha-beta model's pure functions, the matrix, and a real smoke run."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench import perfmodel
from ddpkit.bench.scaling import (
    PARTS,
    batch_ladder,
    bottleneck,
    configurations,
    fit_sizes,
    merge_rounds,
    parse_config,
)
from ddpkit.keyvalue import ConfigError
from tests.bench.in_process import run_main

# --- the model ------------------------------------------------------------------------------


def test_fit_line_recovers_alpha_and_beta():
    alpha, beta = 150e-6, 1 / 2e9  # 150 us, 2 GB/s
    sizes = [4096, 40_000, 160_000, 320_000]
    fit = perfmodel.fit_line(sizes, [alpha + beta * n for n in sizes])
    assert fit.intercept == pytest.approx(alpha)
    assert fit.slope == pytest.approx(beta)
    assert fit(1 << 20) == pytest.approx(alpha + beta * (1 << 20))


def test_fit_line_never_returns_negative_times():
    flat = perfmodel.fit_line([1, 2, 3], [5.0, 4.0, 3.0])  # falling: noise on a flat curve
    assert flat == perfmodel.LinearFit(4.0, 0.0)
    through_origin = perfmodel.fit_line([1, 2, 10], [0.0, 1.0, 10.0])  # the free fit has a negative intercept
    assert through_origin.intercept == 0.0 and through_origin.slope > 0
    assert perfmodel.fit_line([3], [2.0]) == perfmodel.LinearFit(2.0, 0.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        perfmodel.fit_line([1, 2], [1.0])


def test_ring_allreduce_cost():
    net = perfmodel.Network("test", latency_s=10e-6, bandwidth_bytes_per_s=1e9)
    assert perfmodel.ring_allreduce_seconds(1, 1e6, net) == 0.0
    # p = 4: 6 latencies and 2 * 3/4 of the bytes.
    assert perfmodel.ring_allreduce_seconds(4, 1e6, net) == pytest.approx(6 * 10e-6 + 1.5e-3)


def test_projection_strong_scaling_peaks_then_falls():
    compute = perfmodel.LinearFit(0.0, 1e-4)  # 0.1 ms per sample, no fixed cost
    workload = perfmodel.Workload(batch_size=64, per_worker=False, gradient_bytes=160_000, compute=compute)
    net = perfmodel.Network("slow", 20e-6, 25e9 / 8)
    points = perfmodel.project(workload, net, perfmodel.projection_world_sizes(1000))
    assert points[0].world_size == 1 and points[0].speedup == pytest.approx(1.0)
    assert max(q.world_size for q in points) == 64  # beyond 64 workers some get no sample
    by_size = {q.world_size: q for q in points}
    # p = 2: compute 3.2 ms, comm 2 * 20 us + 160 kB / 3.125 GB/s = 91.2 us.
    assert by_size[2].step_s == pytest.approx(3.2e-3 + 40e-6 + 51.2e-6)
    assert by_size[2].speedup == pytest.approx(6.4e-3 / by_size[2].step_s)
    limit = perfmodel.scaling_limit(points)
    assert 2 < limit.best_world_size < 64
    assert limit.half_efficiency_world_size is not None
    assert by_size[limit.half_efficiency_world_size].efficiency < 0.5


def test_projection_weak_scaling_keeps_compute_per_worker():
    workload = perfmodel.Workload(16, True, 1_000_000, perfmodel.LinearFit(1e-3, 1e-4))
    net = perfmodel.Network("fast", 2e-6, 25e9)
    points = perfmodel.project(workload, net, [1, 10, 1000])
    assert [q.compute_s for q in points] == pytest.approx([2.6e-3] * 3)
    # p = 1000: the ring's 2(p-1) latencies (4 ms) outweigh its bytes (80 us).
    comm = 2 * 999 * 2e-6 + 2 * 999 / 1000 * 1e6 / 25e9
    assert points[-1].comm_s == pytest.approx(comm)
    assert points[-1].speedup == pytest.approx(1000 * 2.6e-3 / (2.6e-3 + comm))


def test_projection_world_sizes_cover_the_range():
    sizes = perfmodel.projection_world_sizes(1000)
    assert sizes[0] == 1 and sizes[-1] == 1000 and sizes == sorted(set(sizes))
    assert {2, 8, 64, 512} <= set(sizes)


# --- the matrix and the words ------------------------------------------------------------------


def test_default_matrix_is_the_smoke_matrix():
    runs = configurations(parse_config(["smoke=true"]))
    assert [(r.workers, r.nodes, r.allreduce) for r in runs] == [
        (1, 1, "none"),
        (2, 1, "builtin"),
        (2, 1, "shm"),
        (2, 2, "builtin"),
        (2, 2, "shm"),
    ]
    assert runs[3].name == "2 workers, 2 nodes, builtin"


def test_matrix_leaves_out_uneven_splits():
    runs = configurations(parse_config(["workers=[1,3,4]", "nodes=[1,2]", "allreduce=[ring]"]))
    assert [(r.workers, r.nodes) for r in runs] == [(1, 1), (3, 1), (4, 1), (4, 2)]


def test_smoke_presets_and_bad_words():
    cfg = parse_config(["smoke=true", "steps=5"])
    assert (cfg.warmup, cfg.steps, cfg.model) == (2, 5, "mlp")
    assert parse_config(["workload=W3"]).model == "autoencoder"
    with pytest.raises(ConfigError, match="nodes=\\[3\\] is not valid"):
        parse_config(["nodes=[3]"])
    with pytest.raises(ConfigError, match="'hierarchy' is not an all_reduce algorithm"):
        parse_config(["allreduce=[hierarchy]"])


def test_fit_sizes_bracket_the_gradients():
    assert fit_sizes(159_040) == [4096, 39_760, 79_520, 159_040]
    assert batch_ladder(64) == [64, 32, 16, 8, 4, 2, 1] and batch_ladder(5) == [5, 2, 1]


def test_merge_rounds_takes_medians_and_extremes_and_predicts_each_round():
    def result(step, low, high, comm):
        compute = step / 2
        return {
            "slowest_rank": {
                "step": step,
                "compute": compute,
                "sync_noop": compute + 0.1,
                "step_min": low,
                "step_max": high,
            },
            "comm_s": comm,
            "comm_isolated_s": comm,
            "comm_sizes": [100, 200],
            "gradient_bytes": 200,
            "global_batch": 64,
        }

    merged = merge_rounds(
        [result(1.0, 0.8, 2.0, [4.0, 5.0]), result(3.0, 0.7, 9.0, [2.0, 4.0]), result(2.0, 0.9, 3.0, [3.0, 6.0])]
    )
    assert merged["slowest_rank"] == {"step": 2.0, "compute": 1.0, "sync_noop": 1.1, "step_min": 0.7, "step_max": 9.0}
    assert merged["comm_s"] == [3.0, 5.0] and merged["step_by_round"] == [1.0, 3.0, 2.0]
    assert merged["global_batch"] == 64
    # Per round: compute + 0.1 of overhead + the round's all_reduce time at 200 bytes.
    assert merged["predicted_by_round"] == pytest.approx([0.5 + 0.1 + 5.0, 1.5 + 0.1 + 4.0, 1.0 + 0.1 + 6.0])


def test_bottleneck_names_communication_and_its_kind():
    row = {
        "workers": 2,
        "nodes": 2,
        "allreduce": "builtin",
        "gradient_bytes": 159_040,
        "step_s": {"median": 1e-3},
        "breakdown_s": {
            "data": 0.05e-3,
            "forward": 0.1e-3,
            "backward": 0.1e-3,
            "optimizer": 0.05e-3,
            "exposed_comm": 0.7e-3,
        },
        "comm_fit": {"alpha_s": 400e-6, "beta_s_per_byte": 1e-9, "allreduce_gradient_s": 560e-6},
    }
    text = bottleneck(row, cores=2)
    assert text.startswith("communication: 70% of the step is all_reduce (builtin) between emulated hosts")
    assert "latency-bound" in text
    row["breakdown_s"] = {**row["breakdown_s"], "backward": 0.6e-3, "exposed_comm": 0.2e-3}
    row["workers"] = 4
    text = bottleneck(row, cores=2)
    assert text.startswith("compute: ") and "most of it backward" in text and "4 workers share 2 cores" in text


# --- the real thing ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.cluster  # nodes=2 creates network namespaces
@pytest.mark.timeout(300)
def test_smoke_run_through_the_cli_writes_consistent_outputs(tmp_path):
    code, stdout = run_main("bench", "scaling", "smoke=true", "threads=1", f"output_dir={tmp_path}")  # in-process
    assert code == 0
    (json_path,) = tmp_path.glob("scaling-mlp-*-smoke.json")
    stem = json_path.with_suffix("")
    assert stem.with_suffix(".png").stat().st_size > 10_000
    report = json.loads(json_path.read_text())
    rows = report["rows"]
    assert [(r["workers"], r["nodes"], r["allreduce"]) for r in rows] == [
        (1, 1, "none"),
        (2, 1, "builtin"),
        (2, 1, "shm"),
        (2, 2, "builtin"),
        (2, 2, "shm"),
    ]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["efficiency"] == pytest.approx(1.0)
    for r in rows:
        assert set(r["breakdown_s"]) == set(PARTS) and all(v >= 0 for v in r["breakdown_s"].values())
        assert r["step_s"]["min"] <= r["step_s"]["median"] <= r["step_s"]["max"]
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] / r["step_s"]["median"])
        assert r["global_batch"] == 64 and r["batch_per_worker"] == 64 // r["workers"]
        assert r["gradient_bytes"] == 4 * (784 * 50 + 50 + 50 * 10 + 10)
        assert r["grad_sync"] == ("none" if r["workers"] == 1 else "flat")  # what ddpkit train uses for W1
        if r["workers"] > 1:
            fit = r["comm_fit"]
            assert len(fit["sizes"]) == len(fit["seconds"]) >= 3 and fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] >= 0
            assert r["sync_overhead_s"] >= 0
            # One round (smoke): the prediction is the round's own compute + overhead + t(gradient bytes).
            assert r["predicted_by_round_s"] == [r["predicted_step_s"]]
            assert r["predicted_step_s"] == pytest.approx(
                r["compute_s"] + r["sync_overhead_s"] + fit["allreduce_gradient_s"]
            )
    # The projection's compute comes from the 1-worker run's batch ladder 64, 32, ..., 1.
    assert [int(b) for b in rows[0]["compute_by_batch_s"]] == [1, 2, 4, 8, 16, 32, 64]
    for network in report["projection"]["networks"]:
        assert network["points"][0]["speedup"] == pytest.approx(1.0) and network["limit"]["best_world_size"] >= 1
    markdown = stem.with_suffix(".md").read_text()
    for r in rows:
        assert f"- **{r['name']}**: {r['bottleneck']}." in markdown
        assert r["bottleneck"].startswith(("communication:", "compute:"))
    assert f"![scaling plots]({stem.name}.png)" in markdown
    assert "stops scaling at about" in markdown
    # The terminal table: a line per configuration.
    for r in rows:
        assert r["name"] in stdout
