"""ddpkit: data-parallel PyTorch training from one command, anywhere."""

__version__ = "0.1.0"
