"""The ``ddpkit`` command's front-ends, one module per command, over the library (nothing else imports them).

- ``dispatch``: the ``ddpkit`` console script and ``python -m ddpkit``: picks the command, prints its help,
  turns a user's error into one line and an exit status.
- ``help``: ``--help`` generated from each command's config dataclass.
- ``train``, ``run``, ``doctor``, ``slurm``, ``bench``, ``checkpoints``, ``export``, ``plot``: one command each;
  ``launching``: the launch and the exit statuses that ``train`` and ``run`` share.
"""
