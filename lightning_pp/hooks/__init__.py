"""The strategy's Lightning hooks by concern, as mixins of :class:`~lightning_pp.PipelineParallelStrategy`: which
samples each rank loads (``data``), the collectives Lightning and torchmetrics call (``collectives``), the starts and
ends of Lightning's loops (``loops``).

May import: ``model``, ``parallel``, ``errors``, ``_compat``."""
