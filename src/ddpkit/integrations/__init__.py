"""ddpkit inside other tools' launchers and trainers: one module per tool, each imported on its own.

- :mod:`ddpkit.integrations.lightning`: ``DdpkitEnvironment``, a Lightning
  ``ClusterEnvironment`` that reads ddpkit's environment detection, for a
  Trainer or Fabric script started by ``ddpkit run``, srun or mpirun
  (``pip install ddpkit[lightning]``).
- :mod:`ddpkit.integrations.torchx`: torchx components that start
  ``ddpkit train`` or ``ddpkit run SCRIPT`` on any scheduler torchx supports
  (``pip install ddpkit[torchx]``).

Nothing is imported here: each module needs its tool installed, and importing
this package must not.
"""
