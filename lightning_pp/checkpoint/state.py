"""Checkpoints of a pipelined module (:class:`StageCheckpoints`), and optimizer state keyed by parameter name: the
form in which stages exchange, merge and re-key checkpoint state.

torch numbers optimizer state by position (parameter ``i`` of the optimizer), which differs between a stage and the
full model. Keying by parameter name lets a full checkpoint be re-keyed to the single-device numbering plain Lightning
expects, and lets any checkpoint (full, sharded, single-device, from another number of stages) be loaded by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_pp import _compat
from lightning_pp.checkpoint.files import (
    TRAINER_STATE,
    check_sharded_folder,
    interrupted_replacement,
    new_folder_token,
    read_whole,
    replace_folder,
    temporary_folder,
)
from lightning_pp.errors import PipelineCheckpointError, PipelineConfigError
from lightning_pp.parallel.sharding import full_tensors, shard_like
from lightning_pp.parallel.topology import broadcast_object, gather_reports, object_group_now

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


def _describe(keys: Sequence[str], container: str) -> str:
    """State keys for a message: those of the block container as ranges of blocks (``layers.4-5``), then the first
    others by name."""
    blocks: set[int] = set()
    others: list[str] = []
    for key in keys:
        index = key[len(container) + 1:].partition(".")[0] if key.startswith(f"{container}.") else ""
        if index.isdigit():
            blocks.add(int(index))
        else:
            others.append(key)
    runs: list[list[int]] = []
    for block in sorted(blocks):
        if runs and block == runs[-1][-1] + 1:
            runs[-1].append(block)
        else:
            runs.append([block])
    named = [f"{container}.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else "") for run in runs] + others[:5]
    return ", ".join(named) + (f" and {len(others) - 5} more" if len(others) > 5 else "")


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
    """Merge the named states of several stages: each group's names in full-model order, each name once; names the
    model does not have (``order`` lacks them: a checkpoint loaded with ``strict_loading = False``) left out."""
    groups = parts[0]["groups"]
    names: list[list[str]] = []
    for group_index in range(len(groups)):
        union = {n for part in parts for n in part["names"][group_index] if n in order}
        names.append(sorted(union, key=order.__getitem__))
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
    group is not gloo, see :func:`~lightning_pp.parallel.topology.object_group_now`, never through GPU memory);
    ``world``, ``rank``, ``stage``, ``lane``, ``num_stages`` and ``rank_of(stage, lane)`` describe this rank's place
    (see :class:`~lightning_pp.parallel.topology.PipelineLayout`).
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
        self._source: str | None = None  # the path being loaded, for errors

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

    def module_state(self, state_dict_type: str) -> dict[str, Any]:
        """What a checkpoint of ``state_dict_type`` holds of the module on this rank: the whole module's state on
        global rank 0 (``"full"``, with several stages), or what this rank writes of it (``"sharded"``)."""
        if state_dict_type == "sharded":
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
        named = named_state(_compat.unwrapped_optimizer(optimizer), self._name_of(), whole=full)
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
        and parameter names per stage; the rest of the checkpoint in ``checkpoint.pt`` from global rank 0.

        Written whole or not at all: into a new folder beside ``folder``, which global rank 0 renames to ``folder``
        once every rank has written (see :mod:`lightning_pp.checkpoint.files`); a rank that fails or dies on the way
        leaves the checkpoint at ``folder`` as it was. Every rank returns once the new one is in place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        token = broadcast_object(new_folder_token(folder) if self.rank == 0 else None, 0, self._objects())
        new = temporary_folder(folder, token)
        os.makedirs(new, exist_ok=True)
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
                            f"PipelineParallelStrategy(state_dict_type='full') with this optimizer.")
                    written[f"{_OPTIMIZER}.{i}.state.{name}.{key}"] = entry
        for name, value in checkpoint.get(PENDING_GRADIENT_KEY, {}).items():
            written[f"{PENDING_GRADIENT_KEY}.{name}"] = value
        try:  # a copy several ranks hold is written by the lowest (replica 0, as the full format's)
            dcp.save(written, checkpoint_id=new, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                     process_group=self._objects())
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11 on
                error.add_note(f"lightning_pp: the checkpoint at {folder} is unchanged (the new one went to {new}, "
                               f"which the next save to {folder} removes)")
            raise
        failure: Exception | None = None
        if self.rank == 0:  # every rank has written its shards and torch's `.metadata` is written: the last part
            meta = {k: v for k, v in checkpoint.items()
                    if k not in ("state_dict", "optimizer_states", PENDING_GRADIENT_KEY)}
            meta["lightning_pp"] = {"format": "sharded", "num_stages": self.num_stages,
                                    "optimizers": len(checkpoint.get("optimizer_states", []))}
            try:
                torch.save(meta, os.path.join(new, TRAINER_STATE))
                replace_folder(new, folder, token)
            except Exception as error:  # told to every rank, which would otherwise wait for rank 0 below
                failure = error
        report = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", 0,
                                  self._objects())
        if report is not None:
            raise PipelineCheckpointError(
                f"Global rank 0 could not finish the sharded checkpoint {folder} ({report}); the checkpoint there is "
                f"unchanged. Free space or fix what the error names and save again.") from failure

    def load(self, path: str, weights_only: bool | None, optimizers: Sequence[Any],
             load_file: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint at ``path``: a sharded folder (:meth:`load_sharded`), or a file ``load_file(path,
        weights_only=...)`` reads (the strategy's ``CheckpointIO``).

        Raises:
            PipelineCheckpointError: the checkpoint is cut short or lacks a part (naming it), or ``path`` is gone
                because a sharded save to it was stopped between its renames (naming the previous checkpoint).
        """
        self._source = path
        if os.path.isdir(path):
            return self.load_sharded(path, bool(weights_only), optimizers)
        if (interrupted := interrupted_replacement(path)) is not None:
            raise interrupted
        return read_whole(path, lambda: load_file(path, weights_only=weights_only))

    def load_sharded(self, folder: str, weights_only: bool, optimizers: Sequence[Any]) -> dict[str, Any]:
        """A sharded checkpoint as one checkpoint, read straight into this rank's shards (any number of stages,
        replicas and tensor-parallel ranks wrote it): its module entries, and each optimizer's state named, with
        every stage's parameter names merged. (``weights_only`` applies to ``checkpoint.pt``; torch's distributed
        checkpoint reads the rest itself.)"""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader

        # every rank checks the same files alike, before the collective read below
        stored = check_sharded_folder(folder, FileSystemReader(folder).read_metadata).state_dict_metadata
        trainer_state = os.path.join(folder, TRAINER_STATE)
        checkpoint = read_whole(trainer_state, lambda: torch.load(trainer_state, map_location="cpu",
                                                                  weights_only=weights_only))
        saved = checkpoint["lightning_pp"]
        # every module entry the checkpoint holds, for load_module_state's strict check (this rank reads its own)
        saved["state_keys"] = [k[len(_MODEL) + 1:] for k in stored if k.startswith(f"{_MODEL}.")]
        local = self.module.state_dict()
        module_keys = [k for k in local if f"{_MODEL}.{k}" in stored]
        target: dict[str, Any] = {f"{_MODEL}.{k}": local[k] for k in module_keys}
        params = dict(self.module.named_parameters())
        pending = [name for name in params if f"{PENDING_GRADIENT_KEY}.{name}" in stored]
        target.update({f"{PENDING_GRADIENT_KEY}.{name}": torch.zeros_like(params[name]) for name in pending})
        states = [_optimizer_targets(stored, params, i, saved["num_stages"], target)
                  for i in range(saved.get("optimizers", 0) if optimizers else 0)]
        try:
            dcp.load(target, checkpoint_id=folder, planner=DefaultLoadPlanner(allow_partial_load=True),
                     process_group=self._objects())
        except CheckpointException as error:  # raised on every rank: torch gathers each rank's failures
            raise PipelineCheckpointError(
                f"The sharded checkpoint {folder} could not be read into this model: {error}. Its files are all there "
                f"(checked before reading): a file damaged inside, or another model's entries of other shapes. "
                f"Resume from another checkpoint.") from error
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

    def load_module_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """Load this rank's entries of ``checkpoint["state_dict"]``. ``strict`` (Lightning passes the module's
        ``strict_loading``): as one device's ``load_state_dict(strict=True)``, the checkpoint's entries must be the
        whole model's, no more and no fewer; compared on every rank alike (the whole model's keys against all the
        checkpoint holds), so every rank refuses a mismatch with the same error."""
        saved = checkpoint["state_dict"]
        if strict:
            self._check_keys(checkpoint.get("lightning_pp", {}).get("state_keys", saved))
        local = self.module.state_dict()
        self.module.load_state_dict({k: shard_like(saved[k], v) for k, v in local.items() if k in saved}, strict=strict)

    def _check_keys(self, saved_keys: Iterable[str]) -> None:
        saved, full = list(saved_keys), self.partition.full_state_keys
        saved_set, full_set = set(saved), set(full)
        unexpected, missing = [k for k in saved if k not in full_set], [k for k in full if k not in saved_set]
        if not unexpected and not missing:
            return
        container, source = self.partition.view.container_name, f" {self._source}" if self._source else ""
        problems = []
        if unexpected:
            problems.append(f"it holds {len(unexpected)} entries this model does not have "
                            f"({_describe(unexpected, container)}): is it another model's?")
        if missing:
            problems.append(f"it lacks {len(missing)} entries of this model ({_describe(missing, container)})")
        raise PipelineCheckpointError(
            f"The checkpoint{source} does not match this model: {'; '.join(problems)}. Loading is strict, as one "
            f"device's load_state_dict(strict=True). Resume from a checkpoint of this model, or set "
            f"`strict_loading = False` on the LightningModule to load the entries that match (the optimizer's state "
            f"must still cover every parameter it trains), or start a new run from them: "
            f"model.load_state_dict(torch.load(path, weights_only=True)['state_dict'], strict=False).")

    def load_optimizer_states(self, optimizers: Sequence[Any], states: Sequence[Mapping[str, Any]]) -> None:
        """Load each optimizer's entries from a full, sharded or single-device checkpoint's optimizer states."""
        name_of = self._name_of()
        report = None
        for index, (optimizer, saved) in enumerate(zip(optimizers, states, strict=True)):
            inner = _compat.unwrapped_optimizer(optimizer)
            try:  # the same collectives on every rank: _full_group_names' only where the checkpoint has no names
                if "names" in saved and "groups" in saved:
                    named = dict(saved)
                else:
                    names = saved.get(NAMES_KEY) or self._full_group_names(inner, name_of)
                    named = indexed_to_named(saved, names)
                load_named(inner, named, name_of)
            except PipelineConfigError as error:
                report = report or f"stage {self.stage} (global rank {self.rank}), optimizer {index}: {error}"
            _compat._optimizers_to_device([inner], self.device)
        failed = gather_reports(report, self.world, self._objects())  # a stage's mismatch fails every rank alike
        if failed:
            raise PipelineCheckpointError(f"The checkpoint's optimizer state does not fit this model's optimizers: "
                                          f"{' | '.join(failed)}")

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


def _optimizer_targets(stored: Mapping[str, Any], params: Mapping[str, torch.Tensor], index: int, num_stages: int,
                       target: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Where optimizer ``index``'s state of this rank's parameters is read to (added to ``target``, keyed as stored),
    by parameter name and state key; and a slot for each stage's parameter names and groups."""
    from torch.distributed.checkpoint import BytesStorageMetadata

    state: dict[str, dict[str, Any]] = {}
    prefix = f"{_OPTIMIZER}.{index}.state."
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
    for stage in range(num_stages):
        target[f"{_OPTIMIZER}.{index}.stage{stage}"] = None
    return state
