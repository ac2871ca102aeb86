"""``schedule="auto"`` against configurations chosen by hand, on a model whose first of 8 blocks is 8x slower: 2
processes on CPU (gloo), a batch of 32.

Run ``python benchmarks/autotune.py`` (``--steps``, ``--warmup``, ``--us-per-row``; about 2 minutes). Each block's
forward, input gradient and weight gradient each sleep ``--us-per-row`` microseconds per row of its micro-batch (the
first block 8 times as long), so the costs scale with the micro-batch as a GPU's do and the numbers are the
configuration's, not the machine's load. Each configuration trains ``L.Trainer(devices=2,
strategy=PipelineParallelStrategy(...))`` in 2 fresh processes (one CPU thread each); the step is the window from one
``on_train_batch_start`` to the next (the whole step: schedule, result exchange, optimizer, Lightning's loop), median
over the steps after ``--warmup``, min-max beside it. For ``"auto"`` the table also gives what it chose and the step it
predicted. Printed as markdown and written to ``benchmarks/results/autotune.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _workers import run_workers

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


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineParallelStrategy

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import SplitSleepLayer  # the test suite's: F, I and W each sleep (here per row)

    torch.set_num_threads(1)

    class SlowFirst(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            per_row = spec["us_per_row"] / 1e6
            self.blocks = nn.Sequential(*[SplitSleepLayer(per_row * (SLOWDOWN if i == 0 else 1), per_row=True)
                                          for i in range(BLOCKS)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.blocks(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            self.marks.append(time.perf_counter())

    steps = spec["warmup"] + spec["steps"] + 1  # the extra step's start ends the last timed one
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * steps, 4, generator=generator),
                         torch.randn(BATCH * steps, 4, generator=generator))
    clock = Clock()
    strategy = PipelineParallelStrategy(**spec["strategy"])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock])
    trainer.fit(SlowFirst(), DataLoader(data, batch_size=BATCH))
    windows = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)][spec["warmup"]:]
    choice = strategy.telemetry.auto_choice
    options = strategy.options
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
        spec = json.loads(args.worker)
        result = worker(spec)
        if int(__import__("os").environ["RANK"]) == 0:
            Path(spec["out"]).write_text(json.dumps(result))
        return
    rows = []
    for label, strategy in CONFIGS:
        spec = {"strategy": strategy, "steps": args.steps, "warmup": args.warmup, "us_per_row": args.us_per_row}
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
