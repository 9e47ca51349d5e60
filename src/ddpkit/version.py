"""ddpkit's version: a leaf module, so any layer can read it without importing the package top."""

__version__ = "0.1.0"
