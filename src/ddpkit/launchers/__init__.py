"""Starting workers: on this machine (local, function), in sbatch scripts, under mpirun.

The public way to start workers from Python is the function ``ddpkit.launch(fn, *args, nproc=N)``
(:func:`ddpkit.launchers.function.launch`); this package holds the launchers behind it and behind
``ddpkit run`` and ``ddpkit train``.
"""
