"""``schedule="pipedream_2bw"`` against 1F1B: the step and bubble on a model that only sleeps, the weights' memory,
and convergence on the GPT example.

Run ``python benchmarks/pipedream.py`` (about 2 minutes; ``--help``). Two parts, each schedule in 2 fresh processes on
CPU (gloo, one thread each):

- **Step and bubble.** 2 stages of one block whose forward sleeps 2 ms and backward 4 ms per micro-batch (F = I = W,
  B = I + W), 4 micro-batches, SGD: the whole step (one ``on_train_batch_start`` to the next), median over the steps
  after the warm-up; the share of the step a stage waits for a peer's activation or gradient (the monitor's
  ``comm_wait_ms`` over the step, mean over the stages: the fill and drain bubble); the idle share of the step
  (1 - a stage's forward and backward time over the step, mean over the stages: what a rank does not compute from
  one batch start to the next, the loop around the schedule included);
  ``PipelineMonitor``'s ``bubble_fraction`` (idle within the span from the step's first action on any rank to its
  last: the stream's steps overlap across ranks, which it counts as idle); and stage 0's ``param_memory_mb`` (with
  pipedream_2bw the older version it keeps too).
- **Convergence.** ``examples/train_gpt.py`` for ``--gpt-steps`` steps (default 400) with each schedule, same seed and
  data: the training loss the example logs every 10 steps, its last value and the mean of the last 10 logged values;
  the curves are drawn into ``benchmarks/results/pipedream_loss.png``.

Printed as markdown and written to ``benchmarks/results/pipedream.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _workers import batch_clock, mse_module, run_workers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("1f1b", "pipedream_2bw")
MICROBATCHES, BATCH, WIDTH = 4, 32, 64


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The sleep model trained with ``spec["schedule"]`` on this process's rank: step windows and monitor figures."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineMonitor, PipelineParallelStrategy

    sys.path.insert(0, str(ROOT / "tests"))
    from models import SleepLayer  # the test suite's: forward and backward each sleep a fixed time

    torch.set_num_threads(1)
    steps = spec["warmup"] + spec["steps"] + 1  # the extra step's start ends the last timed one
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(BATCH * steps, WIDTH, generator=generator),
                         torch.randn(BATCH * steps, WIDTH, generator=generator))
    clock, monitor = batch_clock(), PipelineMonitor(logging_interval=1, timeline_every_n_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, monitor],
                        strategy=PipelineParallelStrategy(schedule=spec["schedule"], microbatches=MICROBATCHES))
    blocks = nn.Sequential(*[SleepLayer(spec["forward_s"], 2 * spec["forward_s"]) for _ in range(2)])
    trainer.fit(mse_module(blocks), DataLoader(data, batch_size=BATCH))
    if not trainer.is_global_zero:  # the monitor's history is global rank 0's
        return {}
    windows = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)][spec["warmup"]:]
    history = monitor.history[spec["warmup"]:len(windows) + spec["warmup"]]
    # idle share of each stage over the whole step (one batch start to the next), mean over the stages
    idle = [1 - statistics.mean(1e-3 * (row[f"pipeline/stage{s}/forward_ms"] + row[f"pipeline/stage{s}/backward_ms"])
                                for s in range(2)) / window for row, window in zip(history, windows, strict=True)]
    # the share of the step a stage waits for a peer's activation or gradient: the fill and drain bubble
    waiting = [statistics.mean(1e-3 * row[f"pipeline/stage{s}/comm_wait_ms"] for s in range(2)) / window
               for row, window in zip(history, windows, strict=True)]
    params = [row["pipeline/stage0/param_memory_mb"] for row in history]
    return {"steps_s": windows, "bubble": statistics.median(row["pipeline/bubble_fraction"] for row in history),
            "idle": statistics.median(idle), "waiting": statistics.median(waiting), "param_mb": max(params)}


def gpt_losses(schedule: str, steps: int, log_dir: Path) -> list[tuple[int, float]]:
    """Train the example with ``schedule``; the training loss it logged (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--schedule", schedule, "--max-steps",
               str(steps), "--sample-every", "0", "--log-dir", str(log_dir)]
    subprocess.run(command, check=True, cwd=ROOT, timeout=3600, stdout=subprocess.DEVNULL)
    events = EventAccumulator(str(next((log_dir / "gpt_pipeline").glob("version_*"))))
    events.Reload()
    return [(int(e.step), float(e.value)) for e in events.Scalars("train_loss")]


def draw(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for schedule, points in curves.items():
        axes.plot([s for s, _ in points], [v for _, v in points], label=schedule)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_yscale("log")
    axes.set_title("examples/train_gpt.py: 1F1B against PipeDream-2BW (same seed and data)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps of the sleep model per schedule")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out before the timed ones")
    parser.add_argument("--forward-ms", type=float, default=2.0, help="a block's forward (its backward: twice that)")
    parser.add_argument("--gpt-steps", type=int, default=400, help="steps of the example per schedule (0: skip)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        result = worker(spec)
        if int(os.environ["RANK"]) == 0:
            Path(spec["out"]).write_text(json.dumps(result))
        return
    timed = {}
    for schedule in SCHEDULES:
        spec = {"schedule": schedule, "steps": args.steps, "warmup": args.warmup, "forward_s": args.forward_ms / 1e3}
        timed[schedule] = run_workers(__file__, 2, spec, timeout=900)
    base = statistics.median(timed["1f1b"]["steps_s"])
    lines = [f"Sleep model: 2 stages, F = {args.forward_ms:g} ms, B = {2 * args.forward_ms:g} ms, {MICROBATCHES} "
             f"micro-batches, 2 CPU processes; whole step median of {args.steps} after {args.warmup}.", "",
             "| schedule | median step ms (min-max) | speed-up over 1F1B | waiting for a peer | idle share of the step "
             "| bubble within the step's span (monitor) | stage 0 weights bytes |",
             "|---|---|---|---|---|---|---|"]
    for schedule, result in timed.items():
        times = result["steps_s"]
        median = statistics.median(times)
        lines.append(f"| {schedule} | {1e3 * median:.2f} ({1e3 * min(times):.2f}-{1e3 * max(times):.2f}) | "
                     f"{base / median:.3f} | {result['waiting']:.3f} | {result['idle']:.3f} | {result['bubble']:.3f} | "
                     f"{round(result['param_mb'] * 2**20)} |")
    if args.gpt_steps:
        curves = {}
        with tempfile.TemporaryDirectory() as tmp:
            for schedule in SCHEDULES:
                curves[schedule] = gpt_losses(schedule, args.gpt_steps, Path(tmp, schedule))
        lines += ["", f"GPT example, {args.gpt_steps} steps (training loss logged every 10 steps):", "",
                  "| schedule | loss at step 9 | last logged loss | mean of the last 10 logged "
                  "| ratio to 1F1B (mean) |",
                  "|---|---|---|---|---|"]
        mean_1f1b = statistics.mean(v for _, v in curves["1f1b"][-10:])
        for schedule, points in curves.items():
            mean = statistics.mean(v for _, v in points[-10:])
            lines.append(f"| {schedule} | {points[0][1]:.3f} | {points[-1][1]:.3f} | {mean:.3f} | "
                         f"{mean / mean_1f1b:.3f} |")
        RESULTS.mkdir(exist_ok=True)
        draw(curves, RESULTS / "pipedream_loss.png")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipedream.md").write_text(table)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
