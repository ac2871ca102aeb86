"""Step time by ``balance=`` on a model whose first block is 8x slower than the others: 2 processes on CPU (gloo),
1F1B, 8 micro-batches.

Run ``python benchmarks/balance.py`` (``--steps``, ``--warmup``, ``--base-ms``, ``--microbatches``). The model has 8
blocks; each block's forward and backward sleep ``--base-ms`` milliseconds (default 5), the first block's 8 times as
long, so the numbers are the schedule's and the split's, not the machine's load (the only real compute is a scalar
product per block). For each of ``balance="uniform"``, ``"params"`` (every block has one weight: the even split
again), the hand-made best split ``[1, 7]`` and ``"time"``, the LightningModule is trained by ``L.Trainer(devices=2,
strategy=PipelineParallelStrategy(schedule="1f1b", microbatches=8, balance=...))`` in 2 fresh processes (one CPU
thread each), launched the way torchrun would.

Reported per balance: the split (blocks per stage), the median step time on rank 0 (the window from one
``on_train_batch_start`` to the next, over the steps after ``--warmup``, with min-max), its ratio to the uniform
split's, and the set-up time (from the ``setup`` hook, before the strategy splits the module, to ``on_fit_start``),
which for ``"time"`` holds the measurement. The table is printed as markdown and written to
``benchmarks/results/balance.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _workers import answer_as_worker, run_workers  # beside this script

RESULTS = Path(__file__).resolve().parent / "results" / "balance.md"
BALANCES: list[str | list[int]] = ["uniform", "params", [1, 7], "time"]
BLOCKS = 8
SLOWDOWN = 8


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineParallelStrategy

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import SleepLayer  # the test suite's sleeping layer: forward and backward each sleep a fixed time

    torch.set_num_threads(1)

    class SlowFirst(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            base = spec["base_ms"] / 1e3
            seconds = [base * (SLOWDOWN if i == 0 else 1) for i in range(BLOCKS)]
            self.blocks = nn.Sequential(*[SleepLayer(s, s) for s in seconds])  # forward and backward sleep s

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.blocks(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.setup_started = self.fit_started = 0.0

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            self.setup_started = time.perf_counter()

        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.fit_started = time.perf_counter()

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            self.marks.append(time.perf_counter())

    steps = spec["warmup"] + spec["steps"] + 1  # the extra step's start ends the last timed one
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16 * steps, 4, generator=generator), torch.randn(16 * steps, 4,
                                                                                      generator=generator))
    clock = Clock()
    strategy = PipelineParallelStrategy(schedule="1f1b", microbatches=spec["microbatches"], balance=spec["balance"])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock])
    trainer.fit(SlowFirst(), DataLoader(data, batch_size=16))
    view = strategy.telemetry.view  # the split's stage view (its blocks per stage: ranges), set up by the fit
    assert view is not None
    windows = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)][spec["warmup"]:]
    return {"split": [len(r) for r in view.ranges], "steps_s": windows,  # type: ignore[attr-defined]
            "setup_s": clock.fit_started - clock.setup_started}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per balance")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out before the timed ones")
    parser.add_argument("--base-ms", type=float, default=5.0, help="sleep of a block's forward and of its backward")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    rows = []
    for balance in BALANCES:
        spec = {"balance": balance, "steps": args.steps, "warmup": args.warmup, "base_ms": args.base_ms,
                "microbatches": args.microbatches}
        result = run_workers(__file__, 2, spec, timeout=args.timeout)
        rows.append((balance, result))
        print(f"balance={balance!r}: split {result['split']}, median step "
              f"{1e3 * statistics.median(result['steps_s']):.0f} ms", flush=True)
    uniform = statistics.median(rows[0][1]["steps_s"])
    lines = [f"2 processes on CPU (gloo), 1F1B, {args.microbatches} micro-batches; {BLOCKS} blocks sleeping "
             f"{args.base_ms:g} ms in forward and in backward, the first {SLOWDOWN}x as long; median of {args.steps} "
             f"steps after {args.warmup}.", "",
             "| balance | split | median step ms (min-max) | ratio to uniform | set-up s |", "|---|---|---|---|---|"]
    for balance, result in rows:
        times = result["steps_s"]
        median = statistics.median(times)
        name = f"`{balance!r}`" if isinstance(balance, str) else f"`{balance}` (by hand)"
        lines.append(f"| {name} | {result['split']} | {1e3 * median:.0f} ({1e3 * min(times):.0f}-"
                     f"{1e3 * max(times):.0f}) | {median / uniform:.2f} | {result['setup_s']:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(table)


if __name__ == "__main__":
    main()
