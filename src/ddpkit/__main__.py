"""``python -m ddpkit``: the same as the ``ddpkit`` command."""

from ddpkit.cli import run

run()
