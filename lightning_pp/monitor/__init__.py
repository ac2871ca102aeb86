"""``PipelineMonitor`` (``callback``): where each stage's time and memory go, measured by the executor on request
(``telemetry``) and drawn as timelines; ``memory``: activation and allocator memory of a step.

May import: ``schedule``, ``parallel``, ``errors``."""
