"""The Checkpointer and its parts: save and resume any training loop's state, exactly.

It is handed explicit objects, anything with ``state_dict()`` and
``load_state_dict()`` (a DDP wrapper is unwrapped), never reads a trainer's
attributes and never steps anything::

    ckpt = ddpkit.Checkpointer("runs/mine", model=model, optimizer=opt, scheduler=sched,
                               loader=loader, every_steps=500)
    start = ckpt.resume("auto")            # or "never", or the path of one checkpoint
    for epoch in range(start.epoch, epochs):
        loader.set_epoch(epoch)            # continues mid-epoch after a resume
        for i, (x, y) in ckpt.enumerate(loader):  # i: the batch's index in its epoch, also after a resume
            ...                            # forward, backward, optimizer.step(), sched.step()
            ckpt.step()                    # counts the step; saves when due; handles preemption
        ckpt.epoch_end({"accuracy": acc})  # optional: metrics for the best checkpoint
    ckpt.close()                           # writes the final state: the steps since the last checkpoint

The parts, each documented where it lives (the manual's docs/guides/checkpoints.md and docs/design/layers.md):

- when: :mod:`~ddpkit.checkpoint.manager.schedule` (pure; a ddpkit.DataLoader's step
  boundaries), the agreed signals and clock of :mod:`~ddpkit.checkpoint.manager.preemption`;
- one save: :mod:`~ddpkit.checkpoint.manager.saving`; what it holds:
  :mod:`~ddpkit.checkpoint.manager.contents`; on disk: :mod:`~ddpkit.checkpoint.disk.writer`
  (:mod:`~ddpkit.checkpoint.sharded.state` for a sharded model), :mod:`~ddpkit.checkpoint.disk.format`;
- resuming: :mod:`~ddpkit.checkpoint.manager.select` (which one), :mod:`~ddpkit.checkpoint.manager.restore`;
- the options: :class:`~ddpkit.checkpoint.options.CheckpointOptions`;
- in object storage (``ddpkit.Checkpointer("s3://bucket/prefix/run", ...)``): the same checkpoints staged
  on disk and uploaded in the background, :mod:`ddpkit.checkpoint.remote`.

Saving is collective: every rank calls ``step()``/``save()`` at the same
points and rank 0 writes (every rank its shards, for a sharded model); a save
some ranks never reach fails naming them (:mod:`ddpkit.checkpoint.manager.checkin`).
With the same world size a resumed run continues bit for bit (a torch
DataLoader given as ``loader=``: with its batches skipped by ``enumerate()``, read
in the training process). With another world size it is not bit-identical, and
a warning says what carries over: with a ddpkit.DataLoader the global batch and
the sample order; without one, neither.

Other packages reach these through :mod:`ddpkit.checkpoint`.
"""
