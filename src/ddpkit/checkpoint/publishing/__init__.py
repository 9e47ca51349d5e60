"""Publishing trained weights: exporting a checkpoint as a model folder (``model.pt``, ``model.json``), a
sharded one gathered into one file, and transferring weights into another model. Other packages reach
these through :mod:`ddpkit.checkpoint`."""
