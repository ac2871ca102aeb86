"""``schedule="pipedream_2bw"`` against 1F1B: the step and bubble on a model that only sleeps, the weights' memory,
and convergence on the GPT example.

Run ``python benchmarks/pipedream.py`` (about 5 minutes; ``--help``). Each schedule runs in 2 fresh processes on CPU
(gloo, one thread each):

- **Step and bubble.** 2 stages of one block whose forward sleeps 2 ms and backward 4 ms per micro-batch (F = I = W,
  B = I + W), 4 micro-batches, SGD: the whole step (one ``on_train_batch_start`` to the next), median over the steps
  after the warm-up; the share of the step a stage waits for a peer's activation or gradient (the monitor's
  ``comm_wait_ms`` over the step, mean over the stages: the fill and drain bubble); the idle share of the step
  (1 - a stage's forward and backward time over the step, mean over the stages: what a rank does not compute from
  one batch start to the next, the loop around the schedule included);
  ``PipelineMonitor``'s ``bubble_fraction`` (idle within the span from the step's first action on any rank to its
  last: the stream's steps overlap across ranks, which it counts as idle); and stage 0's ``param_memory_mb`` (with
  pipedream_2bw the older version it keeps too). The monitor times every step (its timings travel to rank 0
  without a barrier between the ranks).
- **Convergence.** ``examples/train_gpt.py`` for ``--gpt-steps`` steps (default 400) with each schedule and each of its
  optimizers (``--optimizer adamw``, ``muon``), same seed and data: the training loss the example logs every 10 steps,
  its last value and the mean of the last 10 logged values; the curves are drawn into
  ``benchmarks/results/pipedream_loss.png``. With them each stage's weights and optimizer state (the monitor's
  ``param_memory_mb`` and ``optimizer_state_mb``).
- **The rule on one device** (``--recipes``, 6 minutes more): the example's model without a pipeline, each step
  applying its own gradient against the previous batch's (the rule ``pipedream_2bw`` is tested to follow), for a few
  recipes (optimizer, learning rate, initialization, warm-up, clipping, Adam's betas): whether a gap is the rule's
  or ours.

Printed as markdown and written to ``benchmarks/results/pipedream.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _workers import answer_as_worker, batch_clock, launch_processes, mse_module, run_workers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = ("1f1b", "pipedream_2bw")
OPTIMIZERS = ("adamw", "muon")  # the example's --optimizer
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


def gpt_run(schedule: str, optimizer: str, steps: int, log_dir: Path) -> dict[str, Any]:
    """Train the example with ``schedule`` and ``optimizer`` on its 2 processes (started as torchrun would: the
    example's ``--devices 2``): the training loss it logged (step, value) and, per stage, the monitor's last
    ``param_memory_mb`` and ``optimizer_state_mb``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--schedule", schedule, "--optimizer",
               optimizer, "--max-steps", str(steps), "--sample-every", "0", "--log-dir", str(log_dir), "--devices", "2"]
    job = launch_processes(command, 2, timeout=3600)
    if job.timed_out or any(job.returncodes):
        raise SystemExit(f"train_gpt.py --schedule {schedule} --optimizer {optimizer} failed: exit codes "
                         f"{job.returncodes}" + "".join(f"\n--- rank {rank} ---\n{output[-3000:]}"
                                                         for rank, output in enumerate(job.outputs)))
    events = EventAccumulator(str(next((log_dir / "gpt_pipeline").glob("version_*"))), size_guidance={"scalars": 0})
    events.Reload()
    memory = {key: [events.Scalars(f"pipeline/stage{stage}/{key}")[-1].value for stage in range(2)]
              for key in ("param_memory_mb", "optimizer_state_mb")}
    return {"losses": [(int(e.step), float(e.value)) for e in events.Scalars("train_loss")], **memory}


# recipes of the example's model for --recipes: its optimizer ("adamw" or "muon": Muon for the blocks' matrices, AdamW
# for the rest) and learning rate, init ("example": PyTorch's defaults, unit-variance embeddings tied to the head;
# "gpt2": normal(0, 0.02), biases 0), linear warm-up steps before the cosine decay, gradient clipping by norm, AdamW's
# betas
EXAMPLE = {"optimizer": "adamw", "lr": 3e-3, "init": "example", "warmup": 0, "clip": None, "betas": (0.9, 0.999)}
RECIPES = {
    "AdamW lr 3e-3 (the example's)": EXAMPLE,
    "AdamW lr 1e-3": {**EXAMPLE, "lr": 1e-3},
    "AdamW, clip 1": {**EXAMPLE, "clip": 1.0},
    "AdamW, GPT-2 init": {**EXAMPLE, "init": "gpt2"},
    "AdamW, GPT-2 init, warm-up 40, clip 1, betas (0.9, 0.95)": {**EXAMPLE, "init": "gpt2", "warmup": 40,
                                                                "clip": 1.0, "betas": (0.9, 0.95)},
    "Muon lr 3e-3": {**EXAMPLE, "optimizer": "muon"},
    "Muon lr 5e-3": {**EXAMPLE, "optimizer": "muon", "lr": 5e-3},
    "Muon lr 1e-2 (the example's --optimizer muon)": {**EXAMPLE, "optimizer": "muon", "lr": 1e-2},
    "Muon lr 2e-2": {**EXAMPLE, "optimizer": "muon", "lr": 2e-2},
    "Muon lr 1e-2, GPT-2 init": {**EXAMPLE, "optimizer": "muon", "lr": 1e-2, "init": "gpt2"},
}


def rule_losses(recipe: dict[str, Any], delayed: bool, steps: int) -> list[float]:
    """The example's model on one device (no pipeline) with ``recipe``: every step's training loss, each step applying
    its own gradient or, with ``delayed``, the previous batch's (PipeDream-2BW's rule: the test suite's
    ``DelayedGradients``, against which ``pipedream_2bw`` is tested to agree)."""
    import math

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    sys.path[:0] = [path for path in (str(ROOT / "examples"), str(ROOT / "tests")) if path not in sys.path]
    import train_gpt
    from models import DelayedGradients

    class Recipe(train_gpt.GPT):
        def configure_optimizers(self) -> Any:
            if recipe["optimizer"] == "muon" or (recipe["betas"], recipe["warmup"]) == (EXAMPLE["betas"], 0):
                return super().configure_optimizers()  # the example's own
            optimizer = torch.optim.AdamW(self.parameters(), lr=recipe["lr"], betas=recipe["betas"], weight_decay=0.01)
            warmup = recipe["warmup"]

            def factor(step: int) -> float:
                return (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / steps))

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    dataset = train_gpt.CharDataset(train_gpt.make_corpus(), block_size=32)
    model = Recipe(vocab_size=len(dataset.chars), optimizer=recipe["optimizer"], lr=recipe["lr"])
    losses: list[float] = []
    if recipe["init"] == "gpt2":
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=recipe["clip"],
                        callbacks=[DelayedGradients()] if delayed else [])
    trainer.fit(model, DataLoader(dataset, batch_size=16, shuffle=True))
    return losses


def recipe_table(steps: int) -> list[str]:
    """The rule on one device against plain steps, per recipe: the mean training loss of the last 100 steps."""
    lines = [f"The update rule on one device, the example's model, {steps} steps: mean training loss of the last 100 "
             "steps", "", "| recipe | plain steps | one step's delay (2BW's rule) | ratio |", "|---|---|---|---|"]
    for name, recipe in RECIPES.items():
        plain, delayed = (statistics.mean(rule_losses(recipe, delay, steps)[-100:]) for delay in (False, True))
        lines.append(f"| {name} | {plain:.3f} | {delayed:.3f} | {delayed / plain:.3f} |")
    return lines


def draw(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        axes.plot([s for s, _ in points], [v for _, v in points], label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_yscale("log")
    axes.set_title("examples/train_gpt.py: 1F1B against PipeDream-2BW (same seed and data)", fontsize=10)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of the sleep model per schedule")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out before the timed ones")
    parser.add_argument("--forward-ms", type=float, default=2.0, help="a block's forward (its backward: twice that)")
    parser.add_argument("--gpt-steps", type=int, default=400, help="steps of the example per schedule (0: skip)")
    parser.add_argument("--recipes", action="store_true",
                        help="also the update rule on one device against plain steps for a few recipes of the example")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        answer_as_worker(args.worker, worker)
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
        with tempfile.TemporaryDirectory() as tmp:
            runs = {(optimizer, schedule): gpt_run(schedule, optimizer, args.gpt_steps, Path(tmp, optimizer, schedule))
                    for optimizer in OPTIMIZERS for schedule in SCHEDULES}
        lines += ["", f"GPT example, {args.gpt_steps} steps (training loss logged every 10 steps; memory: the "
                  "monitor's last logged MiB per stage):", "",
                  "| optimizer | schedule | loss at step 9 | last logged loss | mean of the last 10 logged "
                  "| ratio to 1F1B (mean) | weights MiB (stage 0, 1) | optimizer state MiB (stage 0, 1) |",
                  "|---|---|---|---|---|---|---|---|"]
        for (optimizer, schedule), run in runs.items():
            points = run["losses"]
            mean = statistics.mean(v for _, v in points[-10:])
            mean_1f1b = statistics.mean(v for _, v in runs[optimizer, "1f1b"]["losses"][-10:])
            weights, state = (", ".join(f"{mb:.3f}" for mb in run[key]) for key in ("param_memory_mb",
                                                                                    "optimizer_state_mb"))
            lines.append(f"| {optimizer} | {schedule} | {points[0][1]:.3f} | {points[-1][1]:.3f} | {mean:.3f} | "
                         f"{mean / mean_1f1b:.3f} | {weights} | {state} |")
        RESULTS.mkdir(exist_ok=True)
        draw({f"{schedule}, {optimizer}": run["losses"] for (optimizer, schedule), run in runs.items()},
             RESULTS / "pipedream_loss.png")
    if args.recipes:
        lines += ["", *recipe_table(args.gpt_steps or 400)]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipedream.md").write_text(table)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
