"""ddpkit's changes to torch's elastic agent last one launch: before and after it, torch is as it was."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from ddpkit.launchers.local import LaunchSpec, launch_local
from tests.cli_runner import PYTHONPATH

PATCHED_BEFORE = (
    (LocalElasticAgent, "_monitor_workers"),
    (LocalElasticAgent, "_restart_workers"),
    (LocalElasticAgent, "_exit_barrier"),
    (LocalElasticAgent, "_shutdown"),
    (MultiprocessContext, "_poll"),
)


def _torch_as_it_is() -> dict[str, object]:
    return {
        "agent class": launcher_api.LocalElasticAgent,
        **{f"{cls.__name__}.{name}": getattr(cls, name) for cls, name in PATCHED_BEFORE},
        "agent log level": logging.getLogger("torch.distributed.elastic").level,
    }


def _rank() -> int:
    import os

    return int(os.environ["RANK"])


def test_a_launch_leaves_torchs_agent_and_its_logging_as_they_were():
    before = _torch_as_it_is()
    assert launch_local(LaunchSpec(2), _rank) == {0: 0, 1: 1}
    assert _torch_as_it_is() == before


def test_importing_the_launcher_changes_nothing():
    """No import-time side effect: torch unimported, no signal handler, gc on, the environment untouched."""
    probe = (
        "import gc, os, signal, sys\n"
        "environ, handlers = dict(os.environ), [signal.getsignal(s) for s in signal.valid_signals()]\n"
        "import ddpkit.launchers.local, ddpkit.launchers.server, ddpkit.launchers.server_start\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert handlers == [signal.getsignal(s) for s in signal.valid_signals()], 'a signal handler changed'\n"
        "assert gc.isenabled() and dict(os.environ) == environ\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env={"PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
