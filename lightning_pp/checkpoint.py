"""Checkpoints of a pipelined module (:class:`StageCheckpoints`), and optimizer state keyed by parameter name: the
form in which stages exchange, merge and re-key checkpoint state.

torch numbers optimizer state by position (parameter ``i`` of the optimizer), which differs between a stage and the
full model. Keying by parameter name lets a full checkpoint be re-keyed to the single-device numbering plain Lightning
expects, and lets any checkpoint (full, sharded, single-device, from another number of stages) be loaded by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_pp._compat import _optimizers_to_device
from lightning_pp.errors import PipelineConfigError
from lightning_pp.sharding import full_tensors, shard_like
from lightning_pp.topology import object_group_now

__all__ = ["PENDING_GRADIENT_KEY", "StageCheckpoints", "indexed_to_named", "load_named", "merge_named", "named_state",
           "named_to_indexed"]

# {"groups": [hyper-parameters of each param group], "names": [[parameter names of each group]],
#  "state": {parameter name: per-parameter state}}
NamedState = dict[str, Any]
NAMES_KEY = "lightning_pp_param_names"  # stored beside "state" and "param_groups" in full checkpoints
# schedule="pipedream_2bw": the gradient the next optimizer step applies, by parameter name (a top-level entry)
PENDING_GRADIENT_KEY = "lightning_pp_pending_gradient"
_MODEL, _OPTIMIZER = "state_dict", "optimizer_states"  # key prefixes in a sharded (distributed checkpoint) folder


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def named_state(optimizer: Optimizer, name_of: Mapping[int, str], whole: bool = True) -> NamedState:
    """This optimizer's state with parameters named (``name_of`` maps ``id(param)`` to its name); sharded tensors
    gathered whole on the CPU (``whole``), or kept as they are."""
    indexed = optimizer.state_dict()
    names = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if not whole:
        return indexed_to_named(indexed, names, to_cpu=False)
    return indexed_to_named({**indexed, "state": full_tensors(indexed["state"])}, names)


def indexed_to_named(indexed: Mapping[str, Any], names: Sequence[Sequence[str]], to_cpu: bool = True) -> NamedState:
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
                named[name] = _to_cpu(state[index]) if to_cpu else dict(state[index])
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
    params = {name_of[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    state = {name: {k: shard_like(v, params[name]) if isinstance(v, torch.Tensor) and v.shape == params[name].shape
                    else v for k, v in value.items()} if name in params else value
             for name, value in named["state"].items()}
    indexed = named_to_indexed({**named, "names": local_names, "state": state})
    del indexed[NAMES_KEY]
    optimizer.load_state_dict(indexed)


class StageCheckpoints:
    """Saving and loading one rank's part of a pipelined module, in either format.

    ``"full"``: the stages' state is gathered on global rank 0 (over ``object_group``) into the single-device layout,
    so plain Lightning loads the file. ``"sharded"``: torch's distributed checkpoint, every rank writing its shards,
    and the rest of the checkpoint in ``checkpoint.pt``. Both load on any number of stages, replicas and
    tensor-parallel ranks, as do single-device checkpoints, because everything is matched by name.

    ``not_on_last()`` names the state entries the last stage does not hold (weights used before the blocks only, see
    ``outside_weights``); ``object_group()`` is the run's group for object collectives (None: the default group, or,
    after ``fit`` ends, none: then a checkpoint saved by hand gathers over a gloo group made for it where the default
    group is not gloo, see :func:`~lightning_pp.topology.object_group_now`, never through GPU memory); ``world``,
    ``rank``, ``stage``, ``lane``, ``num_stages`` and ``rank_of(stage, lane)`` describe this rank's place (see
    :class:`~lightning_pp.topology.PipelineLayout`).
    """

    def __init__(self, module: torch.nn.Module, partition: Any, not_on_last: Callable[[], set[str]], *, world: int,
                 rank: int, stage: int, lane: int, num_stages: int, rank_of: Callable[[int, int], int],
                 object_group: Callable[[], Any], device: torch.device) -> None:
        self.module = module
        self.partition = partition
        self.not_on_last = not_on_last
        self.world, self.rank, self.stage, self.lane, self.num_stages = world, rank, stage, lane, num_stages
        self.rank_of = rank_of
        self.object_group = object_group
        self.device = device

    def _objects(self) -> Any:
        """The group for this rank's object collectives and distributed checkpoints now (also after ``fit``)."""
        return object_group_now(self.object_group())

    def _name_of(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters()}

    def _gather_on_zero(self, obj: Any) -> list[Any]:
        """Every stage's ``obj`` of lane 0, in stage order, on global rank 0 (the lanes hold the same state, sharded
        tensors gathered whole)."""
        if self.world == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj if self.lane == 0 else None, gathered, dst=0, group=self._objects())
        return [gathered[self.rank_of(stage, 0)] for stage in range(self.num_stages)] if gathered else []

    def own_state(self) -> dict[str, torch.Tensor]:
        """The state entries this stage holds alone (its blocks), plus, on the last stage, everything else it holds,
        and elsewhere what the last stage does not hold.

        Replicated parameters are equal on every stage, but buffers are not: modules after the blocks (a BatchNorm
        head, say) run only on the last stage, which also runs those before it, so its copies are current. Blocks
        sharded over the replicas or tensor-parallel ranks are gathered whole (every lane of the stage calls this).
        """
        return {k: v.detach().cpu() for k, v in self._owned(full_tensors(self.module.state_dict())).items()}

    def _owned(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``state`` this stage writes (see :meth:`own_state`)."""
        view = self.partition.view
        prefix, last = view.container_name + ".", view.num_stages - 1 in view.stages
        elsewhere = self.not_on_last() if not last else set()
        return {k: v for k, v in state.items() if k.startswith(prefix) or last or k in elsewhere}

    def module_state(self, checkpoint_format: str) -> dict[str, Any]:
        """What a checkpoint of ``checkpoint_format`` holds of the module on this rank: the whole module's state on
        global rank 0 (``"full"``, with several stages), or what this rank writes of it (``"sharded"``)."""
        if checkpoint_format == "sharded":
            return self._written_state()
        if self.num_stages == 1:
            return full_tensors(self.module.state_dict())
        return self.full_state_dict()

    def _written_state(self) -> dict[str, Any]:
        """The entries :meth:`own_state` selects, as they are (a sharded tensor: this rank's shard of it)."""
        return {k: v.detach() for k, v in self._owned(self.module.state_dict()).items()}

    def full_state_dict(self) -> dict[str, Any]:
        """The whole module's state on global rank 0 (empty elsewhere), in the single-device key order."""
        parts = self._gather_on_zero(self.own_state())
        if self.rank != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return {key: merged[key] for key in self.partition.full_state_keys}

    def optimizer_state(self, optimizer: Optimizer, full: bool) -> dict[str, Any]:
        """This stage's optimizer state by parameter name, or (``full``) the whole model's, re-keyed as one device
        numbers it, on global rank 0."""
        named = named_state(getattr(optimizer, "_optimizer", optimizer), self._name_of(), whole=full)
        if not full:
            return named
        parts = self._gather_on_zero(named)
        return named_to_indexed(merge_named(parts, self.partition.full_param_order)) if parts else {}

    def add_pending_gradient(self, checkpoint: dict[str, Any], pending: Mapping[str, torch.Tensor], full: bool) -> None:
        """Put ``pending`` (pipedream_2bw's gradient not applied yet, by parameter name, as this rank holds it) into
        ``checkpoint`` under :data:`PENDING_GRADIENT_KEY`: the whole model's on global rank 0 (``full``: every rank
        calls this), or this rank's entries, which :meth:`save_sharded` writes. A weight several ranks hold has the
        same (synchronized) entry on each, so any of them will do: not the module's state entries' owners, since
        where the weights outside the blocks are held can change after the fit that computed ``pending``. Plain
        Lightning ignores the key."""
        if not full:
            checkpoint[PENDING_GRADIENT_KEY] = dict(pending)
            return
        merged: dict[str, torch.Tensor] = {}
        for part in self._gather_on_zero(dict(pending)):
            merged.update(part or {})
        if merged:
            order = self.partition.full_param_order
            checkpoint[PENDING_GRADIENT_KEY] = {name: merged[name] for name in sorted(merged, key=order.__getitem__)}

    def save_sharded(self, checkpoint: dict[str, Any], folder: str) -> None:
        """Write ``checkpoint`` (its module and optimizer states as :meth:`module_state` and :meth:`optimizer_state`
        give them for ``"sharded"``) with torch's distributed checkpoint, every rank its own shards, nothing gathered:
        tensors keyed by parameter name (one copy of each, whichever ranks hold it), the optimizers' hyper-parameters
        and parameter names per stage; the rest of the checkpoint in ``checkpoint.pt`` from global rank 0."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        os.makedirs(folder, exist_ok=True)
        written: dict[str, Any] = {f"{_MODEL}.{k}": v for k, v in checkpoint["state_dict"].items()}
        for i, named in enumerate(checkpoint.get("optimizer_states", [])):
            # one object (a tuple is not flattened into keys): the same on every rank of the stage
            written[f"{_OPTIMIZER}.{i}.stage{self.stage}"] = (named["groups"], named["names"])
            for name, value in named["state"].items():
                for key, entry in value.items():
                    if isinstance(entry, (Mapping, list, tuple)):
                        raise PipelineConfigError(
                            f"The optimizer's state `{key}` of `{name}` is a {type(entry).__name__}; the sharded "
                            f"format stores tensors and plain values per parameter. Use "
                            f"PipelineParallelStrategy(checkpoint_format='full') with this optimizer.")
                    written[f"{_OPTIMIZER}.{i}.state.{name}.{key}"] = entry
        for name, value in checkpoint.get(PENDING_GRADIENT_KEY, {}).items():
            written[f"{PENDING_GRADIENT_KEY}.{name}"] = value
        # a copy several ranks hold is written by the lowest (replica 0, as the full format's)
        dcp.save(written, checkpoint_id=folder, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                 process_group=self._objects())
        if self.rank == 0:
            meta = {k: v for k, v in checkpoint.items()
                    if k not in ("state_dict", "optimizer_states", PENDING_GRADIENT_KEY)}
            meta["lightning_pp"] = {"format": "sharded", "num_stages": self.num_stages,
                                    "optimizers": len(checkpoint.get("optimizer_states", []))}
            torch.save(meta, os.path.join(folder, "checkpoint.pt"))

    def load_sharded(self, folder: str, weights_only: bool, optimizers: Sequence[Any]) -> dict[str, Any]:
        """A sharded checkpoint as one checkpoint, read straight into this rank's shards (any number of stages,
        replicas and tensor-parallel ranks wrote it): its module entries, and each optimizer's state named, with
        every stage's parameter names merged. (``weights_only`` applies to ``checkpoint.pt``; torch's distributed
        checkpoint reads the rest itself.)"""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import BytesStorageMetadata, DefaultLoadPlanner, FileSystemReader

        if not os.path.exists(os.path.join(folder, ".metadata")):
            raise PipelineConfigError(
                f"{folder} is not a sharded checkpoint of this version (torch's distributed checkpoint: a `.metadata` "
                f"file beside `checkpoint.pt`); folders of per-stage files come from an earlier lightning_pp. Load it "
                f"with that version and save it with checkpoint_format='full'.")
        checkpoint = torch.load(os.path.join(folder, "checkpoint.pt"), map_location="cpu", weights_only=weights_only)
        saved = checkpoint["lightning_pp"]
        stored = FileSystemReader(folder).read_metadata().state_dict_metadata
        local = self.module.state_dict()
        module_keys = [k for k in local if f"{_MODEL}.{k}" in stored]
        target: dict[str, Any] = {f"{_MODEL}.{k}": local[k] for k in module_keys}
        params = dict(self.module.named_parameters())
        pending = [name for name in params if f"{PENDING_GRADIENT_KEY}.{name}" in stored]
        target.update({f"{PENDING_GRADIENT_KEY}.{name}": torch.zeros_like(params[name]) for name in pending})
        states: list[dict[str, Any]] = []
        for i in range(saved.get("optimizers", 0) if optimizers else 0):
            state: dict[str, dict[str, Any]] = {}
            prefix = f"{_OPTIMIZER}.{i}.state."
            for stored_key in (k for k in stored if k.startswith(prefix)):
                name, _, key = stored_key[len(prefix):].rpartition(".")
                param, meta = params.get(name), stored[stored_key]
                if param is None:  # another stage's
                    continue
                value: Any = None  # a plain value: read as it was written
                if not isinstance(meta, BytesStorageMetadata):
                    shape = tuple(meta.size)
                    # shaped like the weight: this rank's part of it; else (a step count) whole, on the host
                    value = torch.zeros_like(param) if shape == tuple(param.shape) and key != "step" else torch.zeros(
                        shape, dtype=meta.properties.dtype, device="cpu")
                state.setdefault(name, {})[key] = target[stored_key] = value
            states.append(state)
            for stage in range(saved["num_stages"]):
                target[f"{_OPTIMIZER}.{i}.stage{stage}"] = None
        dcp.load(target, checkpoint_id=folder, planner=DefaultLoadPlanner(allow_partial_load=True),
                 process_group=self._objects())
        checkpoint["state_dict"] = {k: target[f"{_MODEL}.{k}"] for k in module_keys}  # tensors read in place
        if pending:
            checkpoint[PENDING_GRADIENT_KEY] = {name: target[f"{PENDING_GRADIENT_KEY}.{name}"] for name in pending}
        order = self.partition.full_param_order
        checkpoint["optimizer_states"] = [
            {**merge_named([dict(zip(("groups", "names"), target[f"{_OPTIMIZER}.{i}.stage{stage}"], strict=True),
                                 state={}) for stage in range(saved["num_stages"])], order),
             "state": {name: {key: target[f"{_OPTIMIZER}.{i}.state.{name}.{key}"] for key in value}
                       for name, value in state.items()}}  # plain values as read
            for i, state in enumerate(states)]
        return checkpoint

    def load_module_state(self, saved: Mapping[str, Any], strict: bool) -> None:
        local_keys = list(self.module.state_dict())
        missing = [k for k in local_keys if k not in saved]
        if missing and strict:
            raise PipelineConfigError(
                f"The checkpoint has no entries for {missing[:5]} (of {len(missing)} missing) of pipeline stage "
                f"{self.stage}: it was saved from a different model."
            )
        local = self.module.state_dict()
        self.module.load_state_dict({k: shard_like(saved[k], local[k]) for k in local_keys if k in saved},
                                    strict=strict)

    def load_optimizer_states(self, optimizers: Sequence[Any], states: Sequence[Mapping[str, Any]]) -> None:
        """Load each optimizer's entries from a full, sharded or single-device checkpoint's optimizer states."""
        name_of = self._name_of()
        for optimizer, saved in zip(optimizers, states, strict=True):
            inner = getattr(optimizer, "_optimizer", optimizer)
            if "names" in saved and "groups" in saved:
                named = dict(saved)
            else:
                names = saved.get(NAMES_KEY) or self._full_group_names(inner, name_of)
                named = indexed_to_named(saved, names)
            load_named(inner, named, name_of)
            _optimizers_to_device([inner], self.device)

    def _full_group_names(self, optimizer: Optimizer, name_of: dict[int, str]) -> list[list[str]]:
        """Each param group's names as a single-device optimizer orders them: the module's parameter order.

        Needed for checkpoints written by plain Lightning, which number parameters without naming them.
        """
        local = [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        parts: list[Any] = [local]
        if self.world > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, local, group=self._objects())
        order = self.partition.full_param_order
        return [sorted({n for part in parts for n in part[g]}, key=lambda n: order[n]) for g in range(len(local))]
