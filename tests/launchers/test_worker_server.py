"""Workers forked from the warm worker server: preloaded, with the launcher's environment, and no server left."""

import gc
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ddpkit.launchers.local import LaunchSpec, launch_local
from ddpkit.launchers.server import worker_server
from tests.cli_runner import PYTHONPATH


def _report(name: str) -> dict:
    # What every worker needs is preloaded (an optimizer imports torch._dynamo), what only some need is not.
    preloaded = all(name in sys.modules for name in ("torch.distributed", "torch._dynamo"))
    preloaded &= "ddpkit.train.run" not in sys.modules
    collecting, frozen = gc.isenabled(), gc.get_freeze_count()
    import torch

    torch.set_num_threads(2)  # the intra-op pool starts in the worker, never in the server
    a = torch.arange(512 * 512, dtype=torch.float64).reshape(512, 512) / 1e5
    return {
        "rank": int(os.environ["RANK"]),
        "value": os.environ.get(name),
        "parent": os.getppid(),
        "preloaded": preloaded,
        "collecting": collecting,
        "frozen": frozen,
        "matmul_ok": torch.allclose(a @ a, torch.from_numpy(a.numpy() @ a.numpy())),
    }


@pytest.mark.slow
def test_workers_fork_from_one_server_with_the_launchers_environment_of_each_launch(monkeypatch):
    name = "DDPKIT_TEST_WORKER_SERVER"
    monkeypatch.setenv(name, "at the start")
    with worker_server():  # as `ddpkit train` does first; the launches reuse it
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        monkeypatch.setenv(name, "first launch")
        first = launch_local(LaunchSpec(2), _report, name)
        # Forking is safe only from a process without threads: no OpenMP pool, no store.
        server_threads = psutil.Process(server).num_threads()
        monkeypatch.delenv(name)
        second = launch_local(LaunchSpec(2), _report, name)
    assert [first[r]["rank"] for r in (0, 1)] == [0, 1]
    assert [first[r]["value"] for r in (0, 1)] == ["first launch"] * 2
    assert [second[r]["value"] for r in (0, 1)] == [None, None]
    assert {r["parent"] for r in [*first.values(), *second.values()]} == {server}
    assert server != os.getpid()
    assert server_threads == 1
    assert all(r["preloaded"] and r["matmul_ok"] for r in [*first.values(), *second.values()])
    # The server never collects; each worker froze what it inherited (torch's objects) and collects again.
    assert all(r["collecting"] and r["frozen"] > 100_000 for r in [*first.values(), *second.values()])
    assert multiprocessing.forkserver._forkserver._forkserver_pid is None  # stopped with the outermost block


def test_ctrl_c_while_the_server_imports_is_the_launchers_one_line_and_leaves_nothing_running(tmp_path):
    """``ddpkit run`` starts the server before its own imports: a Ctrl-C then reaches both, mid-import."""
    importing = tmp_path / "importing"
    probe = (
        "import sys, ddpkit.launchers.server as server\n"
        "server.WORKER_PRELOAD = (*server.WORKER_PRELOAD[:1], 'tests.launchers.slow_server_import', *server.WORKER_PRELOAD[1:])\n"
        "from ddpkit.commands.dispatch import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    (tmp_path / "a.py").write_text("print('never')\n")
    launcher = subprocess.Popen(
        [sys.executable, "-c", probe, "run", "nproc=1", str(tmp_path / "a.py")],
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "DDPKIT_TEST_SERVER_IMPORTING": str(importing)},
        start_new_session=True,  # a process group, as a terminal's job is
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (a background job's is ignored)
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not importing.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert importing.exists(), "the server never started importing"
    server = psutil.Process(int(importing.read_text()))
    os.killpg(launcher.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole job's process group
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert err.strip().splitlines()[-1] == "ddpkit: interrupted" and "Traceback" not in err, err
    assert "never" not in out
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
