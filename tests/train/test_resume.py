"""Resuming: bit-exact at any step, corrupt checkpoints skipped loudly, other world sizes sample-exact."""

import random

import pytest
import torch

from ddpkit.checkpoint.disk.format import CORRUPT_SUFFIX, CheckpointError, checkpoint_name, list_checkpoints, load_file
from ddpkit.train.config import parse_train_config
from ddpkit.train.preflight import check_before_launch
from tests.helpers.workers import DYNAMO, run_on_ranks, warm_workers
from tests.train.checkpoint_helpers import LogRecords, assert_bit_equal, close, final_state, make_trainer, train
from tests.train.test_checkpoint import plant_payload

# 90 samples, global batch 8: 12 steps per epoch, the last one of 2 samples (split 1 + 1 on 2 ranks).
WORDS = [
    "model=tests.train.checkpoint_helpers:mlp_dropout",
    "synthetic_samples=90",
    "batch_size=8",
    "epochs=2",
    "checkpoint.every_steps=5",
]
STEPS_PER_EPOCH = 12


def stop_and_resume(rank, world_size, tmp, stops, words=WORDS) -> dict:
    """Train ``words`` uninterrupted, then stopped at each of ``stops`` and resumed: every resumed run ends
    bit-equal to the uninterrupted one. Returns the checkpoints resumed from and the run's gradient sync."""
    full, _ = train(rank, world_size, [*words, f"output_dir={tmp}/full"])
    reference = final_state(full)
    resumed_from = []
    for stop in stops:
        out = f"output_dir={tmp}/stop{stop}"
        stopped, _ = train(rank, world_size, [*words, out, f"max_steps={stop}"])
        assert stopped.state.global_step == stop
        resumed, start = train(rank, world_size, [*words, out, "resume=auto"])
        resumed_from.append(start.name)
        assert_bit_equal(final_state(resumed), reference, f"stopped at step {stop}")
    return {"resumed_from": resumed_from, "grad_sync": full.grad_sync}


@pytest.mark.slow
def test_stop_anywhere_and_resume_is_bit_exact(tmp_path, seed):
    rng = random.Random(seed)
    mid_epoch = rng.randrange(1, STEPS_PER_EPOCH)  # 1..11: inside the first epoch
    later = rng.randrange(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH)  # inside the second
    stops = [mid_epoch, STEPS_PER_EPOCH, later]  # and exactly at the epoch boundary
    print(f"stops at global steps {stops}")
    with warm_workers(DYNAMO):  # the ranks build optimizers: torch._dynamo imported once, in the server
        results = run_on_ranks(stop_and_resume, 2, str(tmp_path), stops, timeout=240)
    resumed_from = [result["resumed_from"] for result in results]
    assert resumed_from[0] == resumed_from[1] == [checkpoint_name(s) for s in stops], f"seed {seed}: stops {stops}"


# -- corrupt and unsafe checkpoints (one process, no process group) ----------------


def _checkpointed_run(tmp_path, *extra):
    train(0, 1, [*WORDS, f"output_dir={tmp_path}", "max_steps=7", "checkpoint.every_steps=3", *extra])
    return tmp_path / "checkpoints"


def test_truncated_newest_falls_back_with_a_warning_naming_it(tmp_path):
    root = _checkpointed_run(tmp_path)
    assert [i.path.name for i in list_checkpoints(root)] == [checkpoint_name(6), checkpoint_name(7)]
    newest = root / checkpoint_name(7) / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with LogRecords() as logs:
        trainer, start = train(0, 1, [*WORDS, f"output_dir={tmp_path}", "resume=auto"])
    assert start == root / checkpoint_name(6)
    warnings = "\n".join(logs.warnings())
    assert f"{newest} is truncated" in warnings, warnings
    assert f"using the previous good one, {root / checkpoint_name(6)}" in warnings, warnings
    assert (root / (checkpoint_name(7) + CORRUPT_SUFFIX)).is_dir()  # kept for inspection, never loaded again
    assert (trainer.loader.epoch, trainer.loader.step_in_epoch) == (1, STEPS_PER_EPOCH)  # 2 epochs complete
    assert trainer.state.global_step == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("schedule", ["constant", "cosine", "cosine warmup_steps=3", "onecycle"])
def test_a_resume_with_a_new_lr_and_weight_decay_trains_with_them(tmp_path, schedule):
    """``resume=auto lr=...`` (the advice after a divergence) takes effect: the optimizer's restored groups
    would otherwise keep the checkpoint's rate; a schedule goes on from where it was, scaled."""
    import shutil

    from ddpkit import distributed

    words = [*WORDS, *f"lr_schedule={schedule}".split(), "lr=0.01"]
    train(0, 1, [*words, f"output_dir={tmp_path / 'a'}", "max_steps=7"])
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    def resumed_rates(folder, *changes):
        trainer = make_trainer(0, 1, [*words, f"output_dir={folder}", "resume=auto", *changes])
        try:
            group = trainer.optimizer.param_groups[0]
            rates = [group["lr"]]
            for _ in range(3 if trainer.scheduler is not None else 0):
                trainer.optimizer.step()
                trainer.scheduler.step()
                rates.append(group["lr"])
            return rates, group["weight_decay"]
        finally:
            close(trainer)
            distributed.shutdown()

    same, _ = resumed_rates(tmp_path / "a")
    changed, weight_decay = resumed_rates(tmp_path / "b", "lr=0.001", "weight_decay=0.5")
    assert changed == pytest.approx([rate / 10 for rate in same], rel=1e-9)
    assert weight_decay == 0.5


@pytest.mark.parametrize("schedule", ["cosine warmup_steps=3", "onecycle"])
def test_a_run_stopped_by_max_steps_resumes_its_schedule_exactly(tmp_path, schedule):
    """max_steps stops a run; it does not shorten its schedule (a OneCycleLR of 7 steps failed at step 8 of
    the resumed run, a cosine of 7 steps rose again)."""
    words = [*WORDS, *f"lr_schedule={schedule}".split(), "lr=0.01"]
    whole, _ = train(0, 1, [*words, f"output_dir={tmp_path / 'whole'}"])
    train(0, 1, [*words, f"output_dir={tmp_path / 'stopped'}", "max_steps=7"])
    resumed, _ = train(0, 1, [*words, f"output_dir={tmp_path / 'stopped'}", "resume=auto"])
    assert_bit_equal(final_state(resumed), final_state(whole), f"{schedule}, stopped at step 7")


def test_crafted_pickle_is_refused_strictly_and_skipped_by_auto(tmp_path):
    root = _checkpointed_run(tmp_path)
    sentinel = tmp_path / "sentinel"
    plant_payload(root / checkpoint_name(7), sentinel, "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"refused to load .*optimizer\.pt"):
        train(0, 1, [*WORDS, f"output_dir={tmp_path}", f"resume={root / checkpoint_name(7)}"])
    assert not sentinel.exists()
    with LogRecords() as logs:
        _, start = train(0, 1, [*WORDS, f"output_dir={tmp_path}", "resume=auto", "epochs=1"])
    assert start == root / checkpoint_name(6)
    assert any("refused to load" in w and "optimizer.pt" in w for w in logs.warnings())
    assert not sentinel.exists()


def test_all_corrupt_is_an_error_never_a_fresh_start(tmp_path):
    root = _checkpointed_run(tmp_path)
    for info in list_checkpoints(root):
        (info.path / "train.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies"):
        train(0, 1, [*WORDS, f"output_dir={tmp_path}", "resume=auto"])


def test_fresh_start_refuses_a_folder_with_checkpoints_but_a_restart_resumes(tmp_path, monkeypatch):
    _checkpointed_run(tmp_path)
    with pytest.raises(CheckpointError, match="already holds checkpoints .* resume=auto"):
        train(0, 1, [*WORDS, f"output_dir={tmp_path}"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the Checkpointer reads the process environment
    _, start = train(0, 1, [*WORDS, f"output_dir={tmp_path}"])
    assert start.name == checkpoint_name(7)


def test_a_requeued_slurm_job_passes_the_launchers_check_and_resumes(tmp_path, monkeypatch):
    _checkpointed_run(tmp_path)
    cfg = parse_train_config([*WORDS, f"output_dir={tmp_path}"])
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        check_before_launch(cfg, 1)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # sbatch --requeue: the same words again, resume=never
    check_before_launch(cfg, 1)


def test_interrupted_write_alone_means_a_fresh_start(tmp_path):
    (tmp_path / "checkpoints" / checkpoint_name(4)).mkdir(parents=True)  # a first save that never finished
    with LogRecords() as logs:
        trainer, start = train(0, 1, [*WORDS, f"output_dir={tmp_path}", "resume=auto", "epochs=1"])
    assert start is None and trainer.state.global_step == STEPS_PER_EPOCH
    assert any("no checkpoint in" in m and "starting from the beginning" in m for _, m in logs.messages)


# -- another world size: the same global sample order ---------------------------


def _phases(rank, world_size, phases):
    """Run each (words, record) phase in turn; return the sample indices each rank trained on, and warnings."""
    results = []
    for words in phases:
        with LogRecords() as logs:
            trainer = make_trainer(rank, world_size, words, with_indices=True)  # batches are (x, y, index)
            seen = []
            train_step = trainer.train_step

            def recording(batch, train_step=train_step, seen=seen):
                seen.extend(batch[2].tolist())
                return train_step(batch)

            trainer.train_step = recording
            try:
                trainer.fit()
            finally:
                close(trainer)
        results.append((seen, logs.warnings()))
    return results


@pytest.mark.slow
def test_other_world_size_sees_every_sample_once(tmp_path):
    words = ["model=tests.train.checkpoint_helpers:mlp_dropout", "synthetic_samples=90", "batch_size=8", "epochs=1"]
    a, b = f"output_dir={tmp_path}/a", f"output_dir={tmp_path}/b"
    # One worker needs no process group: those phases run here; the two-worker ones in worker processes.
    ((one_first, no_warnings),) = _phases(0, 1, [[*words, b, "max_steps=7"]])
    with warm_workers(DYNAMO):  # the ranks build optimizers: torch._dynamo imported once, in the server
        two = run_on_ranks(_phases, 2, [[*words, b, "resume=auto"], [*words, a, "max_steps=5"]])
    ((one_then, warnings_2_to_1),) = _phases(0, 1, [[*words, a, "resume=auto"]])

    samples_1_to_2 = one_first + two[0][0][0] + two[1][0][0]
    assert sorted(samples_1_to_2) == list(range(90))
    samples_2_to_1 = two[0][1][0] + two[1][1][0] + one_then
    assert sorted(samples_2_to_1) == list(range(90))
    for warnings in (two[0][0][1], warnings_2_to_1):
        assert any("not bit-identical" in w and "no sample skipped or repeated" in w for w in warnings), warnings
    assert no_warnings == [] and two[0][1][1] == []


def test_changed_global_batch_is_refused(tmp_path):
    _checkpointed_run(tmp_path)
    with pytest.raises(
        CheckpointError,
        match="its loader does not fit .* saved with global_batch_size=8 but this sampler has global_batch_size=16",
    ):
        train(0, 1, [*WORDS, f"output_dir={tmp_path}", "resume=auto", "batch_size=16"])


def test_resume_restores_the_optimizer_state_on_the_parameters_device_and_dtype(tmp_path):
    """The optimizer's state after a resume is the checkpoint's, bit for bit, shaped and placed like its parameter.

    On CPU this shows the state is loaded at all (a fresh Adam has none); that
    it moves to a CUDA parameter's device is tests/gpu/test_checkpoint.py's
    test_cpu_checkpoint_resumes_with_the_optimizer_state_on_the_gpu.
    """
    root = _checkpointed_run(tmp_path)
    saved = load_file(root / checkpoint_name(7) / "optimizer.pt")["state"]
    trainer, _ = train(
        0,
        1,
        [
            *WORDS,
            f"output_dir={tmp_path}",
            f"resume={root / checkpoint_name(7)}",
            "max_steps=7",
            "checkpoint.enabled=false",
        ],
    )
    assert trainer.state.global_step == 7  # resumed at its step, nothing trained since
    restored = trainer.optimizer.state_dict()["state"]
    params = list(trainer.module.parameters())
    assert sorted(restored) == sorted(saved) == list(range(len(params)))
    for index, param in enumerate(params):
        assert restored[index].keys() == saved[index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            value = trainer.optimizer.state[param][key]
            assert (value.device, value.dtype, value.shape) == (param.device, param.dtype, param.shape)
            assert torch.equal(value, saved[index][key]), f"parameter {index} {key}"
        assert torch.equal(restored[index]["step"], saved[index]["step"]) and saved[index]["step"].item() == 7
