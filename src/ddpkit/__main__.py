"""``python -m ddpkit``: the same as the ``ddpkit`` command."""

from ddpkit.commands.dispatch import run

run()
