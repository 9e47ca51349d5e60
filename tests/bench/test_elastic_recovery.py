"""T15's elastic recovery benchmark: the parts of a recovery from the workers' events, the per-sample check, the
report, and one real run of each launch on two emulated nodes (network namespaces, the tests' 10.77.0.x)."""

from __future__ import annotations

import pytest

from ddpkit.bench.elastic_recovery import (
    PARTS,
    RecoverySpec,
    build_report,
    each_sample_once,
    recovery_parts,
    render_markdown,
    run_once,
)
from tests.helpers.netns import ADDRESSES

KILL = 100.0


def step(t, number, world_size=2, round_="r1", epoch=0, indices=()):
    return {"event": "step", "t": t, "step": number, "world_size": world_size, "round": round_, "epoch": epoch,
            "indices": list(indices)}  # fmt: skip


def test_the_parts_of_a_recovery_are_the_gaps_between_the_survivors_events_and_add_up():
    events = [
        step(99.0, 21),
        step(99.5, 22),
        step(100.2, 23),  # its all_reduce ended before the kill: not the recovery's first step
        {"event": "failed", "t": 100.3, "step": 23},
        {"event": "start", "t": 131.3},
        {"event": "init", "t": 132.0},
        {"event": "loaded", "t": 132.5, "step": 20},
        step(132.6, 21, world_size=1),
    ]

    parts = recovery_parts(events, KILL)

    assert parts == {
        "detection": pytest.approx(0.3),
        "rendezvous": pytest.approx(31.0),
        "restart": pytest.approx(0.7),
        "checkpoint": pytest.approx(0.5),
        "first_step": pytest.approx(0.1),
        "total": pytest.approx(32.6),
        "steps_redone": 2.0,
    }
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["total"])


def test_a_launcher_that_keeps_its_workers_merges_the_missing_parts_into_the_next():
    events = [step(99.0, 7), {"event": "init", "t": 101.0}, {"event": "loaded", "t": 101.5}, step(102.0, 6, 1)]

    parts = recovery_parts(events, KILL)

    assert parts["detection"] is None and parts["rendezvous"] is None
    assert parts["restart"] == pytest.approx(1.0) and parts["total"] == pytest.approx(2.0)


def test_no_step_at_the_smaller_size_is_an_error():
    with pytest.raises(ValueError, match="no step at a smaller world size"):
        recovery_parts([step(99.0, 1), step(101.0, 2)], KILL)


def test_a_redone_step_replaces_the_lost_one_and_a_sample_twice_is_caught():
    first = [step(1, 1, indices=[0, 1]), step(2, 1, indices=[2, 3], round_="r1"), step(3, 2, indices=[4, 5])]
    redone = [step(5, 2, world_size=1, round_="r2", indices=[4, 5, 6, 7])]
    epoch_1 = [step(6, 3, world_size=1, round_="r2", epoch=1, indices=[3, 1])]

    assert each_sample_once(first + redone + epoch_1, num_samples=8)
    assert not each_sample_once(first + [step(5, 2, 1, "r2", indices=[0, 5, 6, 7])] + epoch_1, num_samples=8)
    assert not each_sample_once(first + epoch_1, num_samples=8)  # epoch 0 lost samples 6 and 7


def test_the_report_shows_the_medians_and_the_ratio():
    rows = [
        {"round": 0, "launch": launch, "returncode": 0, **dict.fromkeys(PARTS, 1.0), "total": total,
         "steps_redone": 2.0, "each_sample_once": launch == "ddpkit"}
        for launch, total in (("ddpkit", 30.0), ("torchrun", 40.0), ("ddpkit", 34.0), ("torchrun", 44.0))
    ]  # fmt: skip

    report = build_report(rows, RecoverySpec(), "python benchmarks/elastic_recovery.py --rounds 2")

    assert report["medians"]["ddpkit"]["total"] == 32.0 and report["ratio_ddpkit_over_torchrun"] == 0.762
    page = render_markdown(report)
    assert "| total | 32.00 | 42.00 |" in page and "Ratio ddpkit / torchrun (median totals): 0.76" in page
    assert "| of those, each sample of an epoch once | 2 | 0 |" in page


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launch", ["ddpkit", "torchrun"])
def test_a_real_run_loses_node_b_and_node_a_goes_on_alone(launch, tmp_path):
    spec = RecoverySpec(steps=30, kill_after=12, last_call=1, timeout=150)

    row = run_once(launch, spec, tmp_path / launch, ADDRESSES)

    assert row["returncode"] == 0, row
    assert row["final_world_size"] == 1 and 0 < row["total"] < 60, row
    assert row["detection"] is not None and row["detection"] < 5, row
    # ddpkit's loader keeps every epoch's samples and order at the new size; a plain DistributedSampler does not.
    assert row["each_sample_once"] is (launch == "ddpkit"), row
