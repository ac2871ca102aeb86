"""Compare lightning_pp with torch.distributed.pipelining and a single process, on CPU (gloo) or GPUs (NCCL).

Run ``python benchmarks/compare.py`` (with ``PYTHONPATH`` pointing at the repository root, or the package installed).
One invocation measures, for every configuration (an MLP of 8 blocks ``Linear(H, H) + GELU``, batch 128, MSE loss
against a random target, SGD; hidden sizes ``--hidden``; and, unless ``--no-gpt``, the GPT-style module of
``examples/train_gpt.py`` with 8 blocks of width 256, 4 heads, sequences of 64 random tokens, batch 32, AdamW;
schedules ``--schedules``; ``--stages`` stages, 8 micro-batches). Every runner reads its batches from a
``torch.utils.data.DataLoader`` over the same data with the same batch size and no workers:

1. **lightning_pp**: the LightningModule trained by ``L.Trainer(accelerator=..., devices=p,
   strategy=PipelineParallelStrategy(schedule=..., microbatches=8), max_steps=N + 1)`` in ``p`` processes.
2. **torch.distributed.pipelining**: the same layers split by hand (``8 / p`` consecutive blocks per rank; for
   ``interleaved_1f1b`` 2 stages of ``4 / p`` blocks per rank, round-robin as ours), ``PipelineStage`` +
   ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` (ZB-H1 with
   one stage per rank) with ``n_microbatches=8, loss_fn=mse``, in a plain loop
   (next batch, copy to the device, ``schedule.step``, ``optimizer.step``/``zero_grad``) in ``p`` processes.
   Not for the GPT: its head is tied to the token embedding, one weight on the first and the last stage, which
   ``PipelineStage`` cannot express.
3. **torch.distributed.pipelining + freed memory kept** (CPU only): the same, with glibc told to keep freed memory in
   the process (what ``PipelineParallelStrategy(reuse_cpu_memory=True)``, the default, does on CPU), to show how much
   of the difference is the allocator.
4. **single process**: the whole model in one process, the same plain loop over the whole batch (no micro-batches).

**Data parallelism** (``--replicas r``; by default 2 as well where the machine has a core or GPU for each of the
``2p`` processes): ``r`` copies of each ``p``-stage pipeline in ``p * r`` processes, each replica reading its own
batches of the same size (weak scaling: ``r`` times the samples per step). lightning_pp runs
``PipelineParallelStrategy(pipeline_parallel_size=p)`` on ``p * r`` devices (Lightning's sampler shards the data);
torch.distributed.pipelining wraps each stage's layers in ``DistributedDataParallel`` over that stage's replicas (the
same rank layout: a stage's replicas on neighbouring ranks) and gives ``PipelineStage`` the pipeline's group, each
replica reading its shard through a ``DistributedSampler``. The ideal step is the one-replica ideal: the gradient
all-reduce is overhead.

Every process runs with one CPU thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). ``--device`` picks
where: ``cpu`` computes there and communicates over gloo; ``cuda`` gives rank ``r`` GPU ``r`` and uses NCCL (the
single process runs on GPU 0). The default is ``cuda`` when at least 2 GPUs are visible, else ``cpu``. With
``--device cuda`` and fewer GPUs than processes (one GPU, say: NCCL refuses two ranks on one GPU) every pipeline runs
in **one process holding all its stages** on GPU 0 (``interleaved_1f1b`` with ``stages_per_rank=p``; torch:
``ScheduleInterleaved1F1B`` over the ``p`` stages of rank 0, which hands activations between local stages without
communication), one replica: the table then shows each framework's cost of running the schedule, and the ideal is the
single process's step (one device cannot go faster by splitting its work). The default
stage counts are 2, and 4 where the machine has 4 cores (CPU: one per process) or 4 GPUs. The runs are
launched as subprocesses the way torchrun would (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``NODE_RANK``; the rendezvous store hosted by the launching script, as torchrun's agent hosts it:
``benchmarks/_workers.py``); Lightning sees an external launcher because ``LOCAL_RANK`` is set.

Definitions (``p`` stages, ``m`` micro-batches, ``T_single`` the single-process median step time):

- **step time**: wall time on rank 0 (first stage, which finishes last in every schedule here) from the start of one
  step to the start of the next (``time.perf_counter``; on GPU after ``torch.cuda.synchronize``, so that the clock
  covers the queued kernels). Every runner is timed by this same window, so that each pays for everything its loop
  does per step: fetching and collating the batch from the ``DataLoader``, copying it to the device, the
  forward/backward schedule, ``optimizer.step``/``zero_grad``, and any bookkeeping between steps (Lightning's
  hooks, logging and progress tracking; a plain loop has next to none). Timing only the compute of the step would
  leave out exactly the costs in which a framework's loop differs from a hand-written one. For lightning_pp the
  clock is read in a Callback's ``on_train_batch_start`` and ``fit`` runs one step more than is timed, whose start
  ends the last timed step; for the plain loops it is read at the top of every iteration, before the next batch is
  fetched, and one more time after the last timed step. (Lightning calls the hook after fetching and copying the
  batch, so its window holds the next batch's loading rather than its own: the same work per step.) Reported:
  median over the steps after the first ``--warmup`` (default 3) of every launch, with min-max.
- **ratio to torch**: median step of the runner / median step of torch.distributed.pipelining, same schedule.
- **ideal**: ``T_single / p / (1 - b)``, the step time of a perfect ``p``-way split of the work with only the
  schedule's own bubble ``b``: the simulator's, at forward = input gradient = weight gradient (a backward twice a
  forward). For GPipe and 1F1B that is ``T_single * (m + p - 1) / (m * p)``; interleaved 1F1B (2 stages per rank)
  and ZB-H1 have smaller bubbles, ``(p - 1) / (2m + p - 1)`` and ``(p - 1) / (3m + p - 1)``.
- **efficiency**: ``ideal / median step`` (1.0 = only the schedule's bubble is paid).
- **overhead per micro-batch**: ``(median step - ideal) / m``: everything beyond the ideal pipelined step
  (communication, framework code, the cost of smaller matmuls on micro-batches), spread over the micro-batches, in
  milliseconds.
- **measured bubble**: ``pipeline/bubble_fraction`` of :class:`lightning_pp.PipelineMonitor` (share of the step's
  wall time the stages did not compute), median over a separate short run with ``logging_interval=1`` (that run is
  not used for step times, as timing every action costs a little). lightning_pp only.
- **peak activation memory per stage**, measured over one step after warm-up, the same way for all runners (for
  lightning_pp in the monitor run; for the plain loops in one extra step after the timed ones, which is not timed),
  by the meters of ``lightning_pp.monitor.memory`` that ``PipelineMonitor``'s ``peak_memory_mb`` uses:

  - CPU has no allocator peak to read, so this counts the bytes of tensors saved for backward:
    ``torch.autograd.graph.saved_tensors_hooks`` records every saved tensor; its storage is counted once
    (deduplicated by storage pointer) while any saved reference to it is alive, parameters (and views of them)
    excluded. The peak of that live total over the step is reported.
  - On GPU it is the CUDA caching allocator's peak during the step (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``) minus what was allocated when the step began (parameters, optimizer state):
    activations, but also weight gradients and transfer buffers, which are the same for every schedule.

Results are printed as a markdown table and written to ``benchmarks/results/compare.md`` and ``compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _workers import launch_processes  # beside this script

if TYPE_CHECKING:
    from lightning_pp.monitor.memory import AllocatorPeakMeter, SavedTensorMeter

NUM_LAYERS = 8
GPT_DIM, GPT_HEADS, GPT_BLOCK, GPT_VOCAB, GPT_BATCH = 256, 4, 64, 64, 32
RUNNER_LABELS = {  # --runners name -> label in the table
    "single": "single process",
    "torch": "torch.distributed.pipelining",
    "torch_kept": "torch.distributed.pipelining + freed memory kept",
    "lightning": "lightning_pp",
}
PIPELINE_RUNNERS = ("torch", "torch_kept", "lightning")
CPU_ONLY_RUNNERS = ("torch_kept",)  # the glibc allocator setting has nothing to do on a GPU
MICROBATCHES = 8
STAGES_PER_RANK = {"interleaved_1f1b": 2}  # the schedules that hold more than one stage per rank
BATCH = 128
LR = 0.01
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------------------------------
# Shared pieces (imported lazily so the parent process stays light)
# --------------------------------------------------------------------------------------------------------------------


def make_layers(hidden: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(NUM_LAYERS)])


def make_gpt() -> Any:
    """The GPT-style LightningModule of examples/train_gpt.py (head tied to the token embedding), benchmark-sized."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_gpt

    torch.manual_seed(0)
    return train_gpt.GPT(vocab_size=GPT_VOCAB, block_size=GPT_BLOCK, dim=GPT_DIM, layers=NUM_LAYERS, heads=GPT_HEADS)


def make_tokens(steps: int) -> Any:
    """``steps`` batches of random token sequences (inputs and next-token targets), one row per sample."""
    import torch

    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, GPT_VOCAB, (steps * GPT_BATCH, GPT_BLOCK + 1), generator=gen)


def model_label(model: str, hidden: int) -> str:
    if model == "gpt":
        return f"GPT {NUM_LAYERS}x{hidden} (example)"
    return f"MLP {NUM_LAYERS}x{hidden}"


def make_batches(hidden: int, steps: int) -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, hidden, generator=gen), torch.randn(BATCH, hidden, generator=gen))
            for _ in range(steps)]


def make_loader(run: dict[str, Any], steps: int, replica: int | None = None) -> Any:
    """The ``DataLoader`` every runner reads: ``steps`` batches of the run's model per data-parallel replica, on the
    CPU, no workers (loading and collating happen in the training process, inside the timed window). With
    ``replica``, the loader reads that replica's shard itself (what Lightning's sampler does for lightning_pp)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    batches = steps * run.get("replicas", 1)
    if run["model"] == "gpt":
        data: Any = make_tokens(batches)
        batch_size = GPT_BATCH
    else:
        pairs = make_batches(run["hidden"], batches)
        data, batch_size = TensorDataset(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])), BATCH
    sampler: Any = (DistributedSampler(data, num_replicas=run["replicas"], rank=replica, shuffle=False)
               if replica is not None else None)
    return DataLoader(data, batch_size=batch_size, shuffle=False, sampler=sampler)


def to_device(batch: Any, device: Any) -> Any:
    """A collated batch (a tensor, or a list of them) on ``device``, copied as Lightning's ``batch_to_device`` does."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return [tensor.to(device, non_blocking=True) for tensor in batch]


def ideal_bubble(schedule: str, ranks: int) -> float:
    """The bubble of ``schedule`` alone: simulated with forward = input gradient = weight gradient, free transfers."""
    from lightning_pp.schedule import build_schedule
    from lightning_pp.schedule.simulate import action_costs, simulate

    built = build_schedule(schedule, ranks, MICROBATCHES, stages_per_rank=STAGES_PER_RANK.get(schedule, 1))
    return simulate(built, action_costs()).bubble_fraction()


def step_windows(marks: list[float]) -> list[float]:
    """Step times from the clock read at the start of every step and once more when the last one has ended."""
    return [end - start for start, end in pairwise(marks)]


def run_device(settings: dict[str, Any]) -> Any:
    """This process's device for the ``"device"`` of ``settings`` (a run or the whole spec): GPU ``LOCAL_RANK`` for
    ``cuda``, else the CPU."""
    import torch

    if settings["device"] == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def synchronize(device: Any) -> None:
    """Wait for the device's queued work, so that a host clock read after it covers the kernels."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def processes(run: dict[str, Any]) -> int:
    """The processes of a run: one per stage and replica, or one holding every stage (``colocated``)."""
    return 1 if run.get("colocated") else run["stages"] * run["replicas"]


def summarize(times: list[float]) -> dict[str, float] | None:
    if not times:
        return None
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


# --------------------------------------------------------------------------------------------------------------------
# Workers (run in subprocesses)
# --------------------------------------------------------------------------------------------------------------------


def worker_single(run: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightning_pp.monitor.memory import step_memory_meter

    device = run_device(run)
    model: Any
    opt: torch.optim.Optimizer
    loss_of: Callable[[Any], Any]
    if run["model"] == "gpt":
        model = make_gpt().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def next_token_loss(tokens: Any) -> Any:
            logits = model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

        loss_of = next_token_loss
    else:
        model = make_layers(run["hidden"]).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def mse_loss(batch: Any) -> Any:
            return F.mse_loss(model(batch[0]), batch[1])

        loss_of = mse_loss

    meter = step_memory_meter(model, device)
    batches = iter(make_loader(run, run["steps"] + 1))
    marks: list[float] = []
    for i in range(run["steps"] + 1):
        synchronize(device)  # so that the clock covers the previous step's queued kernels
        marks.append(time.perf_counter())
        batch = to_device(next(batches), device)
        # one extra step after the timed ones is metered (the hooks cost time); its start ends the last timed step
        metered = meter.measure() if i == run["steps"] else nullcontext()
        with metered:  # the whole step, as for the pipelines (the optimizer's temporaries count on a GPU)
            loss_of(batch).backward()
            opt.step()
            opt.zero_grad()
    return {"times": step_windows(marks), "peak_saved_bytes": meter.peak}


def worker_torch(run: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
    from torch.nn.parallel import DistributedDataParallel

    from lightning_pp.monitor.memory import step_memory_meter

    device = run_device(run)
    layers = make_layers(run["hidden"])
    stages, replicas = run["stages"], run["replicas"]
    index, replica = rank // replicas, rank % replicas  # lightning_pp's layout: a stage's replicas side by side
    pipeline_group, replica_group = pipeline_and_replica_groups(stages, replicas, rank)
    per_rank = stages if run.get("colocated") else STAGES_PER_RANK.get(run["schedule"], 1)
    ranks = 1 if run.get("colocated") else stages
    total = ranks * per_rank  # round-robin: this rank holds stages index, index + ranks, ...
    held = [index + k * ranks for k in range(per_rank)]
    per_stage = NUM_LAYERS // total
    submodule = torch.nn.ModuleList(layers[s * per_stage:(s + 1) * per_stage] for s in held).to(device)
    pipeline_stages: list[Any] = [
        PipelineStage(DistributedDataParallel(part, process_group=replica_group) if replicas > 1 else part,
                      stage_index=s, num_stages=total, device=device, group=pipeline_group)
        for s, part in zip(held, submodule, strict=True)
    ]
    if run["schedule"] in ("gpipe", "1f1b"):
        single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run["schedule"]]
        schedule: Any = single(pipeline_stages[0], n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    else:  # one class runs several stages per rank, or zero bubble (with one stage per rank: ZB-H1)
        multi = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zb_h1": ScheduleInterleavedZeroBubble}
        schedule = multi[run["schedule"]](pipeline_stages, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(submodule.parameters(), lr=LR)
    meter = step_memory_meter(submodule, device)
    is_first, is_last = 0 in held, total - 1 in held

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        losses: list[torch.Tensor] = []
        if is_first and is_last:  # every stage in this process
            schedule.step(x, target=y, losses=losses)
        elif is_first:
            schedule.step(x)
        elif is_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()

    batches = iter(make_loader(run, run["steps"] + 1, replica if replicas > 1 else None))
    marks: list[float] = []
    for i in range(run["steps"] + 1):
        synchronize(device)  # so that the clock covers the previous step's queued kernels
        marks.append(time.perf_counter())
        x, y = to_device(next(batches), device)
        # one extra step after the timed ones is metered (the hooks cost time); its start ends the last timed step
        with meter.measure() if i == run["steps"] else nullcontext():
            step(x, y)
    return {"times": step_windows(marks) if rank == 0 else [], "peak_saved_bytes": meter.peak}


def pipeline_and_replica_groups(stages: int, replicas: int, rank: int) -> tuple[Any, Any]:
    """This rank's pipeline group and its stage's data-parallel group (every rank creates every group, in order)."""
    import torch.distributed as dist

    if replicas == 1:
        return None, None
    mine: list[Any] = [None, None]
    for replica in range(replicas):
        ranks = [stage * replicas + replica for stage in range(stages)]
        group = dist.new_group(ranks)
        mine[0] = group if rank in ranks else mine[0]
    for stage in range(stages):
        ranks = [stage * replicas + replica for replica in range(replicas)]
        group = dist.new_group(ranks)
        mine[1] = group if rank in ranks else mine[1]
    return mine[0], mine[1]


def worker_lightning(run: dict[str, Any], rank: int) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch import nn

    from lightning_pp import PipelineMonitor, PipelineParallelStrategy
    from lightning_pp.monitor.memory import step_memory_meter

    hidden = run["hidden"]

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers: nn.Sequential = make_layers(hidden)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.layers(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class StepTimer(Callback):
        """Reads the clock at the start of every training batch: consecutive marks bound one step's window."""

        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            synchronize(pl_module.device)  # so that the clock covers the previous step's queued kernels
            self.marks.append(time.perf_counter())

    class MemoryProbe(Callback):
        """Meters the saved tensors of one training step (hooks pushed at batch start, popped at batch end)."""

        def __init__(self, step: int) -> None:
            self.step = step
            self.meter: SavedTensorMeter | AllocatorPeakMeter | None = None
            self._ctx: Any = None

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if trainer.global_step == self.step:
                self.meter = step_memory_meter(pl_module, pl_module.device)
                self._ctx = self.meter.measure()
                self._ctx.__enter__()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self._ctx is not None:
                self._ctx.__exit__(None, None, None)
                self._ctx = None

    def fit(steps: int, callbacks: list[Callback]) -> None:
        module: L.LightningModule = make_gpt() if run["model"] == "gpt" else MLP()
        colocated = {"stages_per_rank": run["stages"], "pipeline_parallel_size": 1} if run.get("colocated") else {
            "pipeline_parallel_size": run["stages"]}
        trainer = L.Trainer(
            accelerator="gpu" if run["device"] == "cuda" else "cpu", devices=processes(run),
            strategy=PipelineParallelStrategy(schedule=run["schedule"], microbatches=MICROBATCHES, **colocated,
                                              activation_checkpointing=run.get("activation_checkpointing", False)),
            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks,
        )
        trainer.fit(module, make_loader(run, steps))

    timer = StepTimer()
    fit(run["steps"] + 1, [timer])  # the extra step's start ends the last timed step
    bubbles: list[float] = []
    peak_saved_bytes = None
    if run["monitor_steps"] > 0:
        monitor = PipelineMonitor(logging_interval=1, timeline_every_n_steps=0)
        probe = MemoryProbe(step=min(run["warmup"], run["monitor_steps"] - 1))
        fit(run["monitor_steps"], [monitor, probe])
        bubbles = [h["pipeline/bubble_fraction"] for h in monitor.history if "pipeline/bubble_fraction" in h]
        peak_saved_bytes = probe.meter.peak if probe.meter is not None else None
    return {"times": step_windows(timer.marks[:run["steps"] + 1]) if rank == 0 else [], "bubble_fractions": bubbles,
            "peak_saved_bytes": peak_saved_bytes}


def worker_main(kind: str, spec_path: str, out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = run_device(spec)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)
    if kind.startswith("torch"):
        import torch.distributed as dist

        if kind == "torch_kept":
            from lightning_pp.runtime.allocator import keep_freed_cpu_memory

            keep_freed_cpu_memory()
        dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world,
                                device_id=device if on_gpu else None,
                                store=dist.HashStore() if world == 1 else None)  # one process: none to meet
    results: list[dict[str, Any]] = []
    try:
        for run in spec["runs"]:
            if kind == "single":
                results.append(worker_single(run))
            elif kind.startswith("torch"):
                results.append(worker_torch(run, rank))
                dist.barrier()
            else:
                results.append(worker_lightning(run, rank))
            Path(out_dir, f"{kind}_rank{rank}.json").write_text(json.dumps(results))  # partial results survive
    finally:
        if kind.startswith("torch"):
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------------
# Parent: launch, collect, tabulate
# --------------------------------------------------------------------------------------------------------------------


def launch(kind: str, device: str, runs: list[dict[str, Any]], world: int, timeout: float,
           tmp: Path, script: Path | None = None) -> list[list[dict[str, Any]]]:
    """Run ``runs`` in ``world`` fresh worker processes of ``script`` (this one by default, called with ``--worker
    kind --spec FILE --out DIR``; started by ``_workers.launch_processes``); returns per rank the list of per-run
    results (what the rank wrote before it failed, if it did: the failure is printed, not raised)."""
    for old in tmp.glob(f"{kind}_rank*.json"):
        old.unlink()
    spec = tmp / f"{kind}_spec.json"
    spec.write_text(json.dumps({"device": device, "runs": runs}))
    command = [sys.executable, str(script or Path(__file__).resolve()), "--worker", kind, "--spec", str(spec),
               "--out", str(tmp)]
    job = launch_processes(command, world, timeout)
    if job.timed_out or any(job.returncodes):
        why = f"timed out after {timeout:.0f} s" if job.timed_out else "failed"
        for rank, (code, output) in enumerate(zip(job.returncodes, job.outputs, strict=True)):
            print(f"--- {kind} rank {rank} {why} (exit {code}) ---\n{output[-2500:]}", file=sys.stderr)
    per_rank: list[list[dict[str, Any]]] = []
    for rank in range(world):
        path = tmp / f"{kind}_rank{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else [])
    return per_rank


Config = tuple[str, int, str, int, int]  # model, hidden, schedule ("-" for the single process), stages, replicas
PerRank = list[dict[str, Any] | None]  # one run's result on every rank (None where a rank produced none)


def without_warmup(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A launch's result with its first ``warmup`` step times and bubble fractions left out."""
    out = dict(result, times=result["times"][warmup:])
    if "bubble_fractions" in result:
        out["bubble_fractions"] = result["bubble_fractions"][warmup:] or result["bubble_fractions"]
    return out


def pool(repeats: list[PerRank]) -> PerRank:
    """Merge one configuration's repeated launches per rank: times and bubbles concatenated, peak memory maxed."""
    merged: PerRank = []
    for rank in range(max(len(rep) for rep in repeats)):
        parts = [part for rep in repeats if rank < len(rep) and (part := rep[rank]) is not None]
        if not parts:
            merged.append(None)
            continue
        peaks = [part["peak_saved_bytes"] for part in parts if part.get("peak_saved_bytes") is not None]
        out: dict[str, Any] = {"times": [t for part in parts for t in part["times"]],
                               "peak_saved_bytes": max(peaks) if peaks else None}
        if any("bubble_fractions" in part for part in parts):
            out["bubble_fractions"] = [b for part in parts for b in part.get("bubble_fractions", [])]
        merged.append(out)
    return merged


def fmt_s(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "failed"
    return f"{stats['median']:.4f} ({stats['min']:.4f}-{stats['max']:.4f})"


def fmt_mib(values: list[int | None]) -> str:
    if not values or any(v is None for v in values):
        return "n/a"
    return " / ".join(f"{v / 2**20:.1f}" for v in values if v is not None) + " MiB"


def build_rows(results: dict[str, dict[Config, PerRank]], models: list[tuple[str, int]],
               configs: list[Config], colocated: bool = False) -> list[dict[str, Any]]:
    """One table row per (configuration, runner), with the derived columns of the module docstring."""
    m = MICROBATCHES
    rows: list[dict[str, Any]] = []

    def first_rank(kind: str, config: Config) -> dict[str, Any] | None:
        per_rank = results.get(kind, {}).get(config)
        return per_rank[0] if per_rank else None

    t_single: dict[tuple[str, int], float] = {}
    if "single" in results:
        for model, hidden in models:
            res = first_rank("single", (model, hidden, "-", 1, 1))
            stats = summarize(res["times"]) if res else None
            if stats:
                t_single[(model, hidden)] = stats["median"]
            rows.append({
                "model": model_label(model, hidden), "hidden": hidden, "schedule": "-", "stages": 1, "replicas": 1,
                "microbatches": 1, "runner": RUNNER_LABELS["single"], "step_s": stats, "ratio_to_torch": None,
                "efficiency": None, "bubble_fraction": None,
                "peak_saved_bytes": [res["peak_saved_bytes"] if res else None], "overhead_per_microbatch_ms": None,
            })
    for config in configs:
        model, hidden, schedule, p, replicas = config
        torch_res = first_rank("torch", config)
        torch_stats = summarize(torch_res["times"]) if torch_res else None
        ts = t_single.get((model, hidden))
        ideal = None if ts is None else ts if colocated else ts / p / (1 - ideal_bubble(schedule, p))
        for kind in PIPELINE_RUNNERS:
            if config not in results.get(kind, {}):  # runner not measured (--runners, device, or the GPT for torch)
                continue
            res0 = first_rank(kind, config)
            stats = summarize(res0["times"]) if res0 else None
            bubbles = res0.get("bubble_fractions") if res0 else None
            rows.append({
                "model": model_label(model, hidden), "hidden": hidden, "schedule": schedule, "stages": p,
                "replicas": replicas, "microbatches": m, "runner": RUNNER_LABELS[kind], "step_s": stats,
                "ratio_to_torch": stats["median"] / torch_stats["median"] if stats and torch_stats else None,
                "efficiency": ideal / stats["median"] if stats and ideal else None,
                "bubble_fraction": statistics.median(bubbles) if bubbles else None,
                "peak_saved_bytes": [(res or {}).get("peak_saved_bytes") for res in results[kind][config]],
                "overhead_per_microbatch_ms": (stats["median"] - ideal) / m * 1e3 if stats and ideal else None,
            })
    return rows


def markdown(rows: list[dict[str, Any]], memory_column: str) -> str:
    def opt(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [
        "| config (model, schedule, stages, micro-batches) | runner | median step s (min-max) | ratio to torch "
        f"| efficiency | measured bubble | {memory_column} / stage | overhead / micro-batch ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        replicas = f" x {r['replicas']} replicas" if r["replicas"] > 1 else ""
        config = f"{r['model']}, {r['schedule']}, p={r['stages']}{replicas}, m={r['microbatches']}"
        bubble = "n/a" if r["runner"] != RUNNER_LABELS["lightning"] else opt(r["bubble_fraction"], ".3f")
        lines.append(
            f"| {config} | {r['runner']} | {fmt_s(r['step_s'])} | {opt(r['ratio_to_torch'], '.2f')} "
            f"| {opt(r['efficiency'], '.2f')} | {bubble} | {fmt_mib(r['peak_saved_bytes'])} "
            f"| {opt(r['overhead_per_microbatch_ms'], '.2f')} |"
        )
    return "\n".join(lines)


def machine_description(device: str, colocated: bool = False) -> str:
    """What the numbers were measured on, for the table's caption and the JSON."""
    import platform

    if device == "cuda":
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        where = ", one process per pipeline" if colocated else ", NCCL"
        return f"{len(names)} x {names[0]}{where}, {os.cpu_count()} CPU cores"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    where = "one process per pipeline" if colocated else "gloo"
    return f"{cpu}, {os.cpu_count()} cores, {where}, one thread per process"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024],
                        help="MLP hidden sizes (default 512 1024)")
    parser.add_argument("--gpt", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the GPT-style example model (default on)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"],
                        choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"],
                        help="interleaved_1f1b runs 2 stages per rank (torch: ScheduleInterleaved1F1B), zb_h1 one "
                             "(torch: ScheduleInterleavedZeroBubble)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cpu (gloo) or cuda (NCCL, one GPU per stage); auto: cuda with 2 or more GPUs")
    parser.add_argument("--stages", type=int, nargs="+", choices=[2, 4, 8],
                        help="pipeline stage counts (default 2, and 4 where the machine has 4 cores or GPUs)")
    parser.add_argument("--replicas", type=int, nargs="+",
                        help="data-parallel replicas of each pipeline (default 1, and 2 where the machine has a core "
                             "or GPU for every process of 2 replicas of the smallest pipeline)")
    parser.add_argument("--one-process", action="store_true",
                        help="every pipeline in one process holding all its stages (interleaved_1f1b, one replica); "
                             "the default on --device cuda with fewer GPUs than processes")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="lightning_pp recomputes every block's activations in backward (memory for compute)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the statistics (default 3)")
    parser.add_argument("--monitor-steps", type=int, default=8, help="steps of the PipelineMonitor run (default 8)")
    parser.add_argument("--runners", nargs="+", default=list(RUNNER_LABELS), choices=list(RUNNER_LABELS),
                        help="which runners to measure (default all)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="repeat every measurement (timed steps are pooled; default 1)")
    parser.add_argument("--quick", action="store_true", help="10 steps, 2 warm-up, 5 monitor steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launched job before it is killed")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for compare.md and compare.json")
    parser.add_argument("--worker", choices=list(RUNNER_LABELS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.steps, args.warmup, args.monitor_steps = 10, 2, 5
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    import torch

    gpus = torch.cuda.device_count()
    if args.device == "auto":
        args.device = "cuda" if gpus >= 2 else "cpu"
    capacity = gpus if args.device == "cuda" else os.cpu_count() or 1
    if args.stages is None:
        args.stages = [2, 4] if capacity >= 4 else [2]
    if args.replicas is None:
        args.replicas = [1, 2] if capacity >= 2 * min(args.stages) else [1]
    widest = max(args.stages) * max(args.replicas)
    args.colocated = args.one_process or (args.device == "cuda" and 1 <= gpus < widest)
    if args.colocated:  # one process holds every stage of the pipeline
        left_out = sorted(set(args.schedules) - {"interleaved_1f1b"})
        print(f"note: every pipeline runs in one process holding its stages (interleaved_1f1b, one replica)"
              f"{'; left out: ' + ', '.join(left_out) if left_out else ''}", file=sys.stderr)
        args.schedules, args.replicas = ["interleaved_1f1b"], [1]
    elif args.device == "cuda" and widest > gpus:
        fitting = " ".join(str(p) for p in args.stages if p * max(args.replicas) <= gpus)
        parser.error(f"--stages {max(args.stages)} x --replicas {max(args.replicas)} on --device cuda needs one GPU "
                     f"per process, but {gpus} are visible; "
                     f"{f'pass --stages {fitting} or ' if fitting else ''}use --device cpu")
    if args.device == "cpu" and widest > capacity:
        print(f"warning: {widest} processes (stages x replicas) on {capacity} cores: the processes share cores, so "
              f"that row measures oversubscription rather than the pipeline", file=sys.stderr)
    skipped = [kind for kind in args.runners if args.device == "cuda" and kind in CPU_ONLY_RUNNERS]
    if skipped:
        print(f"note: {', '.join(skipped)} measured on CPU only; left out on cuda", file=sys.stderr)
        args.runners = [kind for kind in args.runners if kind not in skipped]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec, str(args.out))
        return
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-minute load average is {load_before:.2f} before starting; other processes compete for the "
              f"{os.cpu_count()} cores and will inflate the times", file=sys.stderr)
    models = [("mlp", h) for h in args.hidden] + ([("gpt", GPT_DIM)] if args.gpt else [])
    configs: list[Config] = [(model, h, s, p, r) for r in args.replicas for p in args.stages for model, h in models
                             for s in args.schedules]
    common = {"device": args.device, "steps": args.steps, "warmup": args.warmup, "monitor_steps": args.monitor_steps,
              "activation_checkpointing": args.activation_checkpointing, "colocated": args.colocated}
    launches: list[tuple[str, int, list[Config]]] = []  # runner, processes, configurations measured in one launch
    for kind in RUNNER_LABELS:
        if kind not in args.runners:
            continue
        if kind == "single":
            launches.append((kind, 1, [(model, h, "-", 1, 1) for model, h in models]))
            continue
        for p in args.stages:
            for r in args.replicas:
                measured = [c for c in configs
                            if c[3:] == (p, r) and not (kind.startswith("torch") and c[0] == "gpt")]
                if measured:  # PipelineStage cannot share the GPT's tied embedding/head weight between stages
                    launches.append((kind, 1 if args.colocated else p * r, measured))
    repeats: dict[str, dict[Config, list[PerRank]]] = {kind: {} for kind in args.runners}
    with tempfile.TemporaryDirectory(prefix="lpp_compare_") as tmp_name:
        for repeat in range(args.repeats):
            for kind, world, measured in launches:
                runs = [{"model": model, "hidden": h, "schedule": s, "stages": p, "replicas": r, **common}
                        for model, h, s, p, r in measured]
                t0 = time.perf_counter()
                print(f"[{repeat + 1}/{args.repeats}] {kind}, {world} process(es): {len(runs)} run(s) ...",
                      file=sys.stderr, flush=True)
                per_rank = launch(kind, args.device, runs, world, args.timeout, Path(tmp_name))
                for index, config in enumerate(measured):
                    repeats[kind].setdefault(config, []).append(
                        [without_warmup(rank_runs[index], args.warmup) if index < len(rank_runs) else None
                         for rank_runs in per_rank])
                print(f"    done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results = {kind: {config: pool(reps) for config, reps in by_config.items()} for kind, by_config in repeats.items()}
    rows = build_rows(results, models, configs, args.colocated)
    memory_column = "peak allocator memory" if args.device == "cuda" else "peak saved activations"
    machine = machine_description(args.device, args.colocated)
    table = markdown(rows, memory_column)
    elapsed = time.perf_counter() - started
    print(f"Measured on {machine}.\n\n{table}")
    print(f"\ntotal runtime: {elapsed:.1f} s  (steps={args.steps}, warm-up={args.warmup}, "
          f"monitor steps={args.monitor_steps}, repeats={args.repeats}; "
          f"1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.md").write_text(f"Measured on {machine}.\n\n{table}\n")
    meta = {"machine": machine, "device": args.device, "steps": args.steps, "warmup": args.warmup,
            "monitor_steps": args.monitor_steps, "repeats": args.repeats, "batch": BATCH, "layers": NUM_LAYERS,
            "stages": args.stages, "replicas": args.replicas, "microbatches": MICROBATCHES,
            "one_process_per_pipeline": args.colocated,
            "memory_column": memory_column,
            "runtime_s": elapsed, "cpu_count": os.cpu_count(), "loadavg_1min_before": load_before,
            "loadavg_1min_after": os.getloadavg()[0]}
    (args.out / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
