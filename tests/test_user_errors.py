"""User errors are one line and exit 2 before any worker starts; any other exception shows its traceback and rank."""

from __future__ import annotations

import textwrap

import pytest

from ddpkit.checkpoint.disk.format import CheckpointError
from ddpkit.commands.dispatch import main
from ddpkit.data.idx import CorruptDataError
from ddpkit.data.sources import DataNotFoundError
from ddpkit.env.base import InconsistentEnvironment
from ddpkit.errors import UserError
from ddpkit.keyvalue import ConfigError
from ddpkit.launchers.failure import run_reporting_failure
from tests.cli_runner import run_ddpkit
from tests.helpers.launch_in_process import Commands

TINY = ["dataset=synthetic", "synthetic_samples=256", "batch_size=32", "epochs=1", "progress=false"]


@pytest.mark.parametrize(
    "error", [ConfigError, CheckpointError, CorruptDataError, DataNotFoundError, InconsistentEnvironment]
)
def test_ddpkit_s_errors_for_the_user_share_one_base_class(error):
    assert issubclass(error, UserError)


def _fail(error: Exception) -> None:
    raise error


def test_a_user_error_is_reported_as_its_line_and_any_other_with_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        run_reporting_failure(_fail, UserError("epochs=0 is not valid; it must be > 0"))
    assert capsys.readouterr().err == "error: rank 1: epochs=0 is not valid; it must be > 0\n"

    with pytest.raises(SystemExit):
        run_reporting_failure(_fail, ValueError("mat1 and mat2 shapes cannot be multiplied"))
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1: ValueError: mat1 and mat2 shapes cannot be multiplied\nTraceback")
    assert "in _fail" in err


@pytest.mark.parametrize(
    "words, message",
    [
        (
            ["allreduce=rign"],
            "error: allreduce='rign' is not an all_reduce algorithm (did you mean 'ring'?); choose one of: builtin,",
        ),
        (["backend=mpi"], "error: backend='mpi' is not valid; choose one of: auto, gloo, nccl, cpu:gloo,cuda:nccl"),
        (["device=tpu"], "error: device='tpu' is not valid; choose one of: auto, cpu, cuda"),
        (["optimizer=lamb"], "error: optimizer='lamb' is not valid; choose one of: adam, sgd"),
        (["lr_schedule=linear"], "error: lr_schedule='linear' is not valid; choose one of:"),
        (["model=resnet"], "error: unknown model 'resnet'"),
        (["dataset=cifar"], "error: unknown dataset 'cifar'"),
        (["batch_size=33"], "error: global batch size 33 does not divide among 2 workers"),
        (["sync_batchnorm=true", "device=cpu"], "error: sync_batchnorm=true needs CUDA devices"),
        (
            ["nnodes=2", "master_port=29500"],
            "error: nnodes=2 needs master_addr=HOST, the host name or address of node 0",
        ),
        (["nnodes=2", "master_addr=node0"], "error: nnodes=2 needs master_port=PORT, a free TCP port on node 0"),
        (["nnodes=2", "node_rank=2"], "error: node_rank=2 is not valid for nnodes=2; use 0 to 1, 0 on the master"),
        (["nnodes=0"], "error: nnodes=0 is not valid; it must be > 0"),
        (
            ["resume=no/such/step", "output_dir=out"],
            "error: checkpoint no/such/step does not exist; pass a checkpoint folder",
        ),
        (
            ["nnodes=2", "node_rank=1", "master_addr=node0", "master_port=29500", "batch_size=34"],
            "error: global batch size 34 does not divide among 4 workers",
        ),
        # NaN passes every bound (each comparison with it is false); infinity passes lr > 0
        (["lr=nan"], "error: lr=nan is not valid; it must be a finite number (not nan or inf)"),
        (["lr=inf"], "error: lr=inf is not valid; it must be a finite number (not nan or inf)"),
        (["lr=-.inf"], "error: lr=-inf is not valid; it must be a finite number (not nan or inf)"),
        (["timeout=nan"], "error: timeout=nan is not valid; it must be a finite number (not nan or inf)"),
        (["momentum=nan"], "error: momentum=nan is not valid; it must be a finite number (not nan or inf)"),
        (["weight_decay=inf"], "error: weight_decay=inf is not valid; it must be a finite number (not nan or inf)"),
        (["lr_gamma=nan"], "error: lr_gamma=nan is not valid; it must be a finite number (not nan or inf)"),
        (
            ["checkpoint.every_seconds=nan"],
            "error: checkpoint.every_seconds=nan is not valid; it must be a finite number (not nan or inf)",
        ),
        (
            ["checkpoint.sync_seconds=inf"],
            "error: checkpoint.sync_seconds=inf is not valid; it must be a finite number (not nan or inf)",
        ),
        (["momentum=-0.5"], "error: momentum=-0.5 is not valid; it must be >= 0"),
        (["model=.:x"], "error: model '.:x' names no module or no function; write module:function"),
        (["model=:x"], "error: model ':x' names no module or no function; write module:function"),
        (["model=tests:"], "error: model 'tests:' names no module or no function; write module:function"),
        # counts of work are bounded: a 23-digit epochs= spun for minutes before anything started
        (
            ["epochs=12345678901234567890123"],
            "error: epochs=12345678901234567890123 is more than any run can do; use at most 1000000000",
        ),
        (["checkpoint.keep=10000000000"], "error: checkpoint.keep=10000000000 is more than any run can do"),
    ],
)
def test_bad_names_and_combinations_fail_before_any_worker_starts(tmp_path, monkeypatch, capsys, words, message):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "nproc=2", *TINY, *words]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(message) and err.count("\n") == 1, err
    assert "[rank" not in err + out  # no worker ever logged
    assert not (tmp_path / "runs").exists()  # and nothing was created


def test_the_command_itself_exits_2_with_one_line_for_a_bad_name(tmp_path):
    out = run_ddpkit("train", "nproc=2", *TINY, "allreduce=rign", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    assert (
        out.stderr.startswith("error: allreduce='rign' is not an all_reduce algorithm") and out.stderr.count("\n") == 1
    ), out.stderr
    assert out.stdout == ""


@pytest.mark.slow
def test_a_value_error_in_the_user_s_model_shows_its_traceback_and_rank(tmp_path):
    (tmp_path / "broken_model.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Broken(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(784, 10)

            def forward(self, x):
                raise ValueError("my model cannot take a batch of " + str(tuple(x.shape)))

        def build():
            return Broken()
    """)
    )
    with Commands() as commands:  # in this process; the command's own exit path is checked above
        out = commands.run("train", "nproc=2", *TINY, "model=broken_model:build", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert (
        "error: worker rank " in out.stderr
        and "failed (exit code 1): ValueError: my model cannot take a batch of (16, 1, 28, 28)" in out.stderr
    ), out.stderr
    assert "Traceback (most recent call last)" in out.stderr and "broken_model.py" in out.stderr, out.stderr
    assert 'raise ValueError("my model cannot take a batch of "' in out.stderr, out.stderr


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0.0])
def test_an_own_script_s_init_refuses_a_timeout_that_is_not_a_finite_positive_number(timeout):
    import ddpkit

    with pytest.raises(UserError, match=r"^timeout=\S+ is not valid; it must be"):
        ddpkit.init(timeout=timeout)


def test_an_unclosed_quotation_in_the_slurm_command_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", "venv=/opt/venv", 'command=python "x']) == 2
    assert capsys.readouterr().err == (
        "error: command='python \"x' cannot be split into words (no closing quotation); close each quotation, "
        "e.g. 'command=python train.py --name \"a b\"'\n"
    )


@pytest.mark.slow
def test_a_read_only_output_dir_is_one_line_before_the_workers_start(tmp_path, monkeypatch, capsys):
    """nproc=2 said it as a PermissionError from the launcher making the logs folder (exit 1); now as nproc=1 does."""
    from tests.tracking.own_loop import make_read_only, make_writable

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()
    make_read_only(tmp_path / "ro")
    try:
        for nproc in (1, 2):
            assert main(["train", f"nproc={nproc}", *TINY, "output_dir=ro"]) == 2
            out, err = capsys.readouterr()
            assert err.startswith("error: cannot write to ro (") and err.endswith(
                "); choose a folder this user can write (output_dir=...)\n"
            ), err
            assert err.count("\n") == 1 and "[rank" not in out + err
    finally:
        make_writable(tmp_path / "ro")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_under_metrics_jsonl_is_one_line_and_the_storage_status(tmp_path, monkeypatch, capsys, nproc):
    """A raw OSError, exit 1, before; now the line and EXIT_STORAGE (74), as for a checkpoint that cannot be written."""
    from tests.checkpoint.test_storage import tmpfs

    monkeypatch.chdir(tmp_path)
    # two pages: the first lines fit, and a line every step fills the rest within the epoch
    with tmpfs(tmp_path / "small", 8192):
        words = [*TINY, "synthetic_samples=2048", "batch_size=8", "log_every=1", "checkpoint.enabled=false"]
        status = main(["train", f"nproc={nproc}", *words, "output_dir=small/run", "show_ranks=0"])
        out, err = capsys.readouterr()
    assert status == 74, err
    lines = [line for line in err.splitlines() if not line.startswith(("[rank", "ddpkit:"))]
    prefix = "error: worker rank 0 failed (exit code 74): " if nproc == 2 else "error: "
    assert lines == [
        f"{prefix}cannot write small/run/metrics.jsonl: No space left on device (0 B free there); free space "
        "there or choose another folder (output_dir=...), then continue with resume=auto"
    ], err
    assert "Traceback" not in out + err
