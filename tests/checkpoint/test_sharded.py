"""Sharded checkpoints (shard=True): every rank writes its shards, resume is exact, and reshards to another size.

Real gloo runs: 2 ranks trained without a stop and with one (a new
Checkpointer resuming from the folder), which must end bit-equal; a
checkpoint written by 4 ranks, resumed by 2 that train on; then, in this
process, what rank 0 checks on disk: the manifest lists every rank's files,
a folder without its manifest or with a damaged shard is never resumed, and
a plain model (no process group) resumes a sharded checkpoint.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.checkpoint.disk.format import MANIFEST, CheckpointError, list_checkpoints, read_manifest, verify_checkpoint
from tests.comm.test_fsdp import Tower
from tests.helpers.module_runs import run_side_by_side
from tests.helpers.workers import run_on_ranks

SEED = 37
TOTAL_STEPS = 8


class DropTower(Tower):
    """Tower with dropout: the resumed run must continue every rank's RNG stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.dropout(x, 0.2, self.training))


def _parts(world_size: int):
    import ddpkit

    torch.manual_seed(SEED)
    model = ddpkit.prepare_model(DropTower(), shard=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after prepare_model: the sharded parameters
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def _train_to(model, optimizer, scheduler, ckpt, rank: int, world_size: int, last_step: int) -> None:
    """Steps up to ``last_step``: the global batch of step s depends on s alone; each rank takes its slice."""
    while ckpt.global_step < last_step:
        g = torch.Generator().manual_seed(SEED + ckpt.global_step)
        x = torch.randn(8, 10, generator=g)
        mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        F.mse_loss(model(x[mine]), x[mine, :4]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ckpt.step()


def _checkpointer(folder: str, model, optimizer, scheduler, **options):
    """The tests' Checkpointer: every 4 steps, no signal handlers; ``options`` as Checkpointer's keywords."""
    import ddpkit

    return ddpkit.Checkpointer(
        folder, model=model, optimizer=optimizer, scheduler=scheduler, every_steps=4, preempt_signals=(), **options
    )


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _run(
    rank: int, world_size: int, folder: str, stop_at: int | None, last_step: int, async_save: bool = False
) -> dict:
    """Train to ``last_step`` in ``folder`` (saving every 4 steps), resuming what is there; ``stop_at``: a run
    that stops there (its Checkpointer closed) and a second that resumes and finishes."""
    import ddpkit
    import ddpkit.distributed

    ddpkit.distributed.init()
    try:
        segments = [stop_at, last_step] if stop_at else [last_step]
        resumed_at = []
        for end in segments:
            model, optimizer, scheduler = _parts(world_size)
            ckpt = _checkpointer(folder, model, optimizer, scheduler, async_save=async_save)
            start = ckpt.resume("auto")
            resumed_at.append(start.global_step)
            _train_to(model, optimizer, scheduler, ckpt, rank, world_size, end)
            ckpt.close()
        params = _full(model)  # before a forward, which leaves the root's parameters gathered
        model.eval()
        with torch.no_grad():
            out = model(torch.randn(5, 10, generator=torch.Generator().manual_seed(1)))
        return {"params": params, "resumed_at": resumed_at, "rng": torch.rand(2), "out": out}
    finally:
        ddpkit.distributed.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    jobs = {
        "whole": (_run, 2, (str(root / "whole"), None, TOTAL_STEPS), {}),
        "stopped": (_run, 2, (str(root / "stopped"), 5, TOTAL_STEPS), {}),
        "four": (_run, 4, (str(root / "four"), None, 4), {}),
        "async_stopped": (_run, 2, (str(root / "async_stopped"), 5, TOTAL_STEPS, True), {}),
    }
    outcomes = run_side_by_side(jobs, timeout=240)
    # The 4 ranks' checkpoint (step 4), resumed by 2 ranks that train 2 steps more.
    shutil.copytree(root / "four", root / "four_to_two")
    outcomes["four_to_two"] = run_on_ranks(_run, 2, str(root / "four_to_two"), None, 6, timeout=240)
    return root, outcomes


def test_a_stopped_run_resumed_ends_bit_equal(runs) -> None:
    _, outcomes = runs
    whole, stopped = outcomes["whole"].get(), outcomes["stopped"].get()
    for rank in range(2):
        assert stopped[rank]["resumed_at"] == [0, 5]  # close() wrote the stop at 5 (the cadence: step 4)
        for a, b in zip(whole[rank]["params"], stopped[rank]["params"]):
            assert torch.equal(a, b), rank
        assert torch.equal(whole[rank]["rng"], stopped[rank]["rng"])  # each rank's generator continued


def test_a_run_saving_in_the_background_stopped_and_resumed_ends_bit_equal(runs) -> None:
    root, outcomes = runs
    whole, stopped = outcomes["whole"].get(), outcomes["async_stopped"].get()
    for rank in range(2):
        assert stopped[rank]["resumed_at"] == [0, 5]
        assert all(torch.equal(a, b) for a, b in zip(whole[rank]["params"], stopped[rank]["params"])), rank
        assert torch.equal(whole[rank]["rng"], stopped[rank]["rng"])
    # The same files, the same tensors, as a synchronous save (step 4 of the stopped run is pruned: keep=2 holds
    # the stop at 5, which close() wrote, and step 8).
    for step in ("step-000000008",):
        sync, background = read_manifest(root / "whole" / step), read_manifest(root / "async_stopped" / step)
        assert sorted(sync["files"]) == sorted(background["files"])
        verify_checkpoint(root / "async_stopped" / step)
        for name in ("__0_0.distcp", "__1_0.distcp"):
            assert sync["files"][name] == background["files"][name], (step, name)


def test_every_rank_wrote_its_shards_and_the_manifest_lists_them(runs) -> None:
    root, _ = runs
    infos = [info for info in list_checkpoints(root / "whole") if info.complete]
    assert [info.global_step for info in infos] == [4, 8]
    manifest = read_manifest(infos[-1].path)
    assert manifest["sharded"] == {
        "format": "torch.distributed.checkpoint",
        "objects": ["model", "optimizer"],
        "world_size": 2,
    }
    assert sorted(manifest["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng.pt",
        "scheduler.pt",
        "train.pt",
    ]  # no model.pt: no rank gathered the full model
    assert set(verify_checkpoint(infos[-1].path)) == {"manifest", "rng.pt", "scheduler.pt", "train.pt"}
    staged = [p for p in (root / "whole").iterdir() if p.name.startswith(".") and not p.name.startswith(".ddpkit.lock")]
    assert not staged  # no staging folder left (the run's folder lock stays)


def test_a_checkpoint_of_4_ranks_resumes_at_2_and_trains_on(runs) -> None:
    _, outcomes = runs
    four, two = outcomes["four"].get(), outcomes["four_to_two"]
    assert [r["resumed_at"] for r in two] == [[4], [4]]
    for a, b in zip(two[0]["params"], four[0]["params"]):
        assert a.shape == b.shape and not torch.equal(a, b)  # trained on from the 4 ranks' weights
    assert all(torch.equal(a, b) for a, b in zip(two[0]["params"], two[1]["params"]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_plain_model_resumes_a_sharded_checkpoint_to_the_same_weights(runs, tmp_path) -> None:
    import ddpkit

    root, outcomes = runs
    torch.manual_seed(0)
    model = DropTower()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    ckpt = ddpkit.Checkpointer(root / "four", model=model, optimizer=optimizer, scheduler=scheduler, preempt_signals=())
    try:
        assert ckpt.resume("auto").global_step == 4
    finally:
        ckpt.close()
    for a, b in zip(model.parameters(), outcomes["four"].get()[0]["params"]):
        assert torch.equal(a.detach(), b)
    assert len(optimizer.state) == len(list(model.parameters()))  # Adam's moments, whole


def test_a_folder_without_manifest_or_with_a_damaged_shard_is_not_resumed(runs, tmp_path) -> None:
    from ddpkit.checkpoint.manager import select

    root, _ = runs
    folder = tmp_path / "ckpts"
    shutil.copytree(root / "whole", folder)
    (folder / "step-000000008" / MANIFEST).unlink()
    path, _ = select.choose_checkpoint(folder, "auto")
    assert path == folder / "step-000000004"
    shard = folder / "step-000000004" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__1_0.distcp is damaged: its SHA-256 does not match"):
        verify_checkpoint(folder / "step-000000004")


def test_the_export_loads_into_the_plain_module_and_gives_the_sharded_models_outputs(runs, tmp_path) -> None:
    import ddpkit

    root, outcomes = runs
    out = ddpkit.export_checkpoint(root / "whole", tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.pt"]  # the scratch buffers are gone
    state = torch.load(out / "model.pt", weights_only=True)
    model = DropTower()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        got = model(torch.randn(5, 10, generator=torch.Generator().manual_seed(1)))
    whole = outcomes["whole"].get()[0]
    assert all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), whole["params"]))  # bit for bit
    # The same outputs (up to the summation order of this process's threads; the ranks ran one thread each).
    torch.testing.assert_close(got, whole["out"], rtol=1e-6, atol=1e-6)
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes for t in state.values())


def test_init_from_a_sharded_checkpoint_reads_its_full_weights(runs) -> None:
    from ddpkit.checkpoint.publishing.transfer import read_weights

    root, outcomes = runs
    state = read_weights(root / "whole")  # a checkpoints folder: its newest verified checkpoint
    model = DropTower()
    model.load_state_dict(state)
    assert all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), outcomes["whole"].get()[0]["params"]))


def test_the_best_mark_of_a_sharded_checkpoint_holds_every_file(runs, tmp_path) -> None:
    from ddpkit.checkpoint.disk.format import mark_best

    root, _ = runs
    folder = tmp_path / "ckpts"
    shutil.copytree(root / "whole", folder)
    best = mark_best(folder, folder / "step-000000008")
    assert (best / ".metadata").is_file()  # hidden, but listed by the manifest: linked with the rest
    verify_checkpoint(best)


def _a_rank_cannot_write(rank: int, world_size: int, folder: str, async_save: bool, on_write_error: str) -> dict:
    """Rank 1's shards hit a full disk when step 4's checkpoint is saved again (replaced); with
    ``on_write_error="stop"`` every rank stops with the same one-line error, with "warn" every rank trains on
    and step 8's checkpoint is written. Which thread wrote the shards is recorded on every rank."""
    import errno
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import ddpkit
    import ddpkit.distributed
    from ddpkit.checkpoint.disk.storage import StorageError

    writing_threads = set()
    write_data = FileSystemWriter.write_data

    def recorded(self, *args, **kwargs):
        writing_threads.add(threading.current_thread().name)
        return write_data(self, *args, **kwargs)

    def full(*args, **kwargs):
        writing_threads.add(threading.current_thread().name)
        raise OSError(errno.ENOSPC, "No space left on device")

    ddpkit.distributed.init()
    FileSystemWriter.write_data = recorded
    try:
        model, optimizer, scheduler = _parts(world_size)
        ckpt = _checkpointer(folder, model, optimizer, scheduler, async_save=async_save, on_write_error=on_write_error)
        ckpt.resume("never")
        _train_to(model, optimizer, scheduler, ckpt, rank, world_size, 4)
        ckpt.wait()  # step 4's checkpoint is complete (written in the background with async_save)
        if rank == 1:
            FileSystemWriter.write_data = full
        outcome = {}
        try:
            ckpt.save()
            ckpt.wait()
            FileSystemWriter.write_data = recorded
            _train_to(model, optimizer, scheduler, ckpt, rank, world_size, 8)
            outcome["last"] = str(ckpt.wait())
        except StorageError as e:
            outcome["error"] = str(e)
        finally:
            ckpt.close()
        return {**outcome, "threads": sorted(writing_threads)}
    finally:
        ddpkit.distributed.shutdown()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_rank_that_cannot_write_its_shards_stops_every_rank_with_one_line(tmp_path, async_save) -> None:
    outcomes = run_on_ranks(_a_rank_cannot_write, 2, str(tmp_path), async_save, "stop", timeout=120)
    messages = [outcome["error"] for outcome in outcomes]
    for message in messages:
        assert message.startswith(f"cannot write checkpoint {tmp_path / 'step-000000004'}: No space left"), message
    assert messages[0] == messages[1]
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ddpkit.lock"))
    assert left == ["step-000000004"]  # no staging folder left (the run's folder lock stays)
    verify_checkpoint(tmp_path / "step-000000004")
    writer = "ddpkit-checkpoint-writer" if async_save else "MainThread"
    assert all(outcome["threads"] == [writer] for outcome in outcomes)  # the shards' writes ran there


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_with_on_write_error_warn_a_rank_that_cannot_write_its_shards_lets_every_rank_train_on(
    tmp_path, async_save
) -> None:
    outcomes = run_on_ranks(_a_rank_cannot_write, 2, str(tmp_path), async_save, "warn", timeout=120)
    assert [outcome.get("error") for outcome in outcomes] == [None, None]
    assert [outcome["last"] for outcome in outcomes] == [str(tmp_path / "step-000000008")] * 2
    complete = [info.global_step for info in list_checkpoints(tmp_path) if info.complete]
    assert complete == [4, 8]
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ddpkit.lock"))
    assert left == ["step-000000004", "step-000000008"]  # the failed write's staging folder is gone
    for step in (4, 8):
        verify_checkpoint(tmp_path / f"step-{step:09d}")


def _replicated_then_sharded(rank: int, world_size: int, folder: str) -> dict:
    """A replicated (DDP) run saves at step 4; the same training, now sharded, resumes its checkpoint and
    trains on to step 6 (a sharded checkpoint)."""
    import ddpkit
    import ddpkit.distributed
    from ddpkit.checkpoint.sharded.state import ShardedState

    ddpkit.distributed.init()
    try:
        torch.manual_seed(SEED)
        model = ddpkit.prepare_model(DropTower())  # DDP
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        ckpt = _checkpointer(folder, model, optimizer, scheduler)
        ckpt.resume("never")
        _train_to(model, optimizer, scheduler, ckpt, rank, world_size, 4)
        ckpt.close()
        replicated = {"params": [p.detach().clone() for p in model.parameters()], "opt": optimizer.state_dict()}

        model, optimizer, scheduler = _parts(world_size)
        ckpt = _checkpointer(folder, model, optimizer, scheduler)
        resumed_at = ckpt.resume("auto").global_step
        sharded = ShardedState(model, optimizer, rank, world_size)
        full = sharded._state()  # DTensors: gathered whole below, for the comparison only
        moments = {
            name: {key: value.full_tensor() for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")}
            for name, state in full["optimizer"]["state"].items()
        }
        resumed = {"params": _full(model), "moments": moments, "lr": optimizer.param_groups[0]["lr"]}
        _train_to(model, optimizer, scheduler, ckpt, rank, world_size, 6)
        ckpt.save()
        ckpt.close()
        return {"replicated": replicated, "resumed": resumed, "resumed_at": resumed_at, "names": list(moments)}
    finally:
        ddpkit.distributed.shutdown()


def test_a_replicated_checkpoint_resumes_sharded_with_every_tensor_in_place(tmp_path) -> None:
    outcomes = run_on_ranks(_replicated_then_sharded, 2, str(tmp_path), timeout=180)
    for outcome in outcomes:
        assert outcome["resumed_at"] == 4
        replicated, resumed = outcome["replicated"], outcome["resumed"]
        assert all(torch.equal(a, b) for a, b in zip(replicated["params"], resumed["params"]))
        assert resumed["lr"] == replicated["opt"]["param_groups"][0]["lr"]
        for position, name in enumerate(outcome["names"]):  # Adam's moments, position by position
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(replicated["opt"]["state"][position][key], resumed["moments"][name][key])
    newest = [info for info in list_checkpoints(tmp_path) if info.complete][-1]
    assert newest.global_step == 6 and read_manifest(newest.path)["sharded"]["objects"] == ["model", "optimizer"]


def _saves_back_to_back(rank: int, world_size: int, folder: str) -> list[int]:
    """Background saves at every step, rank 0's pruning slowed down: the next save's staging folder exists
    while the previous save is completed and pruned."""
    import time

    import ddpkit.distributed
    from ddpkit.checkpoint.disk import writer

    prune = writer.prune

    def slow_prune(*args, **kwargs):
        time.sleep(0.3)
        return prune(*args, **kwargs)

    writer.prune = slow_prune
    ddpkit.distributed.init()
    try:
        model, optimizer, scheduler = _parts(world_size)
        ckpt = _checkpointer(folder, model, optimizer, scheduler, async_save=True, keep=5)
        ckpt.resume("never")
        for last in (1, 2, 3):
            _train_to(model, optimizer, scheduler, ckpt, rank, world_size, last)
            ckpt.save()
        ckpt.close()
        return [info.global_step for info in list_checkpoints(folder) if info.complete]
    finally:
        ddpkit.distributed.shutdown()


def test_back_to_back_background_saves_never_prune_the_next_ones_staging_folder(tmp_path) -> None:
    assert run_on_ranks(_saves_back_to_back, 2, str(tmp_path), timeout=120) == [[1, 2, 3]] * 2


def _one_rank_diverges(rank: int, world_size: int, folder: str, async_save: bool) -> None:
    """Step 4's checkpoint is finite; then rank 1's shard of a weight becomes NaN (rank 0's stays finite) and
    step 5 is saved."""
    import ddpkit
    import ddpkit.distributed

    ddpkit.distributed.init()
    try:
        model, optimizer, scheduler = _parts(world_size)
        ckpt = _checkpointer(folder, model, optimizer, scheduler, async_save=async_save)
        ckpt.resume("never")
        _train_to(model, optimizer, scheduler, ckpt, rank, world_size, 5)
        if rank == 1:
            with torch.no_grad():
                next(model.parameters()).to_local().fill_(float("nan"))
        ckpt.save()
        ckpt.close()
    finally:
        ddpkit.distributed.shutdown()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_nan_in_one_ranks_shards_marks_the_checkpoint_and_the_finite_one_stays_the_last_good(tmp_path, async_save):
    from ddpkit.checkpoint.disk.finite import is_marked_nonfinite, last_finite_checkpoint
    from ddpkit.checkpoint.manager.select import choose_checkpoint

    run_on_ranks(_one_rank_diverges, 2, str(tmp_path), async_save, timeout=120)
    first = next(DropTower().named_parameters())[0]
    manifest = read_manifest(tmp_path / "step-000000005")
    assert is_marked_nonfinite(manifest) and manifest["nonfinite_tensors"] == [f"model.{first}"]
    assert not is_marked_nonfinite(read_manifest(tmp_path / "step-000000004"))
    assert last_finite_checkpoint(tmp_path) == (tmp_path / "step-000000004", [tmp_path / "step-000000005"])
    assert choose_checkpoint(tmp_path, "auto")[0] == tmp_path / "step-000000004"


def test_completing_a_sharded_write_sets_a_folder_of_its_name_without_manifest_aside(tmp_path) -> None:
    """A crash's leftover of the step, or a copy in progress: never removed, as write_checkpoint never does."""
    from ddpkit.checkpoint.disk.format import finish_checkpoint

    leftover = tmp_path / "step-000000004"
    leftover.mkdir()
    (leftover / "copied.bin").write_bytes(b"data")
    staging = tmp_path / ".step-000000004.tmp-1234abcd"
    staging.mkdir()
    path = finish_checkpoint(tmp_path, staging, "step-000000004", {"train.pt": {"global_step": 4}}, {}, {}, {})
    assert path == leftover and verify_checkpoint(path)["train.pt"] == {"global_step": 4}
    assert (tmp_path / "step-000000004.incomplete" / "copied.bin").read_bytes() == b"data"


class _Payload:
    """Unpickling it would create ``path`` (what a crafted checkpoint's code could do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_index_is_refused_never_run(runs, tmp_path) -> None:
    import hashlib
    import json

    import ddpkit

    root, _ = runs
    folder = tmp_path / "ckpts"
    shutil.copytree(root / "four", folder)
    checkpoint, sentinel = folder / "step-000000004", tmp_path / "sentinel"
    index = checkpoint / ".metadata"
    os.chmod(index, 0o600)
    index.write_bytes(pickle.dumps(_Payload(sentinel)))
    # A forger rewrites the manifest's checksum too: verification passes, the unpickler must refuse.
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][".metadata"] = {
        "bytes": index.stat().st_size,
        "sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
    }
    os.chmod(checkpoint / MANIFEST, 0o600)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    model = DropTower()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    ckpt = ddpkit.Checkpointer(folder, model=model, optimizer=optimizer, scheduler=scheduler, preempt_signals=())
    try:
        with pytest.raises(CheckpointError, match="refused to load .*is not allowed in a checkpoint's index"):
            ckpt.resume(checkpoint)
    finally:
        ckpt.close()
    with pytest.raises(CheckpointError, match="refused to load"):
        ddpkit.export_checkpoint(checkpoint, tmp_path / "export")
    assert not sentinel.exists()
