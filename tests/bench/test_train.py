"""``ddpkit bench train``: the configuration matrix (with the own-loop rows), and a real smoke run through the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ddpkit.bench.train import OWN_SAMPLES, OWN_TENSORS, OWN_TORCH, TrainBenchConfig, _configurations
from ddpkit.config import ConfigError, parse
from tests.cli_runner import run_ddpkit


def test_matrix_crosses_allreduce_and_grad_sync_for_several_workers_only():
    cfg = TrainBenchConfig(workers=[1, 2], allreduce=["auto", "builtin"], grad_sync=["auto", "ddp"])
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


@pytest.mark.parametrize("word, message", [
    ("grad_sync=[bogus]", "grad_sync='bogus' is not valid; choose one of: auto, ddp, flat, manual"),
    ("allreduce=[rng]", "allreduce='rng' is not valid; choose one of: auto, builtin, naive, ring"),
])
def test_bad_names_are_refused_before_any_run(word, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse(TrainBenchConfig, [word])


@pytest.mark.slow
def test_smoke_run_writes_times_ratios_and_what_auto_chose(tmp_path):
    out = run_ddpkit("bench", "train", "smoke=true", f"output_dir={tmp_path}", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("train-mlp-*-smoke.json")
    report = json.loads(json_path.read_text())
    results = {r["name"]: r for r in report["results"]}
    assert len(results) == 9  # bare loop, 1 + 4 ddpkit runs, 3 own loops on the public API
    for r in results.values():
        t = r["train_time_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
    # On one CPU node, auto means shared memory and, for W1's 155 KiB of gradients, one flat all_reduce.
    auto = results["ddpkit 2 workers, allreduce=auto, grad_sync=auto"]
    assert (auto["resolved_allreduce"], auto["resolved_grad_sync"]) == ("shm", "flat")
    stock = results["ddpkit 2 workers, allreduce=builtin, grad_sync=ddp"]
    assert (stock["resolved_allreduce"], stock["resolved_grad_sync"]) == ("builtin", "ddp")
    ratios = report["ratios"]
    assert ratios["T1 ddpkit 1 worker / bare loop"] == pytest.approx(
        results["ddpkit 1 worker"]["train_time_s"]["median"] / results["bare loop"]["train_time_s"]["median"])
    assert sum(name.startswith("ddpkit 2 workers") and name.endswith(" / ddpkit 1 worker") for name in ratios) == 4
    assert ratios["T6 own loop (public API, tensors) / bare loop"] == pytest.approx(
        results[OWN_TENSORS]["train_time_s"]["median"] / results["bare loop"]["train_time_s"]["median"])
    assert ratios["T7 ddpkit.DataLoader / torch DataLoader + DistributedSampler (2 workers, num_workers=2)"] == \
        pytest.approx(results[OWN_SAMPLES]["train_time_s"]["median"] / results[OWN_TORCH]["train_time_s"]["median"])
    assert "| ratio (medians, same run) | value |" in json_path.with_suffix(".md").read_text()
