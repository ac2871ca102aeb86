"""Which global rank holds which pipeline stage of which data-parallel replica, the process groups that follow, and
joining the job's process group (:func:`start_process_group`)."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_pp import _compat
from lightning_pp._nccl_emulation import ENV_VAR, emulating_nccl

__all__ = ["MESH_DIMS", "PipelineLayout", "StageGroups", "broadcast_object", "create_device_mesh", "create_groups",
           "create_sharing_groups", "gather_reports", "start_process_group"]

MESH_DIMS = ("pipeline_parallel", "data_parallel", "tensor_parallel")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineLayout:
    """``num_replicas`` data-parallel copies of a pipeline of ``num_stages`` stages, one (stage, replica) per rank.

    The replicas of one stage sit on neighbouring ranks and each pipeline spans the outer dimension, as in Megatron:
    ``rank = stage * num_replicas + replica``. On nodes of ``num_replicas`` (or a multiple of it) devices, a stage's
    gradient all-reduce stays inside a node and only the pipeline's point-to-point transfers cross nodes.

    Example (4 ranks, 2 stages)::

        >>> layout = PipelineLayout(num_stages=2, num_replicas=2)
        >>> layout.pipeline_ranks(1), layout.stage_ranks(1)
        ([1, 3], [2, 3])
    """

    num_stages: int
    num_replicas: int

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank(self, stage: int, replica: int) -> int:
        """The global rank holding ``stage`` of ``replica``."""
        return stage * self.num_replicas + replica

    def stage_of(self, rank: int) -> int:
        return rank // self.num_replicas

    def replica_of(self, rank: int) -> int:
        return rank % self.num_replicas

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline, in stage order: its point-to-point transfers and per-step results."""
        return [self.rank(stage, replica) for stage in range(self.num_stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage``, one per replica: the data-parallel group its gradients are averaged in."""
        return [self.rank(stage, replica) for replica in range(self.num_replicas)]

    def __str__(self) -> str:
        width = len(str(self.world_size - 1))
        rows = [f"stage {stage}: ranks " + " ".join(f"{r:>{width}}" for r in self.stage_ranks(stage))
                for stage in range(self.num_stages)]
        return (f"{self.num_replicas} replica(s) x {self.num_stages} stage(s); column = replica\n" + "\n".join(rows))


@dataclass
class StageGroups:
    """The process groups one rank uses (``None`` means the default group of the whole world).

    ``pipeline`` carries the per-step results and metric states inside one pipeline; ``p2p`` its activations and
    gradients (two or four groups, see :class:`~lightning_pp.p2p.StageP2P`); ``replicas`` the stage's data-parallel
    gradient average and metric reductions (only used with more than one replica).
    """

    layout: PipelineLayout
    rank: int
    pipeline: Any
    p2p: tuple[Any, ...]
    replicas: Any
    created: list[Any]  # every group this rank belongs to that it must destroy
    last_position: int  # the place in the pipeline of the rank holding the last stage (the schedule's choice)

    def __deepcopy__(self, memo: dict[int, Any]) -> StageGroups:
        return self  # process groups are handles to this process's connections (a cloned metric keeps them)

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def pipeline_ranks(self) -> list[int]:
        return self.layout.pipeline_ranks(self.replica)

    @property
    def last_stage_rank(self) -> int:
        return self.pipeline_ranks[self.last_position]


def create_groups(layout: PipelineLayout, rank: int, new_group: Callable[[list[int]], Any], p2p_groups: int = 2,
                  last_position: int = -1) -> StageGroups:
    """Create every group of ``layout`` (``new_group`` is collective: every rank creates all of them, in one order) and
    keep this rank's: ``p2p_groups`` for transfers (see :class:`~lightning_pp.p2p.StageP2P`), one for the pipeline's
    results when there are replicas, one per stage's replicas."""
    mine: dict[str, Any] = {"pipeline": None, "p2p": (None,) * p2p_groups, "replicas": None}
    created: list[Any] = []
    if layout.num_stages > 1:
        for replica in range(layout.num_replicas):
            ranks = layout.pipeline_ranks(replica)
            groups = [new_group(ranks) for _ in range(p2p_groups + (layout.num_replicas > 1))]
            if rank in ranks:
                created += groups
                mine["p2p"] = tuple(groups[:p2p_groups])
                if layout.num_replicas > 1:
                    mine["pipeline"] = groups[-1]
    if layout.num_replicas > 1 and layout.num_stages > 1:
        for stage in range(layout.num_stages):
            ranks = layout.stage_ranks(stage)
            group = new_group(ranks)
            if rank in ranks:
                created.append(group)
                mine["replicas"] = group
    return StageGroups(layout, rank, mine["pipeline"], mine["p2p"], mine["replicas"], created, last_position)


def create_sharing_groups(layout: PipelineLayout, position_sets: Iterable[frozenset[int]], rank: int,
                          new_group: Callable[[list[int]], Any]) -> dict[frozenset[int], Any]:
    """A group for each set of pipeline positions that share weights (with every replica of each), created by every
    rank in one order; this rank keeps those it belongs to."""
    mine: dict[frozenset[int], Any] = {}
    for positions in sorted(set(position_sets), key=sorted):
        ranks = sorted(layout.rank(stage, replica) for stage in positions for replica in range(layout.num_replicas))
        group = new_group(ranks)
        if rank in ranks:
            mine[positions] = group
    return mine


def _destroy_gloo_process_group() -> None:
    """Registered with ``atexit`` on gloo: shut the process group down while the interpreter is still whole.

    Left to the interpreter's finalisation, gloo's worker threads can release tensors (and so take the GIL) after
    Python is gone, which now and then aborts the process ("terminate called without an active exception").
    """
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def start_process_group(cluster_environment: Any, backend: str, timeout: timedelta, world_size: int,
                        rank: int) -> Any:
    """Join the job's default process group; return the group for object collectives: a gloo group over the world
    where the default group is not gloo (NCCL, or its emulation), else None (the default group).

    Object collectives (checkpoint gathering, reports, the monitor's timelines) pickle into tensors: on NCCL those
    would be GPU buffers of the largest object times the world on the receiving rank.
    """
    _compat._init_dist_connection(cluster_environment, backend, timeout=timeout)
    if backend == "gloo":
        atexit.unregister(_destroy_gloo_process_group)  # once, however many fits this process runs
        atexit.register(_destroy_gloo_process_group)
    if emulating_nccl() and backend == "gloo" and rank == 0:
        log.warning(f"lightning_pp: {ENV_VAR} is set: the transfers follow NCCL's protocol on gloo.")
    if world_size > 1 and (backend != "gloo" or emulating_nccl()):
        return dist.new_group(backend="gloo", timeout=timeout)
    return None


def broadcast_object(obj: Any, src: int, group: Any) -> Any:
    """``obj`` from global rank ``src`` on every rank, over ``group`` (None: the default group); ``obj`` itself
    without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=group)
    return box[0]


def gather_reports(report: str | None, world_size: int, group: Any) -> list[str]:
    """Every rank's ``report`` (None: nothing to report), distinct and in rank order, on every rank: so that a failure
    on some ranks becomes an error on all of them before the next collective, and none is left waiting."""
    if world_size == 1:
        return [report] if report is not None else []
    reports: list[str | None] = [None] * world_size
    dist.all_gather_object(reports, report, group=group)
    return list(dict.fromkeys(r for r in reports if r is not None))


def create_device_mesh(layout: PipelineLayout, device_type: str) -> Any:
    """The job's ranks as a DeviceMesh of ``MESH_DIMS`` (pipeline outermost; one tensor-parallel rank each), laid out
    as ``layout`` places them (``rank = stage * num_replicas + replica``); every rank creates it (collective) once per
    process group. None without a process group."""
    if not dist.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    key = (layout.num_stages, layout.num_replicas, device_type)
    world = dist.group.WORLD
    made = _MESHES.get(key)
    if made is None or made[0] is not world:  # one per process group: later runs (validate after fit) reuse it
        made = _MESHES[key] = (world, init_device_mesh(device_type, (layout.num_stages, layout.num_replicas, 1),
                                                       mesh_dim_names=MESH_DIMS))
    return made[1]


_MESHES: dict[tuple[int, int, str], tuple[Any, Any]] = {}  # layout -> (the default group it was made in, the mesh)

