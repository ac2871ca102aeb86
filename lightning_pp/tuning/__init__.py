"""Choosing how to pipeline from measured costs: ``balance`` (blocks per stage by parameters or measured time),
``search`` (the simulator's search over schedules, micro-batches, splits and recomputation) and ``autotune``
(``schedule="auto"`` at fit's start: measure, search, agree on every rank).

May import: ``model``, ``runtime``, ``schedule``, ``parallel``, ``run``, ``options``, ``errors``, ``_compat``."""
