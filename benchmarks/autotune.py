"""``schedule="auto"`` against configurations chosen by hand, on a model whose first of 8 blocks is 8x slower: 2
processes on CPU (gloo), a batch of 32.

Run ``python benchmarks/autotune.py`` (``--steps``, ``--warmup``, ``--us-per-row``; about 2 minutes). Each block's
forward, input gradient and weight gradient each sleep ``--us-per-row`` microseconds per row of its micro-batch (the
first block 8 times as long), so the costs scale with the micro-batch as a GPU's do and the numbers are the
configuration's, not the machine's load. Each configuration trains ``L.Trainer(devices=2,
strategy=PipelineParallelStrategy(...))`` in 2 fresh processes (one CPU thread each); the step is the window from one
``on_train_batch_start`` to the next (the whole step: schedule, result exchange, optimizer, Lightning's loop), median
over the steps after ``--warmup``, min-max beside it. For ``"auto"`` the table also gives what it chose and the step it
predicted. Last, torch.distributed.pipelining's ``Schedule1F1B`` in a plain loop (next batch, ``schedule.step``, the
optimizer) on the same blocks, split evenly and as the hand-found [1, 7], timed by the same window (its loop's start
to the next). Printed as markdown and written to ``benchmarks/results/autotune.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from _workers import answer_as_worker, batch_clock, mse_module, run_workers

RESULTS = Path(__file__).resolve().parent / "results" / "autotune.md"
BLOCKS, SLOWDOWN, BATCH = 8, 8, 32
# (label, strategy arguments): the hand default first, then the best configurations found by hand, then auto
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("hand default", {"schedule": "1f1b", "microbatches": 4}),
    ("balance='time'", {"schedule": "1f1b", "microbatches": 4, "balance": "time"}),
    ("1f1b, 8 micro-batches, balance='time'", {"schedule": "1f1b", "microbatches": 8, "balance": "time"}),
    ("zb_h1, balance='time'", {"schedule": "zb_h1", "microbatches": 4, "balance": "time"}),
    ("zbv", {"schedule": "zbv", "microbatches": 4}),
    ("auto", {"schedule": "auto"}),
]
# torch.distributed.pipelining in a plain loop on the same blocks: (label, schedule, micro-batches, blocks per rank)
TORCH_CONFIGS = [("torch.distributed.pipelining, the hand default", "1f1b", 4, [4, 4]),
                 ("torch.distributed.pipelining, split [1, 7] by hand", "1f1b", 4, [1, 7])]


def blocks(us_per_row: float) -> Any:
    """The model's blocks: the test suite's SplitSleepLayer (F, I and W each sleep, here per row), the first slower."""
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import SplitSleepLayer

    per_row = us_per_row / 1e6
    return nn.Sequential(*[SplitSleepLayer(per_row * (SLOWDOWN if i == 0 else 1), per_row=True) for i in range(BLOCKS)])


def batches(steps: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH * steps, 4, generator=generator), torch.randn(BATCH * steps, 4, generator=generator)


def torch_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.pipelining's Schedule1F1B in a plain loop (next batch, step, optimizer), timed the same way."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first, count = sum(spec["split"][:rank]), spec["split"][rank]
    part = blocks(spec["us_per_row"])[first:first + count]
    stage = PipelineStage(part, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=spec["microbatches"], loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01)
    steps = spec["warmup"] + spec["steps"] + 1
    xs, ys = batches(steps)
    marks = []
    for step in range(steps):
        marks.append(time.perf_counter())
        x, y = xs[step * BATCH:(step + 1) * BATCH], ys[step * BATCH:(step + 1) * BATCH]
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    dist.destroy_process_group()
    windows = [b - a for a, b in pairwise(marks)][spec["warmup"]:]
    return {"steps_s": windows, "chosen": None, "predicted_s": None,
            "config": f"{spec['schedule']} m={spec['microbatches']} split={spec['split']}"}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineParallelStrategy

    if spec.get("runner") == "torch":
        return torch_worker(spec)
    torch.set_num_threads(1)
    steps = spec["warmup"] + spec["steps"] + 1  # the extra step's start ends the last timed one
    data = TensorDataset(*batches(steps))
    clock = batch_clock()
    strategy = PipelineParallelStrategy(**spec["strategy"])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock])
    trainer.fit(mse_module(blocks(spec["us_per_row"])), DataLoader(data, batch_size=BATCH))
    windows = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)][spec["warmup"]:]
    choice = strategy.telemetry.auto_choice
    options = strategy.resolved_options
    return {"steps_s": windows, "chosen": choice.describe() if choice is not None else None,
            "predicted_s": choice.step_s if choice is not None else None,
            "config": f"{options.schedule} m={options.microbatches} balance={options.balance}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out before the timed ones")
    parser.add_argument("--us-per-row", type=float, default=150.0, help="sleep per row of a block's F, I and W")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    rows = []
    specs = [(label, {"strategy": strategy}) for label, strategy in CONFIGS]
    specs += [(label, {"runner": "torch", "schedule": name, "microbatches": m, "split": split})
              for label, name, m, split in TORCH_CONFIGS]
    for label, config in specs:
        spec = {**config, "steps": args.steps, "warmup": args.warmup, "us_per_row": args.us_per_row}
        result = run_workers(__file__, 2, spec, timeout=900)
        rows.append((label, result))
        print(f"{label}: {result['config']}, median step {1e3 * statistics.median(result['steps_s']):.1f} ms",
              flush=True)
    default = statistics.median(rows[0][1]["steps_s"])
    lines = [f"2 processes on CPU (gloo), batch {BATCH}; {BLOCKS} blocks whose forward, input gradient and weight "
             f"gradient each sleep {args.us_per_row:g} us per row, the first {SLOWDOWN}x as long; whole step (batch "
             f"start to batch start), median of {args.steps} after {args.warmup}.", "",
             "| configuration | runs | median step ms (min-max) | ratio to the hand default | predicted ms |",
             "|---|---|---|---|---|"]
    for label, result in rows:
        times = result["steps_s"]
        median = statistics.median(times)
        predicted = f"{1e3 * result['predicted_s']:.1f}" if result["predicted_s"] is not None else ""
        runs = result["chosen"] or result["config"]
        lines.append(f"| {label} | {runs} | {1e3 * median:.1f} ({1e3 * min(times):.1f}-{1e3 * max(times):.1f}) | "
                     f"{median / default:.2f} | {predicted} |")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(table)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
