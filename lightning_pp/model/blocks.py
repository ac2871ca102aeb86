"""Finding the container of repeated blocks (an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``) to split."""

from __future__ import annotations

from collections import Counter

from torch import nn

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError

__all__ = ["CONTAINERS", "block_count", "find_blocks"]

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# a container is a candidate when its most common block type makes up at least this share of its blocks, or when every
# block holds weights and there are at most (blocks x this) types (attention and MLP blocks alternating, a projection
# block between them)
_REPEATED_SHARE = 0.5
# two candidates are ambiguous when the smaller holds at least this share of the larger one's parameters
_AMBIGUOUS_SHARE = 0.5


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_count(container: nn.Module) -> int:
    return len(_compat.child_names(container))


def _is_repeated(container: nn.Module) -> bool:
    blocks = list(container.children())
    if len(blocks) < 2 or _parameter_count(container) == 0:
        return False
    types = Counter(type(b) for b in blocks)
    if types.most_common(1)[0][1] >= _REPEATED_SHARE * len(blocks):
        return True
    return len(types) <= _REPEATED_SHARE * len(blocks) and all(_parameter_count(b) > 0 for b in blocks)


def _candidates(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Containers of repeated blocks, outermost first; nothing inside a candidate (a block's own layers) counts."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, CONTAINERS) and _is_repeated(child):
            found.append((path, child))
        else:
            found += _candidates(child, path + ".")
    return found


def _single_block_containers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Containers holding exactly one block with weights: what a user may have meant as the block container."""
    return [(name, sub) for name, sub in module.named_modules()
            if name and isinstance(sub, CONTAINERS) and block_count(sub) == 1 and _parameter_count(sub) > 0]


def _describe(candidates: list[tuple[str, nn.Module]]) -> str:
    return ", ".join(f"'{path}' ({block_count(c)} blocks, {_parameter_count(c):,} parameters)"
                     for path, c in candidates)


def find_blocks(module: nn.Module, name: str | None) -> tuple[str, nn.Module]:
    """The container to split into stages: the one at dotted path ``name``, or by default the container of repeated
    blocks (most blocks of one type, or blocks of a few types that all hold weights) that holds the most parameters,
    not counting containers inside a block."""
    if name is not None:
        try:
            container = module.get_submodule(name)
        except AttributeError:
            container = None
        if not isinstance(container, CONTAINERS) or block_count(container) == 0:
            found = type(container).__name__ if container is not None else "nothing"
            raise PipelineConfigError(
                f"PipelineParallelStrategy(blocks={name!r}): {type(module).__name__} has {found} at {name!r}, not "
                f"an nn.Sequential, nn.ModuleList or nn.ModuleDict of blocks. Containers of repeated blocks found: "
                f"{_describe(_candidates(module)) or 'none'}."
            )
        return name, container
    candidates = sorted(_candidates(module), key=lambda item: -_parameter_count(item[1]))
    single = _single_block_containers(module) if not candidates else []
    if single:
        raise PipelineConfigError(
            f"{type(module).__name__}'s block container "
            f"{', '.join(f'{path!r} ({type(c).__name__}, {_parameter_count(c):,} parameters)' for path, c in single)} "
            f"has 1 block; the pipeline splits a "
            f"container's blocks into stages, at least one block per stage. Put the repeated layers in it as separate "
            f"blocks (nn.Sequential(*layers), not one module holding them all), or name a container of several blocks "
            f"with PipelineParallelStrategy(blocks='model.layers')."
        )
    if not candidates:
        raise PipelineConfigError(
            f"{type(module).__name__} has no nn.Sequential, nn.ModuleList or nn.ModuleDict of repeated blocks to split "
            f"into pipeline stages. Put the repeated layers (e.g. transformer blocks) in one, or name the container "
            f"with PipelineParallelStrategy(blocks='model.layers')."
        )
    if len(candidates) > 1 and _parameter_count(candidates[1][1]) >= _AMBIGUOUS_SHARE * _parameter_count(
        candidates[0][1]
    ):
        raise PipelineConfigError(
            f"{type(module).__name__} has several containers of repeated blocks of similar size: "
            f"{_describe(candidates)}. The pipeline splits one container, whose blocks run one after the other in "
            f"the step; a model whose blocks span two containers (an encoder-decoder such as nn.Transformer or T5) is "
            f"not split across both. Name the one to split with PipelineParallelStrategy(blocks=...); the other "
            f"container then runs, replicated, on every stage that needs it."
        )
    return candidates[0]
