"""Checkpoints of a pipelined module: what each rank saves and loads (``state``: the full format gathered on
global rank 0 that plain Lightning loads, the sharded one written by every rank) and how a checkpoint sits on disk as a
whole (``files``: atomic sharded folders, strict loading).

May import: ``parallel``, ``errors``, ``_compat``."""
