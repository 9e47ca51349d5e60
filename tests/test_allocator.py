"""glibc's allocator keeps what a CPU step frees (ddpkit.allocator): no page faults in steady steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ddpkit.allocator import GLIBC_VARIABLES, reason_to_leave_alone, setting
from ddpkit.commands.dispatch import main
from ddpkit.errors import UserError
from tests.cli_runner import PYTHONPATH

GLIBC = "glibc 2.36"


def test_it_is_set_by_default_on_glibc():
    assert setting({}) == "keep"
    assert reason_to_leave_alone({}, GLIBC) is None
    assert reason_to_leave_alone({"DDPKIT_MALLOC": " Keep "}, GLIBC) is None


@pytest.mark.parametrize(
    "environ, libc, reason",
    [
        ({"DDPKIT_MALLOC": "default"}, GLIBC, "DDPKIT_MALLOC=default"),
        ({"MALLOC_TRIM_THRESHOLD_": "131072"}, GLIBC, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, GLIBC, "MALLOC_MMAP_THRESHOLD_ is set"),
        ({}, None, "the C library is not glibc"),
        ({}, "musl 1.2", "the C library is not glibc"),
    ],
)
def test_it_is_left_alone_where_the_user_or_the_system_says_otherwise(environ, libc, reason):
    assert reason_to_leave_alone(environ, libc) == reason


def test_a_value_it_does_not_know_is_one_line_naming_the_choices():
    with pytest.raises(UserError, match=r"^DDPKIT_MALLOC='mimalloc' is unknown; choose keep .* or default "):
        setting({"DDPKIT_MALLOC": "mimalloc"})


def test_the_launcher_refuses_a_bad_value_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPKIT_MALLOC", "tuned")
    script = tmp_path / "hello.py"
    script.write_text("print('started')\n")
    assert main(["run", "nproc=2", str(script)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: DDPKIT_MALLOC='tuned' is unknown") and err.count("\n") == 1, err
    assert "started" not in out


def test_ddpkit_launch_refuses_a_bad_value_before_any_worker_starts(tmp_path, monkeypatch):
    import ddpkit

    monkeypatch.setenv("DDPKIT_MALLOC", "tuned")
    started = tmp_path / "started"
    with pytest.raises(UserError, match=r"^DDPKIT_MALLOC='tuned' is unknown"):
        ddpkit.launch(started.touch, nproc=2)
    assert not started.exists()


# W2's steps at batch 16 on one thread, after ddpkit.init(): the minor page faults of each step.
_STEPS = textwrap.dedent(
    """
    import json, resource, statistics, torch, torch.nn.functional as F
    import ddpkit
    from ddpkit.models.registry import get_model_spec

    ddpkit.init(threads=1)
    torch.manual_seed(0)
    model = get_model_spec("cnn").build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    x, y = torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,))
    faults = []
    for step in range(30):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults[10:]))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_after_init_a_cnn_step_faults_in_no_new_memory():
    # A fresh process: the allocator's settings are the process's own. Without them, the same steps take
    # hundreds to thousands of faults each (DDPKIT_MALLOC=default; ~900 on the 2-core VM, 2,000 in ddpkit train).
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH}
    for name in ("DDPKIT_MALLOC", *GLIBC_VARIABLES):
        environ.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", _STEPS], env=environ, capture_output=True, text=True, timeout=120, check=True
    )
    faults = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(faults)[len(faults) // 2] <= 16, faults  # the median step: none measured
