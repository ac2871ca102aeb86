"""Splitting a module: this stage keeps its run of blocks, and what it must remember of the whole model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_pp import _compat
from lightning_pp._logging import EVERY_RANK, get_logger
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.blocks import block_count, find_blocks
from lightning_pp.model.stage import StageView
from lightning_pp.schedule.partition import stage_layer_ranges, uniform_balance, validate_balance

__all__ = ["Partition", "split_module"]

log = get_logger(__name__)


@dataclass(frozen=True)
class Partition:
    """A module's split, recorded when it was made: the stage view and the unsplit model's layout."""

    view: StageView
    full_param_order: dict[str, int]  # parameter name -> position in the whole model (full checkpoints follow it)
    full_state_keys: list[str]

    def shared_tensors(self, module: nn.Module) -> tuple[list[nn.Parameter], list[Tensor]]:
        """The parameters and buffers outside the blocks, which every stage holds until a training step places them
        (trainable now or not)."""
        local = {id(t) for block in self.view.local_blocks() for t in (*block.parameters(), *block.buffers())}
        return ([p for p in module.parameters() if id(p) not in local],
                [b for b in module.buffers() if id(b) not in local])


# modules already split in this process (a second fit / validate / test reuses the split)
def split_module(module: nn.Module, blocks: str | None, balance: Sequence[int] | None, stages: Sequence[int],
                 num_stages: int, earlier: Partition | None = None, stages_per_rank: int = 1) -> Partition:
    """Keep only the blocks of ``stages`` (this rank's) of the container (the others become stand-ins); everything
    else stays. ``earlier``: the split an earlier run made of ``module``, which is kept whatever ``balance`` says;
    ``stages_per_rank``: how many of the ``num_stages`` each rank holds."""
    existing = earlier
    if existing is not None:
        view = existing.view
        if (view.stages, view.num_stages) != (tuple(stages), num_stages):
            raise PipelineConfigError(
                f"`{view.container_name}` was already split for stages {list(view.stages)} of {view.num_stages}; this "
                f"run holds stages {list(stages)} of {num_stages}. Build a fresh module for a new layout."
            )
        return existing
    name, container = find_blocks(module, blocks)
    num_blocks = block_count(container)
    counts = (validate_balance(balance, num_blocks, num_stages) if balance is not None
              else uniform_balance(num_blocks, num_stages, stages_per_rank))
    ranges = stage_layer_ranges(counts)
    _check_no_shared_parameters(module, name, container, ranges)
    full_param_order = {n: i for i, (n, _) in enumerate(module.named_parameters())}
    full_state_keys = list(module.state_dict())
    partition = Partition(StageView(name, container, stages, ranges), full_param_order, full_state_keys)
    held = ", ".join(f"stage {s}: blocks {ranges[s].start}-{ranges[s].stop - 1}" for s in stages)
    log.debug(f"This rank holds {held} of `{name}` ({num_blocks} blocks)", extra=EVERY_RANK)
    return partition


def _check_no_shared_parameters(module: nn.Module, name: str, container: nn.Module, ranges: list[range]) -> None:
    """Blocks of different stages, or a block and the code outside the container, must not share a weight."""
    owner: dict[int, int] = {}
    blocks = [getattr(container, key) for key in _compat.child_names(container)]
    for stage, blocks_of_stage in enumerate(ranges):
        for i in blocks_of_stage:
            for p in blocks[i].parameters():
                if owner.setdefault(id(p), stage) != stage:
                    raise PipelineConfigError(
                        f"A parameter of block {i} of `{name}` is shared with a block of stage {owner[id(p)]}, and "
                        f"stages cannot share weights. Choose a balance that keeps the sharing blocks on one stage."
                    )
    prefix = name + "."
    for param_name, p in module.named_parameters(remove_duplicate=False):
        if not param_name.startswith(prefix) and id(p) in owner:
            raise PipelineConfigError(
                f"Parameter `{param_name}` is shared with a block of `{name}`; a weight inside the split container "
                f"cannot also be used outside it. Move the tied layer out of `{name}`."
            )
