"""ddpkit: data-parallel PyTorch training from one command, anywhere.

From a script of your own::

    import ddpkit

    ctx = ddpkit.init()              # rank, local_rank, world_size, device, backend...
    with ddpkit.main_process_first():
        ...                          # prepare data once per node
"""

from ddpkit.distributed import Context, context, init, main_process_first, shutdown

__version__ = "0.1.0"

__all__ = ["Context", "context", "init", "main_process_first", "shutdown", "__version__"]
