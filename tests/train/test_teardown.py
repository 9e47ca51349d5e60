"""A finished run leaves its process group only once its trainer (and a DDP model's reducer) is gone.

A DDP model freed after the group is left holds the group's last reference
and destroys it holding the GIL, joining gloo's threads, one of which may be
waiting for the GIL to free the last collective's tensors: the worker hangs
after the run ended (5 runs in 20 of ``ddpkit train model=cnn nproc=2
max_steps=4 checkpoint.enabled=false`` did, when W2 took DDP on one CPU node). Which runs hang depends on
thread timing; the order that rules it out does not, and is what is checked.
"""

from __future__ import annotations

import textwrap

from tests.helpers.launch_in_process import Commands

# Each worker trains through run_worker, as `ddpkit train` does, and counts the DDP models still alive at the
# moment it leaves the group.
PROBE = textwrap.dedent(
    """
    import gc, sys
    import ddpkit
    from torch.nn.parallel import DistributedDataParallel
    from ddpkit.train.config import parse_train_config
    from ddpkit.train.run import run_worker

    leave = ddpkit.shutdown

    def counting_shutdown():
        alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        if ddpkit.distributed.joined():  # (atexit calls it again)
            print(f"DDP models alive when rank {ddpkit.context().rank} leaves the group: {alive}", flush=True)
        leave()

    ddpkit.shutdown = counting_shutdown
    summary = run_worker(parse_train_config(sys.argv[1:]))
    assert summary["grad_sync"] == "ddp", summary["grad_sync"]
    """
)


def test_the_ddp_model_is_freed_before_the_group_is_left(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    words = [
        "model=cnn",
        "grad_sync=ddp",
        "dataset=synthetic",
        "synthetic_samples=128",
        "max_steps=2",
        "progress=false",
    ]
    with Commands() as commands:
        out = commands.run(
            "run",
            "nproc=2",
            "show_ranks=all",
            "probe.py",
            *words,
            "checkpoint.enabled=false",
            f"output_dir={tmp_path}/run",
            cwd=tmp_path,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(line for line in out.stdout.splitlines() if "leaves the group" in line)
    assert lines == [
        "[rank 0/2] DDP models alive when rank 0 leaves the group: 0",
        "[rank 1/2] DDP models alive when rank 1 leaves the group: 0",
    ], out.stdout
