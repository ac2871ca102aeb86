"""``schedule="auto"`` at the start of ``fit``: measure, search (:mod:`lightning_pp.tuning.search`), choose alike
everywhere.

Global rank 0 times the module's blocks on fit's first batch, at the largest and the smallest micro-batch the search
considers, on a throw-away copy of the module with every random generator restored (the probe of ``balance="time"``:
the module, its metrics and the data order are untouched). The first two ranks of the first pipeline time a message
between them (latency and bandwidth). Rank 0 searches, logs the fastest candidates and the choice, and broadcasts the
choice; every rank then runs it. Where nothing can be measured (``validate``/``test``/``predict``, no training data, a
module on the meta device) the choice is the default configuration (1F1B, twice as many micro-batches as ranks, an
even split), with a log line.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision

from lightning_pp._logging import get_logger
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.blocks import find_blocks
from lightning_pp.model.callbacks import batch_statistics_modules
from lightning_pp.options import PipelineOptions
from lightning_pp.parallel.device import synchronize_device
from lightning_pp.parallel.topology import PipelineLayout
from lightning_pp.run import RunContext
from lightning_pp.runtime.microbatch import batch_size, split_batch
from lightning_pp.tuning.balance import measure_block_costs, probe_first_batch, why_not_time
from lightning_pp.tuning.closed_loop import AutoChoice, AutoSearch
from lightning_pp.tuning.search import MAX_MICROBATCHES, Candidate, MeasuredCosts, search

__all__ = ["choose_configuration"]

log = get_logger(__name__)


# the runtime's own time per action (its bookkeeping, autograd's and the transfers' calls) where it is not measured
_FRAMEWORK_S = {"cpu": 100e-6, "cuda": 30e-6}
_SHOWN = 5  # candidates printed


def choose_configuration(run: RunContext, module: pl.LightningModule) -> AutoChoice:
    """The run's options with ``schedule="auto"`` made concrete (the same on every rank), the chosen candidate (None:
    nothing could be measured: the default configuration, which a later run of the same module keeps, as it keeps the
    split) and its closed loop (:mod:`lightning_pp.tuning.closed_loop`)."""
    options, trainer, layout, rank, device = run.options, run.trainer, run.layout, run.rank, run.device
    reason = why_not_time(trainer, module)
    outcome: list[tuple[str, Any]] = [("default", reason)]  # ("chosen", Candidate), ("default", why), ("failed", why)
    link = _measure_link(layout, rank, device, run.collective) if reason is None else (0.0, 0.0)
    error: Exception | None = None
    searched: AutoSearch | None = None
    if rank == 0 and reason is None:
        try:
            chosen_here = _search_on_rank_zero(options, module, trainer, layout, device, run.precision, link)
            if isinstance(chosen_here, str):
                outcome[0] = ("default", chosen_here)
            else:
                outcome[0], searched = ("chosen", chosen_here[0]), chosen_here[1]
        except Exception as caught:  # every rank raises it, below
            error = caught
            outcome[0] = ("failed", f"{type(caught).__name__}: {caught}")
    if layout.world_size > 1:
        with run.collective("the broadcast of schedule='auto''s choice"):
            dist.broadcast_object_list(outcome, src=0, group=run.object_group())
    kind, chosen = outcome[0]
    if kind == "failed":
        raise PipelineConfigError(f"schedule='auto' could not choose a configuration ({chosen}). Name a schedule "
                                  f"instead (schedule='1f1b').") from error
    if kind == "default":
        several = (options.stages_per_rank or 1) > 1 or len(options.balance_list or []) > layout.num_stages
        schedule = "interleaved_1f1b" if several else "1f1b"  # what the user fixed still runs
        if rank == 0:
            log.info(f"schedule='auto' runs the default configuration ({schedule}): {chosen}")
        return AutoChoice(dataclasses.replace(options, schedule=schedule, max_memory=None))
    for logger in trainer.loggers:  # loggers write on global rank 0 only
        logger.log_hyperparams({"pipeline_auto/schedule": chosen.schedule, "pipeline_auto/microbatches":
                                chosen.microbatches, "pipeline_auto/stages_per_rank": chosen.stages_per_rank,
                                "pipeline_auto/balance": str(list(chosen.balance)),
                                "pipeline_auto/activation_checkpointing": chosen.recompute,
                                "pipeline_auto/predicted_step_ms": 1e3 * chosen.step_s})
    concrete = dataclasses.replace(
        options, schedule=chosen.schedule, microbatches=chosen.microbatches, stages_per_rank=chosen.stages_per_rank,
        balance=list(chosen.balance), activation_checkpointing=options.activation_checkpointing or chosen.recompute,
        max_memory=None)
    # a batch's batch statistics depend on the micro-batch count: the closed loop keeps it then
    return AutoChoice(concrete, chosen, searched, rank, options.microbatches is not None
                      or bool(batch_statistics_modules(module)), run.object_group)


def _search_on_rank_zero(options: PipelineOptions, module: pl.LightningModule, trainer: pl.Trainer,
                         layout: PipelineLayout, device: torch.device, precision: Precision,
                         link: tuple[float, float]) -> tuple[Candidate, AutoSearch] | str:
    name, _ = find_blocks(module, options.blocks)
    ranks = layout.num_stages

    def measure(probe: pl.LightningModule, batch: Any) -> tuple[MeasuredCosts, int]:
        size = batch_size(batch)
        fixed = options.microbatches
        counts = {min(fixed, size)} if fixed is not None else {min(ranks, size), min(size, MAX_MICROBATCHES)}
        measured = []
        for count in sorted(counts):
            microbatch = split_batch(batch, count)[0][0]
            measured.append((batch_size(microbatch), measure_block_costs(
                probe, name, microbatch, device=device, step_context=precision.train_step_context,
                recompute_every=options.recompute_every, detailed=True)))
        measured.sort(key=lambda item: item[0])
        (low, a), (high, b) = measured[0], measured[-1]  # one size measured: a constant cost
        costs = MeasuredCosts(
            sizes=(float(low), float(high)), forward=(a.forward, b.forward),
            input_backward=(a.input_backward, b.input_backward),
            weight_backward=([x - y for x, y in zip(a.backward, a.input_backward, strict=True)],
                             [x - y for x, y in zip(b.backward, b.input_backward, strict=True)]),
            saved_bytes=(a.saved_bytes, b.saved_bytes), output_bytes=(a.output_bytes, b.output_bytes),
            before=(a.before, b.before), after=(a.after, b.after),
            outside_saved_bytes=(a.outside_saved_bytes, b.outside_saved_bytes), latency_s=link[0],
            seconds_per_byte=link[1],
            framework_s=_FRAMEWORK_S.get(device.type, _FRAMEWORK_S["cuda"]),
            shared_bytes=(a.shared_bytes, b.shared_bytes))
        return costs, size

    started = time.perf_counter()
    measured = probe_first_batch(module, trainer, device, precision, measure)
    if measured is None:
        return "the train dataloader gave no batch that can be read without taking it from training"
    costs, size = measured
    balance = tuple(options.balance_list) if options.balance_list is not None else None
    searched = AutoSearch(costs, ranks, size, _budget(options.max_memory, device), options.microbatches,
                          options.stages_per_rank, balance,
                          False if options.recompute_every else None)  # the probe's costs recompute then
    candidates = search(costs, ranks, size, max_memory=searched.max_memory, microbatches=searched.microbatches,
                        stages_per_rank=searched.stages_per_rank, balance=searched.balance,
                        recompute=searched.recompute)
    lines = [f"schedule='auto' measured the blocks of `{name}` on a batch of {size} "
             f"({time.perf_counter() - started:.1f} s); fastest of {len(candidates)} predicted:"]
    lines += [f"  {index + 1}. {candidate.describe()}" for index, candidate in enumerate(candidates[:_SHOWN])]
    lines.append(f"schedule='auto' chose {candidates[0].describe()}")
    log.info("\n".join(lines))
    return candidates[0], searched


def _budget(max_memory: float | None, device: torch.device) -> float | None:
    """Bytes of activations a rank may hold: ``max_memory`` as bytes, or as a fraction of the device's memory."""
    if max_memory is None or max_memory > 1:
        return max_memory
    if device.type != "cuda":
        raise PipelineConfigError(
            f"max_memory={max_memory} is a fraction of the device's memory, but a CPU has no memory of its own to "
            f"take a fraction of: give bytes (max_memory=8 * 2**30).")
    return max_memory * torch.cuda.get_device_properties(device).total_memory


def _measure_link(layout: PipelineLayout, rank: int, device: torch.device,
                  collective: Callable[[str], AbstractContextManager[None]]) -> tuple[float, float]:
    """A message's latency and seconds per byte between the first two ranks of the first pipeline (ping-pong of a
    small and a 4 MiB message, medians of 3); known to those two ranks, zeros elsewhere and with one rank."""
    if layout.num_stages == 1:
        return 0.0, 0.0
    first, second = layout.rank(0, 0), layout.rank(1, 0)
    if rank not in (first, second):
        return 0.0, 0.0
    peer = second if rank == first else first
    times = {}
    with collective("timing a message between the first two pipeline ranks (schedule='auto')"):
        for numel in (1, 2**20):
            message = torch.zeros(numel, dtype=torch.float32, device=device)
            rounds = []
            for _ in range(4):
                synchronize_device(device)
                started = time.perf_counter()
                if rank == first:
                    dist.send(message, peer)
                    dist.recv(message, peer)
                else:
                    dist.recv(message, peer)
                    dist.send(message, peer)
                synchronize_device(device)
                rounds.append((time.perf_counter() - started) / 2)
            times[numel] = statistics.median(rounds[1:])  # the first round sets the connection up
    latency = times[1]
    return latency, max(0.0, times[2**20] - latency) / (4 * 2**20)
