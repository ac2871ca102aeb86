"""Which global rank holds which pipeline stage of which data-parallel replica, the process groups that follow, and
joining the job's process group (:func:`start_process_group`)."""

from __future__ import annotations

import atexit
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pp import _compat
from lightning_pp._logging import get_logger
from lightning_pp.parallel.nccl_emulation import ENV_VAR, emulating_nccl

__all__ = ["MESH_DIMS", "PipelineLayout", "StageGroups", "broadcast_object", "create_device_mesh", "create_groups",
           "create_sharing_groups", "gather_reports", "object_group_now", "receive_object", "send_object",
           "start_process_group"]

MESH_DIMS = ("pipeline_parallel", "data_parallel", "tensor_parallel")

log = get_logger(__name__)


@dataclass(frozen=True)
class PipelineLayout:
    """``num_replicas`` data-parallel copies of a pipeline of ``num_stages`` stages, each stage split over
    ``tensor_parallel`` ranks: one (stage, replica, tensor-parallel rank) per global rank.

    A *lane* is one pipeline of ranks that hand activations to each other: one per (replica, tensor-parallel rank),
    ``lane = replica * tensor_parallel + tensor_parallel_rank``. The pipeline is the outer dimension and the
    tensor-parallel ranks of a stage sit next to each other, as in Megatron and torchtitan:
    ``rank = stage * lanes + lane``. On nodes of ``lanes`` devices (or a multiple), the tensor-parallel collectives and
    a stage's gradient all-reduce stay inside a node and only the pipeline's point-to-point transfers cross nodes.

    Example (4 ranks, 2 stages)::

        >>> layout = PipelineLayout(num_stages=2, num_replicas=2)
        >>> layout.pipeline_ranks(1), layout.replica_ranks(2)
        ([1, 3], [2, 3])
    """

    num_stages: int
    num_replicas: int
    tensor_parallel: int = 1

    @property
    def lanes(self) -> int:
        """Pipelines of ranks: one per data-parallel replica and tensor-parallel rank."""
        return self.num_replicas * self.tensor_parallel

    @property
    def world_size(self) -> int:
        return self.num_stages * self.lanes

    def rank(self, stage: int, lane: int) -> int:
        """The global rank holding ``stage`` in ``lane``."""
        return stage * self.lanes + lane

    def stage_of(self, rank: int) -> int:
        return rank // self.lanes

    def lane_of(self, rank: int) -> int:
        return rank % self.lanes

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica ``rank`` belongs to (what the sampler shards by)."""
        return self.lane_of(rank) // self.tensor_parallel

    def tensor_parallel_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel

    def pipeline_ranks(self, lane: int) -> list[int]:
        """The ranks of one lane, in stage order: its point-to-point transfers and per-step results."""
        return [self.rank(stage, lane) for stage in range(self.num_stages)]

    def replica_ranks(self, rank: int) -> list[int]:
        """The ranks holding what ``rank`` holds (its stage and tensor-parallel shard), one per replica: the
        data-parallel group its gradients are averaged in."""
        stage, tp = self.stage_of(rank), self.tensor_parallel_rank_of(rank)
        return [self.rank(stage, replica * self.tensor_parallel + tp) for replica in range(self.num_replicas)]

    def shard_ranks(self, tensor_parallel_rank: int) -> list[int]:
        """Every rank holding tensor-parallel shard ``tensor_parallel_rank`` (every stage and replica)."""
        return [rank for rank in range(self.world_size) if self.tensor_parallel_rank_of(rank) == tensor_parallel_rank]

    def __str__(self) -> str:
        width = len(str(self.world_size - 1))
        rows = [f"stage {stage}: ranks " + " ".join(f"{self.rank(stage, lane):>{width}}" for lane in range(self.lanes))
                for stage in range(self.num_stages)]
        column = "replica" if self.tensor_parallel == 1 else "(replica, tensor-parallel rank), the latter innermost"
        tp = f" x {self.tensor_parallel} tensor-parallel" if self.tensor_parallel > 1 else ""
        return f"{self.num_replicas} replica(s) x {self.num_stages} stage(s){tp}; column = {column}\n" + "\n".join(rows)


@dataclass
class StageGroups:
    """The process groups one rank uses (``None`` means the default group of the whole world).

    ``pipeline`` carries the per-step results and metric states inside one lane; ``p2p`` its activations and
    gradients (two or four groups, see :class:`~lightning_pp.runtime.p2p.StageP2P`); ``replicas`` the data-parallel
    gradient average and metric reductions of what this rank holds (only used with more than one replica);
    ``shard_peers`` every rank holding this rank's tensor-parallel shard (None without tensor parallelism: the world),
    where the weights every stage holds are summed and broadcast.
    """

    layout: PipelineLayout
    rank: int
    pipeline: Any
    p2p: tuple[Any, ...]
    replicas: Any
    created: list[Any]  # every group this rank belongs to that it must destroy
    last_position: int  # the place in the pipeline of the rank holding the last stage (the schedule's choice)
    shard_peers: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> StageGroups:
        return self  # process groups are handles to this process's connections (a cloned metric keeps them)

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.rank)

    @property
    def lane(self) -> int:
        return self.layout.lane_of(self.rank)

    @property
    def pipeline_ranks(self) -> list[int]:
        return self.layout.pipeline_ranks(self.lane)

    @property
    def last_stage_rank(self) -> int:
        return self.pipeline_ranks[self.last_position]

    @property
    def replica_root(self) -> int:
        """The rank of replica 0 holding what this rank holds: where replicas start from, as DDP starts."""
        return self.layout.replica_ranks(self.rank)[0]


def create_groups(layout: PipelineLayout, rank: int, new_group: Callable[[list[int]], Any], p2p_groups: int = 2,
                  last_position: int = -1) -> StageGroups:
    """Create every group of ``layout`` (``new_group`` is collective: every rank creates all of them, in one order) and
    keep this rank's: ``p2p_groups`` for transfers (see :class:`~lightning_pp.runtime.p2p.StageP2P`), one for the lane's
    results (of the run: a receive a failed run left posted goes with it), one per set of replicas, one per
    tensor-parallel shard."""
    mine: dict[str, Any] = {"pipeline": None, "p2p": (None,) * p2p_groups, "replicas": None, "shard_peers": None}
    created: list[Any] = []
    if layout.num_stages > 1:
        for lane in range(layout.lanes):
            ranks = layout.pipeline_ranks(lane)
            groups = [new_group(ranks) for _ in range(p2p_groups + 1)]
            if rank in ranks:
                created += groups
                mine["p2p"], mine["pipeline"] = tuple(groups[:p2p_groups]), groups[-1]
    if layout.num_replicas > 1 and layout.num_replicas < layout.world_size:
        for first in range(layout.world_size):
            ranks = layout.replica_ranks(first)
            if ranks[0] != first:
                continue
            group = new_group(ranks)
            if rank in ranks:
                created.append(group)
                mine["replicas"] = group
    if layout.tensor_parallel > 1:
        for tp in range(layout.tensor_parallel):
            ranks = layout.shard_ranks(tp)
            group = new_group(ranks)
            if rank in ranks:
                created.append(group)
                mine["shard_peers"] = group
    return StageGroups(layout, rank, mine["pipeline"], mine["p2p"], mine["replicas"], created, last_position,
                       mine["shard_peers"])


def create_sharing_groups(layout: PipelineLayout, position_sets: Iterable[frozenset[int]], rank: int,
                          new_group: Callable[[list[int]], Any], across_replicas: bool = True
                          ) -> dict[frozenset[int], Any]:
    """A group for each set of pipeline positions that share weights (with every replica of each, one per
    tensor-parallel shard; or, not ``across_replicas``, one per lane: for weights sharded over the replicas), created
    by every rank in one order; this rank keeps those it belongs to."""
    mine: dict[frozenset[int], Any] = {}
    tp_size = layout.tensor_parallel
    lane_sets = ([[replica * tp_size + tp for replica in range(layout.num_replicas)] for tp in range(tp_size)]
                 if across_replicas else [[lane] for lane in range(layout.lanes)])
    for positions in sorted(set(position_sets), key=sorted):
        for lanes in lane_sets:
            ranks = sorted(layout.rank(stage, lane) for stage in positions for lane in lanes)
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
        log.warning(f"{ENV_VAR} is set: the transfers follow NCCL's protocol on gloo.")
    if world_size > 1 and (backend != "gloo" or emulating_nccl()):
        return dist.new_group(backend="gloo", timeout=timeout)
    return None


def object_group_now(group: Any) -> Any:
    """The group for an object collective now: ``group`` (the run's, from :func:`start_process_group`) while it exists;
    once it is gone (the strategy's teardown destroys it at the end of ``fit``, and a checkpoint saved by hand comes
    after), what :func:`start_process_group` would return: a gloo group over the world where the default group is not
    gloo (NCCL, or its emulation), made once per default group, else None (the default group). Making it is
    collective: every rank calls this at the same point, before the collective it is for.

    On NCCL an object collective pickles into GPU buffers: gathering a checkpoint over it would put the world's
    pickles of every stage's state into global rank 0's GPU memory at once.
    """
    if group is not None or not dist.is_initialized() or dist.get_world_size() < 2:
        return group
    if dist.get_backend() == "gloo" and not emulating_nccl():
        return None
    world = dist.group.WORLD
    made = _LATE_OBJECT_GROUPS.get("world")
    if made is None or made[0] is not world:  # none yet, or made in a process group destroyed since
        made = _LATE_OBJECT_GROUPS["world"] = (world, dist.new_group(backend="gloo"))
    return made[1]


_LATE_OBJECT_GROUPS: dict[str, tuple[Any, Any]] = {}  # "world" -> (the default group it was made in, the gloo group)


def send_object(obj: Any, dst: int, group: Any, tag: int) -> list[tuple[dist.Work, torch.Tensor]]:
    """Send ``obj`` to global rank ``dst`` point to point without waiting: its pickle's size, then the pickle, which
    :func:`receive_object` reads. Returns each send's work with its buffer: keep both until the work completes."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device="cpu")
    return [(work, buffer) for buffer in (size, payload)
            if (work := dist.isend(buffer, dst, group=group, tag=tag)) is not None]


def receive_object(src: int, group: Any, tag: int) -> Any:
    """What :func:`send_object` sent from global rank ``src`` with ``tag`` (waits for it)."""
    size = torch.zeros(1, dtype=torch.int64, device="cpu")
    dist.recv(size, src, group=group, tag=tag)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    dist.recv(payload, src, group=group, tag=tag)
    return pickle.loads(payload.numpy().tobytes())


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
    """The job's ranks as a DeviceMesh of ``MESH_DIMS`` (pipeline outermost, tensor-parallel innermost), laid out as
    ``layout`` places them; every rank creates it (collective) once per process group. None without a process
    group."""
    if not dist.is_initialized():
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.num_stages, layout.num_replicas, layout.tensor_parallel)
    key = (*shape, device_type)
    world = dist.group.WORLD
    made = _MESHES.get(key)
    if made is None or made[0] is not world:  # one per process group: later runs (validate after fit) reuse it
        made = _MESHES[key] = (world, init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS))
    return made[1]


_MESHES: dict[tuple[int, int, int, str], tuple[Any, Any]] = {}  # layout -> (the default group it was made in, the mesh)

