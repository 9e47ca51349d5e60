"""``ddpkit.launch(fn, *args, nproc=N)``: from this process, from ``python -c``, from a real Jupyter kernel.

Levels: the start-method choice and the output reader on plain values; launches forked from this process;
the same from a plain interpreter and from a notebook kernel (nbclient, jupyter_client), where ``fn`` is
defined in the code run and cannot be imported, with Ctrl-C and the stop button; and a script in mp.spawn's
shape, ported, stopped mid-epoch and run again, compared bit for bit with a run that was not stopped.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import ddpkit
import ddpkit.distributed
from ddpkit.errors import UserError
from ddpkit.launchers.failure import LaunchError
from ddpkit.launchers.function import SHOWN, choose_start_method, fork_hazard, importable
from ddpkit.launchers.output import log_files, rank_output
from tests.cli_runner import PYTHONPATH, REPO
from tests.launchers import function_workers

SCRIPTS = Path(__file__).resolve().parent / "scripts"
CELL_TIMEOUT = 90
"""Seconds a notebook cell or a ``python -c`` run may take (a busy 2-core machine: torch imports in each)."""


def _environ() -> dict[str, str]:
    """A child interpreter's (or kernel's) environment: this checkout's ddpkit first."""
    return {**os.environ, "PYTHONPATH": PYTHONPATH}


def _gone(pids: list[int], within: float = 10.0) -> list[int]:
    """The processes of ``pids`` still running (zombies count as gone) after waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the choice of start method, the output reader: plain values -------------------------------------


def test_a_fork_is_refused_where_cuda_is_initialized_unless_fn_can_be_imported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(UserError) as refused:
        choose_start_method("auto", lambda: None)
    message = str(refused.value)
    assert "\n" not in message
    assert "CUDA is initialized" in message and "restart the kernel" in message and "module file" in message
    assert choose_start_method("auto", function_workers.rank_sum) == "forkserver"  # importable: started fresh
    with pytest.raises(UserError, match="CUDA is initialized.*start_method='auto'"):
        choose_start_method("fork", function_workers.rank_sum)


def test_a_fork_is_refused_inside_a_process_group(monkeypatch):
    monkeypatch.setattr(ddpkit.distributed, "joined", lambda: True)
    with pytest.raises(UserError, match=r"joined a process group.*call ddpkit.shutdown\(\)"):
        choose_start_method("auto", lambda: None)


def test_a_fork_is_refused_while_another_thread_of_the_program_runs():
    release = threading.Event()
    busy = threading.Thread(target=release.wait, name="busy-loader")
    busy.start()
    try:
        problem, fix = fork_hazard() or ("", "")
        assert "'busy-loader' is running" in problem and "thread.join()" in fix
        with pytest.raises(UserError, match="busy-loader"):
            choose_start_method("auto", lambda: None)
    finally:
        release.set()
        busy.join()
    daemon = threading.Thread(target=time.sleep, args=(0.5,), daemon=True)  # a kernel's own threads are daemons
    daemon.start()
    assert fork_hazard() is None
    daemon.join()


def test_only_module_level_functions_count_as_importable():
    def local() -> None:
        pass

    assert importable(function_workers.rank_sum)
    assert not importable(local) and not importable(lambda: None) and not importable(print.__call__)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"nproc": 0}, "nproc=0 is not valid"),
        ({"max_restarts": -1}, "max_restarts=-1 is not valid"),
        ({"start_method": "spawn"}, "start_method='spawn' is not valid; choose one of: auto, fork, forkserver"),
        ({"nproc": "2"}, r"nproc='2' is not valid; it must be a whole number \(e.g. nproc=2\), not a str"),
        ({"nproc": 2.5}, r"nproc=2.5 is not valid; it must be a whole number \(e.g. nproc=2\), not a float"),
        ({"nproc": True}, r"nproc=True is not valid; it must be a whole number \(e.g. nproc=2\), not a bool"),
        ({"max_restarts": "1"}, "max_restarts='1' is not valid; it must be a whole number"),
        ({"master_port": 70000}, "master_port=70000 is not valid; give a port from 1 to 65535, or 0 for a free one"),
        ({"master_port": -1}, "master_port=-1 is not valid; give a port from 1 to 65535"),
        ({"master_port": "29500"}, "master_port='29500' is not valid; it must be a whole number"),
    ],
)
def test_bad_options_are_one_line_before_any_worker(options, message):
    with pytest.raises(UserError, match=message):
        ddpkit.launch(function_workers.rank_sum, "x", **options)
    with pytest.raises(UserError, match="is not callable"):
        ddpkit.launch("train.py", nproc=2)


def test_forkserver_needs_a_function_the_workers_can_import():
    with pytest.raises(UserError, match="start_method='forkserver' needs a function the workers can import"):
        ddpkit.launch(lambda: None, start_method="forkserver")


def test_the_output_reader_shows_rank_0s_whole_lines_and_names_where_the_others_are(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    with rank_output(str(tmp_path / "launch"), SHOWN, out, err) as files:
        (files.folder / "rank-0.stdout.log").write_bytes(b"first line\nhalf a")
        (files.folder / "rank-1.stdout.log").write_bytes(b"rank 1's line\n")
        (files.folder / "rank-1.stderr.log").write_bytes(b"rank 1's warning\n")
        for rank in (0, 1):
            files.tee.follow(rank, 2, *log_files(files.folder, rank))
        with open(files.folder / "rank-0.stdout.log", "ab") as f:
            f.write(b" line\n10%\r50%\r100%\nno newline at the end")
    assert out.getvalue().splitlines() == [  # as python would show them: rank 0's alone, unprefixed
        "first line",
        "half a line",
        "100%",  # a progress bar's last state, as a terminal shows it
        "no newline at the end",
    ]
    assert err.getvalue().splitlines() == [
        f"ddpkit: the console shows rank 0's output (show_ranks=all: every rank's), each rank's whole output is in "
        f"{files.folder}",
        "ddpkit: rank 1 also wrote to stderr, not shown here (the console shows rank 0; show_ranks=all shows every "
        f"rank): {files.folder / 'rank-1.stderr.log'}",
    ]


# -- launches forked from this process -----------------------------------------------------------------


def test_results_come_back_in_rank_order_and_the_console_shows_rank_0_as_ddpkit_run_does(capsys, seed):
    def all_reduce(tag: str) -> dict:  # a closure: only a fork can start it
        ctx = ddpkit.init()
        torch.manual_seed(seed + ctx.rank)
        total = torch.tensor([float(ctx.rank + 1)])
        torch.distributed.all_reduce(total)
        print(f"sum {total.item()}")
        return {"rank": ctx.rank, "tag": tag, "sum": total.item(), "weights": torch.randn(3)}

    results = ddpkit.launch(all_reduce, "x", nproc=3)
    assert [(r["rank"], r["tag"], r["sum"]) for r in results] == [(0, "x", 6.0), (1, "x", 6.0), (2, "x", 6.0)]
    torch.manual_seed(seed + 2)
    assert torch.equal(results[2]["weights"], torch.randn(3))  # tensors come back too
    out, err = capsys.readouterr()
    # Rank 0's line, once, as under ddpkit run (after the seed fixture's line); the others' are in their files.
    assert [line for line in out.splitlines() if not line.startswith("DDPKIT_TEST_SEED=")] == ["sum 6.0"]
    folder = Path(err.splitlines()[0].partition("each rank's whole output is in ")[2])
    assert [(folder / f"rank-{rank}.stdout.log").read_text() for rank in range(3)] == ["sum 6.0\n"] * 3


def test_a_failed_rank_raises_one_error_naming_it(capsys):
    def fails(bad_rank: int) -> None:
        ctx = ddpkit.init()
        if ctx.rank == bad_rank:
            raise ValueError(f"rank {ctx.rank} cannot go on")
        torch.distributed.barrier()

    with pytest.raises(LaunchError) as failed:
        ddpkit.launch(fails, 1, nproc=2)
    assert failed.value.failure.rank == 1 and failed.value.failure.exitcode == 1
    report = str(failed.value)
    assert report.startswith("error: worker rank 1 failed (exit code 1): ValueError: rank 1 cannot go on\n")
    assert report.splitlines()[-2] == "ValueError: rank 1 cannot go on"  # the traceback's last line
    assert report.splitlines()[-1].startswith("ddpkit: rank 1's whole output: ")
    assert report.splitlines()[2].endswith(", in fails")  # its first frame is fn's, not the launcher's
    assert failed.value.__cause__ is None and failed.value.__suppress_context__


def test_a_user_error_in_fn_reads_as_one_line():
    def refuses() -> None:
        ddpkit.init()
        raise UserError("epochs=-1 is not valid; it must be > 0")

    with pytest.raises(LaunchError) as failed:
        ddpkit.launch(refuses, nproc=2)
    assert "\n" not in str(failed.value)
    assert "epochs=-1 is not valid; it must be > 0" in str(failed.value)


def test_max_restarts_starts_every_worker_again(tmp_path):
    marker = tmp_path / "failed-once"

    def fails_once() -> int:
        ctx = ddpkit.init()
        if ctx.rank == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("first round fails")
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    assert ddpkit.launch(fails_once, nproc=2, max_restarts=1) == [1, 1]


def test_each_round_of_a_restarted_launch_has_files_of_its_own_as_under_ddpkit_run(tmp_path, capsys):
    """ddpkit.launch writes its ranks' output through the launcher's one path (ddpkit.launchers.output)."""
    marker = tmp_path / "failed-once"

    def fails_once() -> None:
        ctx = ddpkit.init()
        print(f"rank {ctx.rank} round {os.environ['TORCHELASTIC_RESTART_COUNT']}")
        if ctx.rank == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("first round fails")

    ddpkit.launch(fails_once, nproc=2, max_restarts=1)
    err = capsys.readouterr().err
    folder = Path(err.split("each rank's whole output is in ")[1].split()[0])
    assert (folder / "rank-1.stdout.log").read_text() == "rank 1 round 0\n"
    assert (folder / "restart-1" / "rank-1.stdout.log").read_text() == "rank 1 round 1\n"


def test_a_result_that_cannot_be_pickled_is_a_user_error():
    with pytest.raises(LaunchError, match="returned a generator that cannot be sent back to the launcher"):
        ddpkit.launch(lambda: (i for i in range(3)), nproc=1)


def test_an_importable_function_starts_from_the_worker_server_too():
    assert ddpkit.launch(function_workers.rank_sum, "s", nproc=2, start_method="forkserver") == [
        (0, "s", 3.0),
        (1, "s", 3.0),
    ]


def test_a_fork_from_a_thread_that_ran_an_openmp_operator_hangs_and_the_launchers_does_not():
    """Why the agent forks from a thread of its own: GNU OpenMP's pool belongs to the thread that used it."""
    program = textwrap.dedent(
        """
        import os, sys, threading, time, torch
        torch.set_num_threads(2)
        x = torch.randn(600, 600); x @ x                  # this thread's OpenMP pool
        def forked_matmul():
            pid = os.fork()
            if pid == 0:
                torch.randn(600, 600) @ torch.randn(600, 600)
                os._exit(0)
            deadline = time.monotonic() + float(sys.argv[1])
            while time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return "done"
                time.sleep(0.05)
            os.kill(pid, 9); os.waitpid(pid, 0)
            return "hung"
        print("main thread:", forked_matmul(), flush=True)
        results = []
        thread = threading.Thread(target=lambda: results.append(forked_matmul())); thread.start(); thread.join()
        print("fresh thread:", results[0], flush=True)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", program, "4"], env=_environ(), capture_output=True, text=True, timeout=CELL_TIMEOUT
    )
    assert run.stdout.splitlines() == ["main thread: hung", "fresh thread: done"], run.stderr


# -- from a plain interpreter: python -c ---------------------------------------------------------------

PYTHON_C = """
import os, sys, time, torch, ddpkit
torch.randn(500, 500) @ torch.randn(500, 500)      # the interpreter has run torch work: OpenMP's pool
def work(mode):
    ctx = ddpkit.init()
    total = torch.tensor([float(ctx.rank + 1)])
    torch.distributed.all_reduce(total)
    pids = [0, 0]
    torch.distributed.all_gather_object(pids, os.getpid())
    print("pid", *pids, flush=True)  # rank 0's: the console shows it
    if mode == "fail" and ctx.rank == 1:
        raise KeyError("rank 1 lost its key")
    while mode == "sleep":
        time.sleep(0.05)
    return total.item()
try:
    print("results", ddpkit.launch(work, sys.argv[1], nproc=2), flush=True)
except KeyboardInterrupt as e:
    print("KeyboardInterrupt:", e, flush=True)
except ddpkit.launchers.failure.LaunchError as e:
    print("LaunchError rank", e.failure.rank, e.failure.traceback.splitlines()[-1], flush=True)
"""


def test_from_python_c_results_and_a_failed_rank():
    ok = subprocess.run(
        [sys.executable, "-c", PYTHON_C, "ok"], env=_environ(), capture_output=True, text=True, timeout=CELL_TIMEOUT
    )
    assert "results [3.0, 3.0]" in ok.stdout.splitlines(), ok.stdout + ok.stderr
    assert sum(line.startswith("pid ") for line in ok.stdout.splitlines()) == 1  # rank 0's, unprefixed
    failed = subprocess.run(
        [sys.executable, "-c", PYTHON_C, "fail"], env=_environ(), capture_output=True, text=True, timeout=CELL_TIMEOUT
    )
    assert "LaunchError rank 1 KeyError: 'rank 1 lost its key'" in failed.stdout.splitlines(), failed.stderr


def test_from_python_c_ctrl_c_stops_every_worker():
    process = subprocess.Popen(
        [sys.executable, "-c", PYTHON_C, "sleep"], env=_environ(), stdout=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    pids = []
    try:
        deadline = time.monotonic() + CELL_TIMEOUT
        while len(pids) < 2 and time.monotonic() < deadline:
            line = lines.get(timeout=CELL_TIMEOUT)
            if line.startswith("pid "):  # rank 0's line: every worker's pid
                pids += [int(word) for word in line.split()[1:]]
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=30) == 0
        time.sleep(0.2)  # the reader thread takes the last lines
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert "KeyboardInterrupt: ddpkit.launch: the workers were stopped (Ctrl-C)\n" in rest
        assert _gone(pids) == []
    finally:
        process.kill()
        process.wait()
        _kill(pids)


# -- from a notebook: a real Jupyter kernel ------------------------------------------------------------

W1_CELL = """
import os, torch, ddpkit
import torch.nn.functional as F
from torch import nn
from ddpkit.datasets import DataOptions, load_images

torch.randn(800, 800) @ torch.randn(800, 800)   # the kernel has run torch work before the launch

def train(steps, seed):
    ctx = ddpkit.init()
    total = torch.tensor([float(ctx.rank + 1)])
    torch.distributed.all_reduce(total)
    torch.manual_seed(seed)
    train_set, _ = load_images("synthetic", DataOptions(synthetic_samples=64 * steps)).datasets()
    model = ddpkit.prepare_model(nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = ddpkit.DataLoader(train_set, global_batch_size=64, shuffle=True, seed=seed)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"loss {loss.item():.4f}")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": ctx.rank, "sum": total.item(), "steps": len(loader), "weights": weights}

results = ddpkit.launch(train, 3, SEED, nproc=2)
[(r["rank"], r["sum"], r["steps"]) for r in results]
"""

FAILING_CELL = """
def fails():
    ctx = ddpkit.init()
    if ctx.rank == 1:
        raise ValueError("rank 1 is broken")
    torch.distributed.barrier()

ddpkit.launch(fails, nproc=2)
"""

USER_ERROR_CELL = """
def refuses():
    if ddpkit.init().rank == 0:
        raise ddpkit.UserError("lr=-1 is not valid; it must be > 0")
    torch.distributed.barrier()

ddpkit.launch(refuses, nproc=2)
"""


def _kernel_manager():
    """A manager of a kernel run by this interpreter: ipykernel's own kernelspec, not one a user installed."""
    jupyter_client = pytest.importorskip("jupyter_client")
    from jupyter_client.kernelspec import KernelSpecManager

    # No folders to look in: "python3" is then ipykernel's native kernelspec, sys.executable -m ipykernel_launcher.
    return jupyter_client.KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))


@pytest.fixture(scope="module")
def notebook(tmp_path_factory) -> list:
    """The cells above, run in order by nbclient in a real ipykernel kernel: their outputs."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    seed = int(os.environ.get("DDPKIT_TEST_SEED", "0"))
    cells = [W1_CELL.replace("SEED", str(seed)), FAILING_CELL, USER_ERROR_CELL, "results[0]['weights'].sum().item()"]
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(cell) for cell in cells]
    folder = tmp_path_factory.mktemp("notebook")
    manager = _kernel_manager()
    client = nbclient.NotebookClient(
        book, km=manager, timeout=CELL_TIMEOUT, allow_errors=True, resources={"metadata": {"path": folder}}
    )
    try:
        client.execute(env=_environ())
    finally:
        manager.shutdown_kernel(now=True)  # a manager passed in stays the caller's to stop
    return [cell.outputs for cell in book.cells]


def _streams(outputs: list, name: str) -> list[str]:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == name).splitlines()


def test_a_notebook_cell_trains_w1_on_two_workers_and_returns_their_results(notebook):
    outputs = notebook[0]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, errors
    result = [o for o in outputs if o["output_type"] == "execute_result"]
    assert result[0]["data"]["text/plain"] == "[(0, 3.0, 3), (1, 3.0, 3)]"  # rank order; all_reduce; 3 steps
    lines = _streams(outputs, "stdout")
    assert len(lines) == 3 and all(line.startswith("loss ") for line in lines), lines  # rank 0's, once each


def test_a_notebook_cell_gets_the_failed_rank_as_one_error(notebook):
    (error,) = [o for o in notebook[1] if o["output_type"] == "error"]
    assert error["ename"] == "LaunchError"
    assert error["evalue"].startswith("error: worker rank 1 failed (exit code 1): ValueError: rank 1 is broken\n")
    assert error["evalue"].splitlines()[-2] == "ValueError: rank 1 is broken"
    (user_error,) = [o for o in notebook[2] if o["output_type"] == "error"]
    assert user_error["evalue"] == "error: worker rank 0 failed (exit code 1): lr=-1 is not valid; it must be > 0"


def test_the_kernel_goes_on_after_a_launch(notebook):
    (result,) = [o for o in notebook[3] if o["output_type"] == "execute_result"]
    float(result["data"]["text/plain"])  # the results stay in the kernel's namespace


SLEEPING_CELL = """
import os, time, torch, ddpkit

def sleeper():
    ddpkit.init()
    pids = [0, 0]
    torch.distributed.all_gather_object(pids, os.getpid())
    print("pid", *pids, flush=True)  # rank 0's: the cell shows it
    while True:
        time.sleep(0.05)

ddpkit.launch(sleeper, nproc=2)
"""


class _Kernel:
    """A real ipykernel kernel run by jupyter_client: execute a cell, read its output as it comes."""

    def __init__(self) -> None:
        self.manager = _kernel_manager()
        self.manager.start_kernel(env=_environ())
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=CELL_TIMEOUT)

    def start(self, code: str) -> str:
        """Send ``code`` to run; return the request's id.

        An error in it does not abort the requests sent after it (Jupyter's default within a short window).
        """
        return self.client.execute(code, stop_on_error=False)

    def worker_pids(self, request: str, count: int) -> list[int]:
        """The pids the workers of ``request`` printed ("pid N"), once ``count`` of them did."""
        pids: list[int] = []
        deadline = time.monotonic() + CELL_TIMEOUT
        while len(pids) < count:
            message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if message["parent_header"].get("msg_id") != request:
                continue
            content = message["content"]
            if message["msg_type"] == "error":
                raise AssertionError(content["evalue"])
            if message["msg_type"] == "stream":  # rank 0's line names every worker's pid
                pids += [
                    int(pid)
                    for line in content["text"].splitlines()
                    if line.startswith("pid ")
                    for pid in line.split()[1:]
                ]
        return pids

    def wait_for_line(self, request: str, line: str) -> None:
        """Read the output of ``request`` until a line starts with ``line``."""
        deadline = time.monotonic() + CELL_TIMEOUT
        while True:
            message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if message["parent_header"].get("msg_id") != request:
                continue
            if message["msg_type"] == "error":
                raise AssertionError(message["content"]["evalue"])
            if message["msg_type"] == "stream" and any(
                text.startswith(line) for text in message["content"]["text"].splitlines()
            ):
                return

    def result(self, request: str) -> str:
        """The text of ``request``'s result (its last expression), once it finished."""
        deadline = time.monotonic() + CELL_TIMEOUT
        while True:
            message = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if message["parent_header"].get("msg_id") != request:
                continue
            if message["msg_type"] == "error":
                raise AssertionError(message["content"]["evalue"])
            if message["msg_type"] == "execute_result":
                return message["content"]["data"]["text/plain"]

    def reply(self, request: str) -> dict:
        """The request's execute_reply content (its status, and ename for an error)."""
        while True:
            message = self.client.get_shell_msg(timeout=CELL_TIMEOUT)
            if message["parent_header"].get("msg_id") == request:
                return message["content"]

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def test_the_stop_button_stops_the_workers_and_the_kernel_goes_on():
    kernel = _Kernel()
    pids: list[int] = []
    try:
        request = kernel.start(SLEEPING_CELL)
        pids = kernel.worker_pids(request, 2)
        kernel.manager.interrupt_kernel()  # the notebook's stop button
        reply = kernel.reply(request)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        assert _gone(pids) == []
        after = kernel.start("1 + 1")
        assert kernel.reply(after)["status"] == "ok"
    finally:
        kernel.close()
        _kill(pids)


def test_a_kernel_that_dies_takes_its_workers_with_it():
    kernel = _Kernel()
    pids: list[int] = []
    try:
        request = kernel.start(SLEEPING_CELL)
        pids = kernel.worker_pids(request, 2)
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)  # as a restart that waited too long does
        assert _gone(pids) == []
    finally:
        kernel.close()
        _kill(pids)


# -- mp.spawn's shape, ported: stopped mid-epoch and run again ----------------------------------------


def _spawn_shape(folder: Path, out: str, *, stop: str = "") -> subprocess.CompletedProcess:
    """Run tests/launchers/scripts/spawn_shape.py (2 workers, 2 epochs of 64 steps); ``stop``: the signal for its launcher."""
    environ = _environ()
    if stop:
        environ.update(STOP_AT_STEP="20", STOP_SIGNAL=stop)
    command = [sys.executable, str(SCRIPTS / "spawn_shape.py"), "--samples", "4096", "--save-every", "16"]
    return subprocess.run(
        [*command, "--out", out, "--final", f"{out}.pt"],
        cwd=folder,
        env=environ,
        capture_output=True,
        text=True,
        timeout=CELL_TIMEOUT,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("spawn-shape")
    run = _spawn_shape(folder, "whole")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "done: 128 steps on each of 2 ranks" in run.stdout
    return torch.load(folder / "whole.pt")


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGKILL"])
def test_an_mp_spawn_script_ported_stopped_mid_epoch_and_run_again_ends_bit_equal(tmp_path, uninterrupted, stop):
    stopped = _spawn_shape(tmp_path, "run", stop=stop)
    if stop == "SIGINT":  # Ctrl-C: the workers write a checkpoint at the step they agree on, then stop
        assert stopped.returncode == 130, stopped.stdout + stopped.stderr
        assert "interrupted: run the same command again to continue" in stopped.stderr
        assert "(preempted)" in stopped.stderr  # ddpkit's log, on rank 0's stderr
    else:  # the launcher killed: its workers die with it; the periodic checkpoints remain
        assert stopped.returncode == -signal.SIGKILL
    checkpoints = sorted(p.name for p in (tmp_path / "run").glob("step-*"))
    last = int(checkpoints[-1].split("-")[1])
    assert last % 64, f"the run stopped at the end of an epoch ({checkpoints}): the test wants one mid-epoch"
    again = _spawn_shape(tmp_path, "run")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from run/step-{last:09d}" in again.stderr
    resumed = torch.load(tmp_path / "run.pt")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_sigterm_to_the_launcher_is_a_preemption_with_a_checkpoint(tmp_path):
    stopped = _spawn_shape(tmp_path, "run", stop="SIGTERM")
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr  # the script does not catch LaunchError
    assert "failed (exit code 75): stopped by a signal after writing a checkpoint; call ddpkit.launch again" in (
        stopped.stderr
    )
    assert "(preempted)" in stopped.stderr


def test_the_example_notebook_trains_and_a_second_launch_resumes(tmp_path):
    """examples/launch_from_a_notebook.ipynb with tiny synthetic data; its launch cell run twice."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    book = nbformat.read(REPO / "examples" / "launch_from_a_notebook.ipynb", as_version=4)
    parameters = next(cell for cell in book.cells if cell.source.startswith("EPOCHS, DATASET, SAMPLES ="))
    parameters.source = 'EPOCHS, DATASET, SAMPLES = 2, "synthetic", 512'
    book.cells.append(nbformat.v4.new_code_cell(book.cells[-1].source))  # the launch again: resumes, ends at once
    manager = _kernel_manager()
    client = nbclient.NotebookClient(book, km=manager, timeout=CELL_TIMEOUT, resources={"metadata": {"path": tmp_path}})
    try:
        client.execute(env=_environ())
    finally:
        manager.shutdown_kernel(now=True)
    first, again = (_streams(cell.outputs, "stdout") for cell in book.cells[-2:])
    assert "epoch 2: loss" in " ".join(first) and first[-1].startswith("test accuracy ")
    assert again[-1] == first[-1]  # the same weights: the second launch resumed after the last epoch
    assert any("resumed from runs/notebook/step-" in line for line in _streams(book.cells[-1].outputs, "stderr"))


STOPPABLE_TRAINING = """
import time, torch, ddpkit
import torch.nn.functional as F
from torch import nn
from ddpkit.datasets import DataOptions, load_images

def train(out, pause):
    ctx = ddpkit.init()
    torch.manual_seed(SEED)
    train_set, _ = load_images("synthetic", DataOptions(synthetic_samples=1024, seed=SEED)).datasets()
    model = ddpkit.prepare_model(nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = ddpkit.DataLoader(train_set, global_batch_size=64, shuffle=True, seed=SEED)
    ckpt = ddpkit.Checkpointer(out, model=model, optimizer=optimizer, loader=loader, every_steps=100)
    start = ckpt.resume("auto")
    step = start.global_step
    for epoch in range(start.epoch, 2):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()
            step += 1
            if ctx.rank == 0:
                print(f"step {step}", flush=True)
            time.sleep(pause)
    ckpt.close()
    return [p.detach().clone() for p in ddpkit.unwrap_model(model).parameters()]

whole = ddpkit.launch(train, "OUT/whole", 0.0, nproc=2)
"""


def test_the_stop_button_keeps_a_checkpoint_and_the_next_launch_ends_bit_equal(tmp_path, seed):
    kernel = _Kernel()
    try:
        setup = kernel.start(STOPPABLE_TRAINING.replace("SEED", str(seed)).replace("OUT", str(tmp_path)))
        assert kernel.reply(setup)["status"] == "ok"
        request = kernel.start(f"ddpkit.launch(train, '{tmp_path}/stopped', 0.05, nproc=2)")
        kernel.wait_for_line(request, "step 5")  # 16 steps an epoch: stopped in the first
        kernel.manager.interrupt_kernel()
        assert kernel.reply(request)["ename"] == "KeyboardInterrupt"
        (checkpoint,) = [p.name for p in (tmp_path / "stopped").glob("step-*")]
        assert 5 <= int(checkpoint.split("-")[1]) < 16  # written at the step the workers agreed on, mid-epoch
        again = kernel.start(
            f"again = ddpkit.launch(train, '{tmp_path}/stopped', 0.0, nproc=2)\n"
            "all(torch.equal(a, b) for a, b in zip(whole[0], again[0])), len(whole[0])"
        )
        assert kernel.result(again) == "(True, 4)"
    finally:
        kernel.close()


def test_ddpkit_launch_is_a_plain_function_beside_the_launchers_package():
    import importlib
    import inspect

    import ddpkit
    from ddpkit import launch

    importlib.import_module("ddpkit.launchers.local")  # the package of the launchers, under its own name
    assert ddpkit.launch is launch and inspect.isfunction(launch)
    assert "nproc" in inspect.signature(ddpkit.launch).parameters
    package = Path(ddpkit.__file__).parent
    assert not [p for p in package.rglob("*.py") if "__class__ =" in p.read_text()], "no module changes its class"
