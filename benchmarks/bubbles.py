"""Measured bubbles against theory: how close ``PipelineMonitor``'s bubble comes to the schedule's own on this machine.

Run ``python benchmarks/bubbles.py`` (about 4 minutes on 2 busy cores; ``--help`` for options). For each schedule
(``--schedules``, default GPipe, 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV) it launches ``--ranks`` processes
(default 4) on CPU (gloo, one thread each) and trains ``2 x ranks`` blocks whose forward, input gradient and weight
gradient each sleep ``--sleep-ms`` (default 50 ms; F = I = W, B = I + W: compute that costs no CPU) with
``--microbatches`` micro-batches (default 8), SGD, an MSE loss, ``PipelineMonitor`` timing every step. Interleaved 1F1B
and DualPipeV hold 2 stages (one block each) per rank, the others one stage of 2 blocks.

Per schedule, the medians over the steps after the warm-up of:

- **theory**: the simulator's bubble for the schedule with F = I = W = 1 (what the schedule promises: 1F1B's
  ``(p - 1) / (m + p - 1)``, interleaved ``(p - 1) / (2m + p - 1)``, ZB-H1 ``(p - 1) / (3m + p - 1)``, DualPipeV ZB-V's
  ``(p - 1) / (6m + p - 1)``);
- **predicted**: ``pipeline/predicted_bubble_fraction``, the simulator fed with the measured cost of every action
  (what the schedule gives with this machine's actual compute times, free transfers);
- **measured**: ``pipeline/bubble_fraction``, and measured minus theory.

The tests (tests/multi_process/test_monitor_multiprocess.py) check that each schedule runs as scheduled, which holds
however busy the machine; how close the measured bubble comes to theory is this benchmark's to say (under load it
drifts: a DualPipeV step once measured 0.110 against 0.059 on a busy CI machine). Printed as markdown and written to
``benchmarks/results/bubbles.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from _workers import answer_as_worker, mse_module, run_workers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "dualpipev")
WIDTH = 4


def _stages_per_rank(schedule: str) -> int | None:
    return 2 if schedule in ("interleaved_1f1b", "dualpipev") else None


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the sleeping blocks with ``spec["schedule"]`` on this process's rank; rank 0: the monitor's bubbles."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineMonitor, PipelineParallelStrategy

    sys.path.insert(0, str(ROOT / "tests"))
    from models import SplitSleepLayer  # the test suite's: forward, input and weight gradient each sleep alike

    torch.set_num_threads(1)
    ranks, microbatches = int(os.environ["WORLD_SIZE"]), spec["microbatches"]
    steps = spec["warmup"] + spec["steps"]
    batch = 2 * microbatches
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(batch * steps, WIDTH, generator=generator),
                         torch.randn(batch * steps, WIDTH, generator=generator))
    monitor = PipelineMonitor(logging_interval=1, timeline_every_n_steps=0)
    stages_per_rank = _stages_per_rank(spec["schedule"])
    strategy = PipelineParallelStrategy(schedule=spec["schedule"], microbatches=microbatches,
                                        **({"stages_per_rank": stages_per_rank} if stages_per_rank else {}))
    trainer = L.Trainer(accelerator="cpu", devices=ranks, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], strategy=strategy)
    blocks = nn.Sequential(*[SplitSleepLayer(spec["sleep_s"]) for _ in range(2 * ranks)])
    trainer.fit(mse_module(blocks), DataLoader(data, batch_size=batch))
    if not trainer.is_global_zero:  # the monitor's history is global rank 0's
        return {}
    history = monitor.history[spec["warmup"]:]
    return {key: statistics.median(row[f"pipeline/{key}"] for row in history)
            for key in ("bubble_fraction", "predicted_bubble_fraction", "step_ms")}


def theory(schedule: str, ranks: int, microbatches: int) -> float:
    """The simulator's bubble for ``schedule`` with F = I = W = 1 (B = I + W)."""
    from lightning_pp.schedule import build_schedule
    from lightning_pp.schedule.simulate import action_costs, simulate

    built = build_schedule(schedule, ranks, microbatches, stages_per_rank=_stages_per_rank(schedule))
    return simulate(built, action_costs()).bubble_fraction()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--ranks", type=int, default=4, help="processes (pipeline stages, or ranks of 2 stages)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="each of a block's F, I and W")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out before the timed ones")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    lines = [f"{args.ranks} CPU processes, {args.microbatches} micro-batches, {2 * args.ranks} blocks whose F, I and W "
             f"each sleep {args.sleep_ms:g} ms; medians of {args.steps} steps after {args.warmup}.", "",
             "| schedule | theory (F = I = W) | predicted from measured costs | measured | measured - theory "
             "| step ms |", "|---|---|---|---|---|---|"]
    for schedule in args.schedules:
        spec = {"schedule": schedule, "microbatches": args.microbatches, "sleep_s": args.sleep_ms / 1e3,
                "steps": args.steps, "warmup": args.warmup}
        result = run_workers(__file__, args.ranks, spec, timeout=900)
        expected = theory(schedule, args.ranks, args.microbatches)
        lines.append(f"| {schedule} | {expected:.3f} | {result['predicted_bubble_fraction']:.3f} | "
                     f"{result['bubble_fraction']:.3f} | {result['bubble_fraction'] - expected:+.3f} | "
                     f"{result['step_ms']:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bubbles.md").write_text(table)


if __name__ == "__main__":
    main()
