"""``ddpkit bench train``: the configuration matrix (with the own-loop rows), and a real smoke run through the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ddpkit.bench.train import OWN_SAMPLES, OWN_TENSORS, OWN_TORCH, TrainBenchConfig, _configurations, _ratios
from ddpkit.keyvalue import ConfigError, parse
from tests.bench.in_process import run_main


def test_matrix_crosses_allreduce_and_grad_sync_for_several_workers_only():
    cfg = parse(TrainBenchConfig, ["smoke=true"])  # the defaults: a smoke run changes sizes, not the matrix
    ddpkit_rows = [
        "bare loop",
        "ddpkit 1 worker",
        "ddpkit 2 workers, allreduce=auto, grad_sync=auto",
        "ddpkit 2 workers, allreduce=auto, grad_sync=ddp",
        "ddpkit 2 workers, allreduce=builtin, grad_sync=auto",
        "ddpkit 2 workers, allreduce=builtin, grad_sync=ddp",
    ]
    assert [r["name"] for r in _configurations(cfg)] == [*ddpkit_rows, OWN_TENSORS, OWN_SAMPLES, OWN_TORCH]
    assert [r["name"] for r in _configurations(dataclasses.replace(cfg, own_loop=False))] == ddpkit_rows
    assert [r["name"] for r in _configurations(dataclasses.replace(cfg, workers=[1], own_loop=False))] == ddpkit_rows[
        :2
    ]


@pytest.mark.parametrize(
    "word, message",
    [
        ("grad_sync=[bogus]", "grad_sync='bogus' is not valid; choose one of: auto, ddp, flat, manual"),
        ("allreduce=[rng]", "allreduce='rng' is not valid; choose one of: auto, builtin, naive, ring"),
    ],
)
def test_bad_names_are_refused_before_any_run(word, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse(TrainBenchConfig, [word])


SMOKE_WORDS = (
    "smoke=true",
    "allreduce=[auto,builtin]",
    "grad_sync=[ddp]",
    "t2=true",
    "t5_seeds=[3]",
    "t9=true",
    "t10=true",
)
"""One smoke run for every check: 1 and 2 workers, both all_reduce words with a gradient sync that is not the
default (so that both words must reach ``ddpkit train``), the own loops, T2, T5, T9 and T10. (What grad_sync=auto
resolves to for W1 is checked through the trainer by test_scaling's smoke run.)"""


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``ddpkit bench train SMOKE_WORDS`` (in-process; every configuration in a fresh process, as always)."""
    folder = tmp_path_factory.mktemp("train")
    code, _ = run_main("bench", "train", *SMOKE_WORDS, f"output_dir={folder}")
    assert code == 0
    (json_path,) = folder.glob("train-mlp-*-smoke.json")
    return json_path, json.loads(json_path.read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)  # (the module's smoke run starts here: 14 configurations, each in a fresh process)
def test_smoke_run_writes_times_ratios_and_what_auto_chose(smoke_run):
    json_path, report = smoke_run
    results = {r["name"]: r for r in report["results"]}
    assert len(results) == 7  # bare loop, 1 + 2 ddpkit runs, 3 own loops on the public API
    for r in results.values():
        t = r["train_time_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
    # On one CPU node, auto means shared memory (and, for W1's 155 KiB of gradients, one flat all_reduce: see
    # test_scaling); the words given reach ddpkit train.
    auto = results["ddpkit 2 workers, allreduce=auto, grad_sync=ddp"]
    assert (auto["resolved_allreduce"], auto["resolved_grad_sync"]) == ("shm", "ddp")
    stock = results["ddpkit 2 workers, allreduce=builtin, grad_sync=ddp"]
    assert (stock["resolved_allreduce"], stock["resolved_grad_sync"]) == ("builtin", "ddp")
    ratios = report["ratios"]
    assert ratios["T1 ddpkit 1 worker / bare loop"] == pytest.approx(
        results["ddpkit 1 worker"]["train_time_s"]["median"] / results["bare loop"]["train_time_s"]["median"]
    )
    assert sum(name.startswith("ddpkit 2 workers") and name.endswith(" / ddpkit 1 worker") for name in ratios) == 2
    assert ratios["T6 own loop (public API, tensors) / bare loop"] == pytest.approx(
        results[OWN_TENSORS]["train_time_s"]["median"] / results["bare loop"]["train_time_s"]["median"]
    )
    assert ratios[
        "T7 ddpkit.DataLoader / torch DataLoader + DistributedSampler (2 workers, num_workers=2)"
    ] == pytest.approx(results[OWN_SAMPLES]["train_time_s"]["median"] / results[OWN_TORCH]["train_time_s"]["median"])
    assert "| ratio (medians, same run) | value |" in json_path.with_suffix(".md").read_text()


def test_ratios_leave_out_what_was_not_run():
    def row(name, median):
        return {"name": name, "train_time_s": {"median": median}}

    # workers=[1] own_loop=false: T1 alone; no own loop on one side of T7: no T7.
    assert _ratios([row("bare loop", 2.0), row("ddpkit 1 worker", 2.2)]) == {
        "T1 ddpkit 1 worker / bare loop": pytest.approx(1.1)
    }
    assert _ratios([row("bare loop", 2.0), row(OWN_TENSORS, 2.1), row(OWN_SAMPLES, 1.0)]) == {
        "T6 own loop (public API, tensors) / bare loop": pytest.approx(1.05)
    }


def test_restated_targets_compare_in_their_direction():
    from ddpkit.bench.train import T2_W1, T2_W2, T5_GAP, _target

    assert _target(T2_W2, 0.9)["met"] and not _target(T2_W2, 0.8)["met"]
    assert _target(T2_W1, 1.1)["met"] and not _target(T2_W1, 1.2)["met"]
    assert _target(T5_GAP, 0.1) == {"value": 0.1, "target": "<= 0.2", "met": True}


@pytest.mark.slow
@pytest.mark.timeout(600)  # (when run alone, the smoke run starts here)
def test_smoke_run_reports_t2_and_t5(smoke_run):
    from ddpkit.bench.train import T2_W1, T2_W2, T2_W2_KEPT, T5_GAP, T5_ONE, T5_TWO

    json_path, report = smoke_run
    t2 = report["t2"]["stats"]
    assert report["t2"]["targets"][T2_W2]["value"] == pytest.approx(
        t2["w2_ddpkit"]["median"] / t2["w2_ceiling"]["median"]
    )
    assert report["t2"]["targets"][T2_W1]["value"] == pytest.approx(
        t2["w1_ddpkit_step"]["median"] / t2["w1_ceiling_step"]["median"]
    )
    assert report["t2"]["targets"][T2_W2_KEPT]["value"] == pytest.approx(
        t2["w2_ddpkit"]["median"] / t2["w2_ceiling_kept"]["median"]
    )
    assert all(t2[key]["median"] > 0 for key in t2)
    t5 = report["t5"]
    assert t5["seeds"] == [3] and all(len(values) == 1 for values in t5["accuracy"].values())
    # One seed, same batches on 1 and 2 workers and in the bare loop: the same model, the same accuracy.
    (one,), (two,), (bare,) = t5["accuracy"].values()
    assert one == two == pytest.approx(bare, abs=1e-6)  # (the bare loop's mean is float32)
    assert t5["targets"][T5_ONE]["value"] == pytest.approx(100 * t5["accuracy"]["ddpkit 1 worker"][0])
    assert t5["targets"][T5_GAP]["value"] == pytest.approx(0.0, abs=1e-4)
    assert T5_TWO in json_path.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)  # (when run alone, the smoke run starts here)
def test_smoke_run_reports_t9_and_t10(smoke_run):
    from ddpkit.bench.train import T9_W1, T10

    json_path, report = smoke_run
    t9 = report["t9"]
    assert list(t9["walls_s"]) == [T9_W1] and all(len(walls) == 1 for walls in t9["walls_s"][T9_W1].values())
    walls = t9["walls_s"][T9_W1]
    assert t9["targets"][T9_W1]["value"] == pytest.approx(walls["nproc=2"][0] / walls["nproc=1"][0])
    t10 = report["t10"]
    assert t10["files_identical"] is True  # one synchronous and one async save of the same state
    assert set(t10["windows_s"]) == {"none", "sync", "async"} and all(len(w) == 1 for w in t10["windows_s"].values())
    assert t10["targets"][T10]["value"] == pytest.approx(
        t10["lost_per_save_s"]["async"] / t10["lost_per_save_s"]["sync"]
    )
    markdown = json_path.with_suffix(".md").read_text()
    assert "## T9" in markdown and "## T10" in markdown and T10 in markdown


def test_only_the_targets_asked_for_run_without_the_matrix():
    from ddpkit.bench.train import run_train_benchmark

    report = run_train_benchmark(parse(TrainBenchConfig, ["matrix=false", "smoke=true"]))
    assert (report["results"], report["ratios"]) == ([], {})
