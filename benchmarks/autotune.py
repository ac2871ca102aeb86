"""``schedule="auto"`` against configurations chosen by hand, on four model shapes it was not built on: 2 processes on
CPU (gloo), a batch of 32, 8 blocks.

Run ``python benchmarks/autotune.py`` (``--models``, ``--steps``, ``--us-per-row``; about 15 minutes on 2 cores).
The models (every cost grows with the rows of a micro-batch, as a GPU's does, and sleeps, so that the numbers are the
configuration's, not the machine's load):

- ``uniform``: 8 equal blocks whose forward, input gradient and weight gradient each sleep ``--us-per-row`` per row;
- ``slow first``: 8 blocks of a Linear and a custom autograd function (forward 1x, backward 2x ``--us-per-row`` per
  row, in one backward: nothing to split), the first 8 times as slow;
- ``heavy head``: the uniform blocks, and after them a head as costly as 4 of them (in ``training_step``);
- ``tight max_memory``: 8 blocks of width 1024 (their batch saves about 1 MiB), ``schedule="auto"`` given a
  ``max_memory`` of 0.4 MiB, which rules out its choice without one and ZB-H1 at 8 micro-batches.

Per model, in one run: the hand default (1F1B, 4 micro-batches, an even split), a grid of hand configurations
(schedules, micro-batch counts, ``balance="time"``; for the tight model the 1F1B-like ones, which hold the fewest
micro-batches, its best taken among those whose activations, measured by ``PipelineMonitor``, fit ``max_memory``),
and ``schedule="auto"``: its choice, its prediction and the measured step. Each configuration trains
``L.Trainer(devices=2, strategy=PipelineParallelStrategy(...))`` in 2 fresh processes (one CPU thread each); the step
is the window from one ``on_train_batch_start`` to the next (the whole step: schedule, result exchange, optimizer,
Lightning's loop), median over the steps after the closed loop's decision (step 5). Printed as markdown and written to
``benchmarks/results/autotune.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from _workers import answer_as_worker, batch_clock, run_workers

RESULTS = Path(__file__).resolve().parent / "results" / "autotune.md"
BLOCKS, BATCH, RANKS = 8, 32, 2
WARMUP = 6  # steps left out: the closed loop decides at the start of step 5
MODELS = ("uniform", "slow first", "heavy head", "tight max_memory")
TIGHT_BYTES = 0.4 * 2**20  # max_memory of the tight model: the hand default holds 0.31 MiB at once, ZB-H1 0.52
DEFAULT = {"schedule": "1f1b", "microbatches": 4}
GRID: list[dict[str, Any]] = [
    {"schedule": "1f1b", "microbatches": 4, "balance": "time"},
    {"schedule": "1f1b", "microbatches": 8, "balance": "time"},
    {"schedule": "1f1b", "microbatches": 16, "balance": "time"},
    {"schedule": "zb_h1", "microbatches": 8, "balance": "time"},
    {"schedule": "gpipe", "microbatches": 8, "balance": "time"},
    {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 8, "balance": "time"},
    {"schedule": "zbv", "microbatches": 8, "balance": "time"},
]
LOW_MEMORY = ("1f1b", "zb_h1")  # hold at most as many micro-batches as ranks: the grid of the tight model


def build(model: str, us_per_row: float) -> Any:
    """The LightningModule of ``model`` (see the module docstring)."""
    import lightning as L
    import torch
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from models import _Sleep as Rows  # identity whose forward and backward sleep the seconds given

    per_row = us_per_row / 1e6

    class Split(nn.Module):
        """F, I and W each sleep ``seconds`` per row: the weight's path joins the input's at the sum."""

        def __init__(self, seconds: float, width: int = 16) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)
            self.scale = nn.Parameter(torch.zeros(()))
            self.seconds = seconds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.seconds * x.shape[0]
            return Rows.apply(self.linear(x), s, s) + Rows.apply(self.scale, 0.0, s)

    class LinearThenFunction(nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.linear, self.seconds = nn.Linear(16, 16), seconds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.seconds * x.shape[0]
            return Rows.apply(self.linear(x), s, 2 * s)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if model == "slow first":
                self.blocks = nn.Sequential(*[LinearThenFunction(per_row * (8 if i == 0 else 1))
                                              for i in range(BLOCKS)])
            else:
                self.blocks = nn.Sequential(*[Split(per_row, width(model)) for _ in range(BLOCKS)])
            self.head = Split(4 * per_row) if model == "heavy head" else nn.Identity()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.blocks(x)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Model()


def width(model: str) -> int:
    return 1024 if model == "tight max_memory" else 16


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineMonitor, PipelineParallelStrategy

    torch.set_num_threads(1)
    steps = WARMUP + spec["steps"] + 1  # the extra step's start ends the last timed one
    generator = torch.Generator().manual_seed(0)
    features = width(spec["model"])
    data = TensorDataset(torch.randn(BATCH * steps, features, generator=generator),
                         torch.randn(BATCH * steps, features, generator=generator))
    clock = batch_clock()
    strategy = PipelineParallelStrategy(**spec["strategy"])
    # the tight model: activations held at once, measured at steps 0 and WARMUP (one of the timed steps)
    monitor = PipelineMonitor(logging_interval=WARMUP, timeline_every_n_steps=0) if spec["meter"] else None
    trainer = L.Trainer(accelerator="cpu", devices=RANKS, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock] + ([monitor] if monitor else []))
    trainer.fit(build(spec["model"], spec["us_per_row"]), DataLoader(data, batch_size=BATCH))
    windows = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)][WARMUP:]
    telemetry, options = strategy.telemetry, strategy.resolved_options
    peak = None
    if monitor is not None and monitor.history:  # per rank: the sum of its stages' peaks
        ranks = telemetry.last_schedule.stage_to_rank
        last = monitor.history[-1]
        peak = max(sum(last[f"pipeline/stage{s}/peak_memory_mb"] for s, r in enumerate(ranks) if r == rank)
                   for rank in set(ranks)) * 2**20
    return {"steps_s": windows, "config": f"{options.schedule} m={options.microbatches}"
            + (f" v={options.stages_per_rank}" if (options.stages_per_rank or 1) > 1 else "")
            + f" split={options.balance}",
            "first": telemetry.auto_first_choice.describe() if telemetry.auto_first_choice else None,
            "first_s": telemetry.auto_first_choice.step_s if telemetry.auto_first_choice else None,
            "chosen": telemetry.auto_choice.describe() if telemetry.auto_choice else None,
            "predicted_s": telemetry.auto_choice.step_s if telemetry.auto_choice else None,
            "loop_measured_s": telemetry.auto_measured_step_s, "peak_bytes": peak}


def label(strategy: dict[str, Any]) -> str:
    extra = f" v={strategy['stages_per_rank']}" if "stages_per_rank" in strategy else ""
    balance = " balance='time'" if strategy.get("balance") == "time" else ""
    return f"{strategy['schedule']}{extra} m={strategy['microbatches']}{balance}"


def run(model: str, strategy: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    spec = {"model": model, "strategy": strategy, "steps": args.steps, "us_per_row": args.us_per_row,
            "meter": model == "tight max_memory"}
    result = run_workers(__file__, RANKS, spec, timeout=900)
    result["median_s"] = statistics.median(result["steps_s"])
    peak = f", peak activations {result['peak_bytes'] / 2**20:.2f} MiB" if result["peak_bytes"] is not None else ""
    print(f"{model}: {label(strategy) if strategy['schedule'] != 'auto' else 'auto'} ran {result['config']}, "
          f"median step {1e3 * result['median_s']:.1f} ms{peak}", flush=True)
    return result


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    tight = model == "tight max_memory"
    grid = [c for c in GRID if not tight or c["schedule"] in LOW_MEMORY]
    default = run(model, DEFAULT, args)
    hand = [(label(c), run(model, c, args)) for c in grid]
    auto = run(model, {"schedule": "auto", **({"max_memory": TIGHT_BYTES} if tight else {})}, args)
    # the tight model's grid: the hand configurations whose measured activations fit max_memory
    fitting = [(name, r) for name, r in [*hand, ("hand default", default)]
               if r["peak_bytes"] is None or r["peak_bytes"] <= TIGHT_BYTES]
    best_label, best = min(fitting or [("hand default", default)], key=lambda item: item[1]["median_s"])
    return {"default": default, "hand": hand, "best_label": best_label, "best": best, "auto": auto}


def table(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{RANKS} processes on CPU (gloo), batch {BATCH}, {BLOCKS} blocks, {args.us_per_row:g} us per row; whole "
             f"step (batch start to batch start), median of {args.steps} after {WARMUP}. Auto's prediction: before "
             f"the first step, and its closed loop's (from the costs it measured over steps 1-4, where the first "
             f"missed by more than 25 %).", "",
             "| model | hand default ms | grid's best (ms) | auto ran | predicted ms (off) | closed loop | "
             "measured ms | auto / default | auto / grid's best |", "|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for model, row in rows.items():
        auto, default, best = row["auto"], row["default"]["median_s"], row["best"]["median_s"]
        measured = auto["median_s"]

        def off(predicted: float, measured: float = measured) -> str:
            return f"{1e3 * predicted:.1f} ({100 * (predicted / measured - 1):+.0f} %)"

        if auto["loop_measured_s"] is None:
            loop = "did not decide"
        else:
            loop = f"step measured {1e3 * auto['loop_measured_s']:.1f} ms"
            if auto["predicted_s"] != auto["first_s"]:
                switched = auto["first"].split(":")[0] != auto["chosen"].split(":")[0]
                loop += f"; re-predicted {off(auto['predicted_s'])}; " + ("switched" if switched else "kept")
        lines.append(f"| {model} | {1e3 * default:.1f} | {row['best_label']} ({1e3 * best:.1f}) | {auto['config']} | "
                     f"{off(auto['first_s']) if auto['first_s'] else ''} | {loop} | {1e3 * measured:.1f} | "
                     f"{measured / default:.2f} | {measured / best:.2f} |")
        if row["default"]["peak_bytes"] is not None:
            peaks = ", ".join(f"{name} {r['peak_bytes'] / 2**20:.2f}" for name, r in [
                ("hand default", row["default"]), *row["hand"], ("auto", auto)])
            notes.append(f"{model}: activations held at once per rank, MiB (max_memory {TIGHT_BYTES / 2**20:g}): "
                         f"{peaks}.")
    return "\n".join([*lines, "", *notes]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--us-per-row", type=float, default=150.0, help="sleep per row of a block's F, I and W")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    rows = {model: measure(model, args) for model in args.models}
    text = table(rows, args)
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
