"""The Checkpointer and its parts: when to save (the schedule, preemption), one save (what it holds, every
rank checking in), which checkpoint to resume and restoring it, and the advice said once. Other packages
reach these through :mod:`ddpkit.checkpoint`."""
