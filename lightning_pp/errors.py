"""Exception types raised by lightning_pp, each naming the rule broken, the values involved and the fix."""

from __future__ import annotations

__all__ = ["PipelineBatchError", "PipelineCheckpointError", "PipelineCommError", "PipelineConfigError",
           "PipelineScheduleError", "PipelineTimeoutError"]


class PipelineConfigError(ValueError):
    """The strategy, the module or the batch does not fit the pipeline (raised before any collective)."""


class PipelineCheckpointError(PipelineConfigError):
    """A checkpoint does not fit the module (entries it lacks or another model's) or is not whole (a file cut short
    or missing); raised alike on every rank, before any collective that could leave one waiting."""


class PipelineBatchError(PipelineConfigError):
    """The stages of a pipeline loaded different batches (another sampler, shuffle or number of batches per rank),
    raised on every stage of the pipeline at the step where it shows."""


class PipelineScheduleError(ValueError):
    """A schedule's action lists are inconsistent: a missing action, an unmatched send or a deadlock."""


class PipelineCommError(RuntimeError):
    """A point-to-point transfer between two stages failed (for example because the peer died)."""


class PipelineTimeoutError(PipelineCommError):
    """A point-to-point transfer did not complete within the strategy's ``transfer_timeout``."""
