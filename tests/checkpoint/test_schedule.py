"""The save schedule as a pure function: steps, loader positions, signals and options in; saves out.

No process group, no files, no loader: positions are plain values.
"""

from __future__ import annotations

import signal

from ddpkit.checkpoint.manager.schedule import Save, SaveSchedule
from ddpkit.data.position import LoaderPosition

STEPS = 4  # batches per epoch in these tests


def at(epoch: int, step: int, done: bool = False) -> LoaderPosition:
    return LoaderPosition(epoch=epoch, step_in_epoch=step, steps_per_epoch=STEPS, epoch_done=done)


def run_epoch(schedule: SaveSchedule, epoch: int, first_step: int, signal_at: int = 0) -> list[tuple[str, int, Save]]:
    """Drive one epoch as a loop does: a boundary before each batch, step() after it, a boundary at the end."""
    events, step = [], first_step
    for i in range(STEPS):
        if (save := schedule.at_boundary(step, at(epoch, i))) is not None:
            events.append(("boundary", step, save))
            schedule.saved(step) if save.reason else None
        step += 1
        sig = signal.SIGTERM if step == signal_at else 0
        if schedule.needs_step_event(step, at(epoch, i + 1).batches_exhausted) or sig:
            if (save := schedule.on_step(step, at(epoch, i + 1), sig, False)) is not None:
                events.append(("step", step, save))
        schedule.plan(step, agreement_step=10**9)
    if (save := schedule.at_boundary(step, at(epoch, STEPS))) is not None:  # the loop runs out of batches
        events.append(("boundary", step, save))
        schedule.saved(step) if save.reason else None
    return events


def test_an_epoch_end_waits_for_the_code_after_the_batch_loop_and_is_written_once():
    schedule = SaveSchedule(every_steps=0, on_epoch_end=True, at_boundaries=True)
    assert run_epoch(schedule, 0, 0) == []  # nothing written when the batches run out
    assert schedule.pending_at(4) and schedule.pending_reason == "epoch_end"
    # The code after the batch loop runs (no boundary); then the next epoch's first boundary writes it.
    assert schedule.at_boundary(4, at(1, 0)) == Save("epoch_end")
    schedule.saved(4)
    assert not schedule.pending_at(4)
    assert run_epoch(schedule, 1, 4) == []
    assert schedule.at_close(8) == Save("epoch_end")  # the last epoch's, at close()


def test_a_loop_that_ran_out_of_an_epoch_writes_it_at_its_next_boundary_as_well():
    schedule = SaveSchedule(every_steps=0, on_epoch_end=True, at_boundaries=True)
    run_epoch(schedule, 0, 0)
    assert schedule.at_boundary(4, at(0, STEPS, done=True)) == Save("epoch_end")  # e.g. a peek: next(iter(loader))


def test_every_steps_at_an_epoch_s_last_step_also_waits_for_that_epoch_s_code():
    schedule = SaveSchedule(every_steps=2, on_epoch_end=False, at_boundaries=True)
    events = run_epoch(schedule, 0, 0)
    assert events == [("boundary", 2, Save("every_steps"))]  # step 2: at the boundary before batch 3
    assert schedule.pending_at(4) and schedule.pending_reason == "every_steps"
    assert schedule.at_boundary(4, at(1, 0)) == Save("every_steps")


def test_a_preemption_at_an_epoch_s_last_step_is_written_when_the_batches_run_out_then_exits():
    schedule = SaveSchedule(every_steps=0, on_epoch_end=True, at_boundaries=True)
    events = run_epoch(schedule, 0, 0, signal_at=4)
    assert events == [("boundary", 4, Save("preempted", signal.SIGTERM))]


def test_a_preemption_mid_epoch_is_written_at_the_next_boundary():
    schedule = SaveSchedule(every_steps=0, on_epoch_end=True, at_boundaries=True)
    events = run_epoch(schedule, 0, 0, signal_at=2)
    assert events[0] == ("boundary", 2, Save("preempted", signal.SIGTERM))


def test_a_preemption_at_a_step_already_saved_only_exits():
    schedule = SaveSchedule(every_steps=2, on_epoch_end=False, at_boundaries=True)
    schedule.on_step(2, at(0, 2), 0, False)
    schedule.saved(2)  # e.g. a save() the loop called itself
    schedule.on_step(2, at(0, 2), signal.SIGUSR1, False)
    assert schedule.at_boundary(2, at(0, 2)) == Save("", signal.SIGUSR1)


def test_without_a_loader_a_due_save_is_written_at_step():
    schedule = SaveSchedule(every_steps=3, on_epoch_end=True, at_boundaries=False)
    decided = {step: schedule.on_step(step, None, 0, False) for step in range(1, 8)}
    assert decided == {1: None, 2: None, 3: Save("every_steps"), 4: None, 5: None, 6: Save("every_steps"), 7: None}
    assert schedule.on_step(8, None, 0, True) == Save("every_seconds")
    assert schedule.on_step(9, None, signal.SIGTERM, False) == Save("preempted", signal.SIGTERM)


def test_step_consults_the_schedule_only_at_agreements_cadences_and_epoch_ends():
    schedule = SaveSchedule(every_steps=100, on_epoch_end=True, at_boundaries=True)
    schedule.plan(0, agreement_step=40)
    assert schedule.next_check == 40
    assert not schedule.needs_step_event(39, at(0, 2).batches_exhausted)
    assert schedule.needs_step_event(40, at(0, 3).batches_exhausted)
    assert schedule.needs_step_event(7, at(0, STEPS).batches_exhausted)  # an epoch's last batch, whatever the cadence
    schedule.plan(40, agreement_step=500)
    assert schedule.next_check == 100
    off = SaveSchedule(every_steps=0, on_epoch_end=False, at_boundaries=True)
    off.plan(0, agreement_step=10**6)
    assert not off.needs_step_event(7, at(0, STEPS).batches_exhausted)


def test_a_new_best_without_an_epoch_end_due_is_deferred_to_the_next_boundary():
    schedule = SaveSchedule(every_steps=0, on_epoch_end=False, at_boundaries=True)
    run_epoch(schedule, 0, 0)
    assert not schedule.pending_at(4)
    schedule.defer(4, 0, "epoch_end")  # epoch_end(metrics) found a better metric
    assert schedule.at_boundary(4, at(0, STEPS)) is None  # the epoch's code has not ended yet
    assert schedule.at_boundary(4, at(1, 0)) == Save("epoch_end")
