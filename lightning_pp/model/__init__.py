"""The LightningModule adapter: which blocks a stage holds, the stage's view of the container, the step driver over
micro-batches, the weights outside the blocks, and one Trainer run on the assembled stage (``session``).

May import: ``pipedream``, ``runtime``, ``monitor``, ``checkpoint``, ``parallel``, ``schedule``, ``run``, ``options``,
``errors``, ``_compat``."""
