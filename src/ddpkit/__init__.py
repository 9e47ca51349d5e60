"""ddpkit: data-parallel PyTorch training from one command, anywhere.

From a script of your own::

    import ddpkit

    ctx = ddpkit.init()              # rank, local_rank, world_size, device, backend...
    with ddpkit.main_process_first():
        ...                          # prepare data once per node
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["Context", "context", "init", "main_process_first", "shutdown", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `ddpkit slurm` and `ddpkit --help` need not wait for torch.
    if name in __all__:
        return getattr(importlib.import_module("ddpkit.distributed"), name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
