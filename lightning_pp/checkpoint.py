"""Optimizer state keyed by parameter name: the form in which stages exchange, merge and re-key checkpoint state.

torch numbers optimizer state by position (parameter ``i`` of the optimizer), which differs between a stage and the
full model. Keying by parameter name lets a full checkpoint be re-keyed to the single-device numbering plain Lightning
expects, and lets any checkpoint (full, sharded, single-device, from another number of stages) be loaded by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_pp.errors import PipelineConfigError

__all__ = ["indexed_to_named", "load_named", "merge_named", "named_state", "named_to_indexed"]

# {"groups": [hyper-parameters of each param group], "names": [[parameter names of each group]],
#  "state": {parameter name: per-parameter state}}
NamedState = dict[str, Any]
NAMES_KEY = "lightning_pp_param_names"  # stored beside "state" and "param_groups" in full checkpoints


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def named_state(optimizer: Optimizer, name_of: Mapping[int, str]) -> NamedState:
    """This optimizer's state with parameters named (``name_of`` maps ``id(param)`` to its name)."""
    indexed = optimizer.state_dict()
    names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    return indexed_to_named(indexed, names)


def indexed_to_named(indexed: Mapping[str, Any], names: Sequence[Sequence[str]]) -> NamedState:
    """torch's ``state_dict`` form to the named form, given the names of each group's parameters in order."""
    groups = indexed["param_groups"]
    if len(groups) != len(names) or any(len(g["params"]) != len(n) for g, n in zip(groups, names, strict=False)):
        raise PipelineConfigError(
            f"The checkpoint's optimizer has param groups of sizes {[len(g['params']) for g in groups]} but the "
            f"model's optimizer has {[len(n) for n in names]}. Use the same configure_optimizers as when saving."
        )
    state = indexed["state"]
    named: dict[str, Any] = {}
    for group, group_names in zip(groups, names, strict=True):
        for index, name in zip(group["params"], group_names, strict=True):
            if index in state:
                named[name] = _to_cpu(state[index])
    return {
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
        "names": [list(n) for n in names],
        "state": named,
    }


def merge_named(parts: Sequence[NamedState], order: Mapping[str, int]) -> NamedState:
    """Merge the named states of several stages: each group's names in full-model order, each name once."""
    groups = parts[0]["groups"]
    names: list[list[str]] = []
    for group_index in range(len(groups)):
        union = {n for part in parts for n in part["names"][group_index]}
        names.append(sorted(union, key=lambda n: order[n]))
    state: dict[str, Any] = {}
    for part in parts:
        for name, value in part["state"].items():
            state.setdefault(name, value)  # replicated parameters have identical state on every stage
    return {"groups": groups, "names": names, "state": state}


def named_to_indexed(named: NamedState) -> dict[str, Any]:
    """The named form to torch's ``state_dict`` form (numbered group by group), with the names kept beside."""
    state: dict[int, Any] = {}
    param_groups = []
    index = 0
    for hyper, group_names in zip(named["groups"], named["names"], strict=True):
        indices = []
        for name in group_names:
            if name in named["state"]:
                state[index] = named["state"][name]
            indices.append(index)
            index += 1
        param_groups.append({**hyper, "params": indices})
    return {"state": state, "param_groups": param_groups, NAMES_KEY: named["names"]}


def load_named(optimizer: Optimizer, named: NamedState, name_of: Mapping[int, str]) -> None:
    """Load the entries of ``named`` that belong to this optimizer's parameters (hyper-parameters per group)."""
    local_names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if len(local_names) != len(named["groups"]):
        raise PipelineConfigError(
            f"The checkpoint's optimizer has {len(named['groups'])} param groups but the model's has "
            f"{len(local_names)}. Use the same configure_optimizers as when saving."
        )
    missing = [n for group in local_names for n in group if n not in {m for g in named["names"] for m in g}]
    if missing:
        raise PipelineConfigError(
            f"The checkpoint's optimizer state has no entry for parameters {missing[:5]}; it was saved for a "
            f"different model or optimizer configuration."
        )
    indexed = named_to_indexed({**named, "names": local_names})
    del indexed[NAMES_KEY]
    optimizer.load_state_dict(indexed)
