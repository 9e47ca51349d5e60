"""Every test in tests/gpu is marked ``gpu`` and skipped, with the reason "needs CUDA", where CUDA is unavailable.

Run the suite on a machine with CUDA (README, "GPU")::

    .venv/bin/python -m pytest tests/gpu -m gpu
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with the whole session's items: only this folder's are marked.
    cuda = torch.cuda.is_available()
    for item in items:
        if GPU_TESTS in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
