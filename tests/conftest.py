"""Guards every test: no leaked environment, process group or child process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from ddpkit.data.datasets import FASHION_MNIST
from ddpkit.data.sources import DataNotFoundError, locate


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as in a terminal, also when the suite runs as a background job (``nohup ... &``).

    A shell starts background jobs with SIGINT ignored, and Python then leaves
    it ignored: the tests that press Ctrl-C (in this process or in the workers
    it starts, which inherit the setting) would wait for an interrupt that never comes.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a slow test first, in their order, then the others.

    scripts/test.sh hands whole modules to two pytest-xdist workers in
    collection order (``--dist loadfile``); the long modules started first
    leave the short ones to fill the gaps, instead of one long module
    running alone at the end.
    """
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)  # a stable sort: the order within each kind stays


@pytest.fixture(autouse=True)
def _no_leaked_environment():
    before = dict(os.environ)
    yield
    changed = {k for k in os.environ if os.environ.get(k) != before.get(k)} | (set(before) - set(os.environ))
    # pytest's own bookkeeping, and the cache folder torch._dynamo sets on first import.
    leaked = changed - {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}
    os.environ.clear()
    os.environ.update(before)
    assert not leaked, f"test changed environment variables {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _no_process_group_left():
    yield
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        dist.destroy_process_group()
    assert not initialized, "test left a torch.distributed process group initialized"


@pytest.fixture(autouse=True)
def _no_stray_children():
    yield
    children = [c for c in psutil.Process().children(recursive=True) if _is_alive(c)]
    for child in children:
        child.kill()
    assert not children, f"test left child processes running: {[c.pid for c in children]}"


def _is_alive(proc: psutil.Process) -> bool:
    try:
        # multiprocessing's resource tracker lives as long as the test session.
        return proc.status() != psutil.STATUS_ZOMBIE and not any("resource_tracker" in part for part in proc.cmdline())
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def fashion_mnist() -> Path:
    """The folder ddpkit finds the real Fashion-MNIST files in without a download; skips the test without them."""
    try:
        return locate(FASHION_MNIST, download=False)
    except DataNotFoundError as e:
        pytest.skip(f"needs the real Fashion-MNIST files (run `bash scripts/setup.sh --test`): {e}")


@pytest.fixture
def seed(request) -> int:
    """The seed of a test's random choices: DDPKIT_TEST_SEED (default 0), printed so that a failure can be replayed."""
    value = int(os.environ.get("DDPKIT_TEST_SEED", "0"))
    print(f"DDPKIT_TEST_SEED={value} for {request.node.nodeid}")
    return value
