"""The facts several layers share, each with one home: exit statuses, signal names, mode names.

Plain constants, no imports: the core (``prepare``, ``checkpoint``, ``data``), the launcher and the
``ddpkit`` command read them from here, so no layer has to import another that sits above it
(``ddpkit.keyvalue``, ``ddpkit.commands``) to learn a number or a name.
"""

from __future__ import annotations

# -- exit statuses: what a worker and the ``ddpkit`` command return ----------

EXIT_WORKER_FAILED = 1
"""Exit status of ``ddpkit train``/``ddpkit run`` when a worker failed."""
EXIT_USER_ERROR = 2
"""Exit status after a :class:`ddpkit.UserError`: a one-line message names the fix."""
EXIT_PREEMPTED = 75
"""Exit status of a worker after a preemption checkpoint (EX_TEMPFAIL): restart me; and of ``ddpkit train`` and
``ddpkit run`` when their workers exited with it (also after a signal to the launcher, which passes it on)."""
EXIT_INTERRUPTED = 130
"""Exit status after a checkpoint made for Ctrl-C (SIGINT): 128 + 2, what shells report for an interrupted command."""
EXIT_STORAGE = 74
"""Exit status of a worker (and of ``ddpkit train``/``ddpkit run``) whose checkpoint could not be written
(no space, read-only or vanished folder, quota): EX_IOERR. A restart would fail the same way until it is fixed."""
EXIT_DIVERGED = 65
"""Exit status of a worker (and of ``ddpkit train``) whose training loss became NaN or infinite (EX_DATAERR):
the last good checkpoint is kept and named; a restart would diverge the same way with the same settings."""

# -- signals ------------------------------------------------------------------

PREEMPTION_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""Signals that may be configured to mean "checkpoint now and exit" (checkpoint.preempt_signals)."""
DEFAULT_PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
"""Signals that, by default, mean "checkpoint now and exit" (status 75; 130 for SIGINT, Ctrl-C)."""

# -- mode names ---------------------------------------------------------------

GRAD_SYNC_MODES = ("auto", "ddp", "flat", "manual")
"""Values of ``grad_sync`` (``ddpkit.prepare_model`` and ``ddpkit train``; see ddpkit.comm.grad_sync)."""
TASKS = ("classification", "regression", "reconstruction")
"""What a model learns (``ModelSpec.task``): the loss and the metrics of ``ddpkit train``."""
