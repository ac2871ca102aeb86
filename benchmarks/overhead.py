"""Framework time per action: what lightning_pp and torch.distributed.pipelining add on top of the compute.

Run ``python benchmarks/overhead.py`` (about 2 minutes; ``--help`` for options). On CPU (gloo) it launches ``p``
processes (default 2) per runner and trains, for every schedule (``--schedules``, default GPipe and 1F1B) and
model (``--models``):

- ``sleep``: one block per stage whose forward sleeps 2 ms and whose backward sleeps 4 ms (``--sleep-ms``) on a
  micro-batch of 8 x 64 floats. Compute then costs no CPU, so whatever else the step takes is the framework's
  (and the transfers', which for 2 KiB tensors are a few tens of microseconds).
- ``mlp``: 8 blocks ``Linear(512, 512) + GELU``, batch 128, as in ``benchmarks/compare.py``.

with each count of ``--microbatches`` micro-batches (default 4), SGD, an MSE loss, in two runners: **lightning_pp**
(the Lightning Trainer with ``PipelineParallelStrategy``) and **torch.distributed.pipelining** (``PipelineStage`` +
``ScheduleGPipe`` / ``Schedule1F1B`` in a plain loop: next batch, ``schedule.step``, ``optimizer.step``,
``zero_grad``).

Every block of both runners is wrapped in the same pair of markers, autograd functions that read the clock when the
block's forward starts and ends and when its backward starts and ends, so both runners' compute is measured the same
way, by the blocks themselves. Per step and stage:

- **window**: wall time on that rank from the start of one step to the start of the next (the benchmark window of
  ``compare.py``: loading the batch, the schedule, the optimizer, the loop's or Lightning's work between steps).
- **predicted**: the simulator's step time for the schedule, fed that step's measured compute (each stage's forward
  and backward time per micro-batch) and free transfers: what a framework costing nothing would take.
- **framework time per action**: ``(window - predicted) / (2 m)``, over the stage's ``2 m`` compute actions (``m``
  forwards, ``m`` backwards): everything beyond compute and the schedule's own bubble (the transfers, the runtime's
  Python, the result exchange, the optimizer step and the loop around it), per compute action. Reported: the median
  over steps after the warm-up. Both runners are timed by this one definition.
- **idle per action**: the issue's measure of the framework, the gaps between a stage's timed intervals from its
  first to its last, divided by its ``2 m`` compute actions; median over a separate run of ``--monitor-steps``
  steps. lightning_pp: ``pipeline/stage{s}/framework_us_per_action`` of ``PipelineMonitor`` (the runtime's own
  overhead between its actions), and that run's ``step_ms`` against the simulator's step from the monitor's measured
  action costs. torch.distributed.pipelining, timed the same way by wrapping its calls: every forward chunk (with the
  last stage's loss), backward chunk, posting of P2P operations and wait for them is an interval.

``--profile DIR`` also runs every timed step of the pipelined runners under cProfile and writes one ``.prof`` file
and a text summary (top functions by own and cumulative time) per rank into ``DIR``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))
import compare  # the launcher and the machine description

RUNNERS = {"torch": "torch.distributed.pipelining", "lightning": "lightning_pp"}
SLEEP_WIDTH, SLEEP_BATCH = 64, 32
MLP_HIDDEN, MLP_BATCH, MLP_BLOCKS = 512, 128, 8
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# (kind "F" or "B", seconds) of every block pass in this process, in order
_RECORDS: list[tuple[str, float]] = []


def make_blocks(run: dict[str, Any]) -> Any:
    """The model's blocks, each wrapped in the timing markers."""
    import torch
    from models import SleepLayer  # the test suite's sleeping layer (tests/ is on the path)
    from torch import nn

    class Enter(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, block: Any) -> torch.Tensor:
            ctx.block = block
            block.forward_started = time.perf_counter()
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            _RECORDS.append(("B", time.perf_counter() - ctx.block.backward_started))
            return grad, None, None

    class Exit(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, block: Any) -> torch.Tensor:
            ctx.block = block
            _RECORDS.append(("F", time.perf_counter() - block.forward_started))
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            ctx.block.backward_started = time.perf_counter()
            return grad, None

    class Timed(nn.Module):
        """A block whose passes are timed by itself (the markers' backward runs also on the first stage, whose input
        needs no gradient: the anchor does)."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.anchor = torch.zeros((), requires_grad=True)  # not a parameter: no gradient, no optimizer
            self.forward_started = self.backward_started = 0.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Exit.apply(self.inner(Enter.apply(x, self.anchor, self)), self)

    torch.manual_seed(0)
    if run["model"] == "sleep":
        forward_s, backward_s = run["sleep_ms"][0] / 1e3, run["sleep_ms"][1] / 1e3
        return nn.Sequential(*[Timed(SleepLayer(forward_s, backward_s)) for _ in range(run["stages"])])
    return nn.Sequential(*[Timed(nn.Sequential(nn.Linear(MLP_HIDDEN, MLP_HIDDEN), nn.GELU()))
                           for _ in range(MLP_BLOCKS)])


def make_loader(run: dict[str, Any], steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    width, batch = (SLEEP_WIDTH, SLEEP_BATCH) if run["model"] == "sleep" else (MLP_HIDDEN, MLP_BATCH)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(steps * batch, width, generator=gen), torch.randn(steps * batch, width,
                                                                                        generator=gen))
    return DataLoader(data, batch_size=batch, shuffle=False)


class StepLog:
    """The clock and the number of block records at the start of every step: each step's window and compute."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), len(_RECORDS)))

    def steps(self) -> list[dict[str, float]]:
        out = []
        for (start, first), (end, last) in pairwise(self.marks):
            records = _RECORDS[first:last]
            out.append({"window": end - start, "F": sum(s for k, s in records if k == "F"),
                        "B": sum(s for k, s in records if k == "B")})
        return out


class Profiler:
    """cProfile over the timed steps (from the end of the warm-up), written to ``out`` when asked to."""

    def __init__(self, out: str | None, name: str) -> None:
        self.out, self.name = out, name
        self.profile = cProfile.Profile() if out else None

    def start(self) -> None:
        if self.profile is not None:
            self.profile.enable()

    def stop(self) -> None:
        if self.profile is None or self.out is None:
            return
        self.profile.disable()
        Path(self.out).mkdir(parents=True, exist_ok=True)
        self.profile.dump_stats(str(Path(self.out, f"{self.name}.prof")))
        text = io.StringIO()
        stats = pstats.Stats(self.profile, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        Path(self.out, f"{self.name}.txt").write_text(text.getvalue())


def torch_idle_per_action(run: dict[str, Any], stage: Any, schedule: Any, step: Any) -> list[float]:
    """torch.distributed.pipelining timed as PipelineMonitor times lightning_pp, for ``run["monitor_steps"]`` calls of
    ``step``: every forward chunk (with the last stage's loss), backward chunk, posting of P2P ops and wait for them is
    an interval; a step's idle time is the stage's span (its first interval's start to its last one's end) minus the
    intervals, per compute action (µs)."""
    import torch.distributed.pipelining.schedules as schedules

    intervals: list[tuple[float, float]] = []

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                intervals.append((start, time.perf_counter()))
        return wrapper

    originals = {name: getattr(schedules, name) for name in ("_batch_p2p", "_wait_batch_p2p")}
    for name, fn in originals.items():
        setattr(schedules, name, timed(fn))
    stage.forward_one_chunk = timed(stage.forward_one_chunk)
    stage.backward_one_chunk = timed(stage.backward_one_chunk)
    schedule._maybe_compute_loss = timed(schedule._maybe_compute_loss)
    idle = []
    try:
        for _ in range(run["monitor_steps"]):
            intervals.clear()
            step()
            span = max(end for _, end in intervals) - min(start for start, _ in intervals)
            idle.append(1e6 * max(0.0, span - sum(end - start for start, end in intervals)) / (2 * run["microbatches"]))
    finally:
        for name, fn in originals.items():
            setattr(schedules, name, fn)
        del stage.forward_one_chunk, stage.backward_one_chunk, schedule._maybe_compute_loss
    return idle


def worker_torch(run: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    blocks = make_blocks(run)
    p = run["stages"]
    per_stage = len(blocks) // p
    part = blocks[rank * per_stage:(rank + 1) * per_stage]
    stage = PipelineStage(part, stage_index=rank, num_stages=p, device=torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run["schedule"]]
    schedule = kind(stage, n_microbatches=run["microbatches"], loss_fn=F.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    log = StepLog()
    profiler = Profiler(run.get("profile"), f"torch_{run['model']}_{run['schedule']}_rank{rank}")
    batches = iter(make_loader(run, run["steps"] + 1 + run["monitor_steps"]))

    def step() -> None:
        x, y = next(batches)
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()

    for i in range(run["steps"] + 1):
        if i == run["warmup"]:
            profiler.start()
        log.mark()
        step()
    log.mark()
    profiler.stop()
    return {"steps": log.steps(), "idle_per_action_us": torch_idle_per_action(run, stage, schedule, step)}


def worker_lightning(run: dict[str, Any], rank: int) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback

    from lightning_pp import PipelineMonitor, PipelineParallelStrategy

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = make_blocks(run)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.mse_loss(self.layers(x), y)
            if run["log"]:
                self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Steps(Callback):
        def __init__(self, log: StepLog, profiler: Profiler | None = None) -> None:
            self.step_log, self.profiler = log, profiler

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if self.profiler is not None and batch_idx == run["warmup"]:
                self.profiler.start()
            self.step_log.mark()

    def fit(steps: int, callbacks: list[Callback]) -> None:
        trainer = L.Trainer(
            accelerator="cpu", devices=run["stages"], max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
            strategy=PipelineParallelStrategy(schedule=run["schedule"], microbatches=run["microbatches"]),
        )
        trainer.fit(Model(), make_loader(run, steps))

    log = StepLog()
    profiler = Profiler(run.get("profile"), f"lightning_{run['model']}_{run['schedule']}_rank{rank}")
    fit(run["steps"] + 1, [Steps(log, profiler)])  # the extra step's start ends the last timed step
    profiler.stop()
    monitor = PipelineMonitor(logging_interval=1, timeline_every_n_steps=0)
    fit(run["monitor_steps"], [monitor])
    return {"steps": log.steps()[:run["steps"]], "history": monitor.history}


def worker_main(kind: str, spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec_path).parent
    rank = int(os.environ.get("RANK", "0"))
    if kind == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    results: list[dict[str, Any]] = []
    try:
        for run in spec["runs"]:
            results.append(worker_torch(run, rank) if kind == "torch" else worker_lightning(run, rank))
            if kind == "torch":
                dist.barrier()
            Path(out_dir, f"{kind}_rank{rank}.json").write_text(json.dumps(results))
    finally:
        if kind == "torch":
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------------
# Parent: launch, collect, tabulate
# --------------------------------------------------------------------------------------------------------------------


def predicted_step(schedule_name: str, p: int, m: int, per_stage: list[dict[str, float]]) -> float:
    """The simulator's step for one measured step: per stage, its forward and backward time per micro-batch."""
    from lightning_pp.schedule import ActionType, build_schedule
    from lightning_pp.schedule.simulate import simulate

    schedule = build_schedule(schedule_name, p, m)
    costs = {stage: {ActionType.FORWARD: s["F"] / m, ActionType.BACKWARD: s["B"] / m}
             for stage, s in enumerate(per_stage)}
    return simulate(schedule, lambda a: costs[a.stage].get(a.type, 0.0)).makespan


def monitor_figures(history: list[dict[str, float]], p: int) -> dict[str, Any]:
    """From PipelineMonitor's history: idle per compute action per stage, step and predicted step (ms; medians)."""
    if not history:
        return {}
    idle = [statistics.median(h[f"pipeline/stage{s}/framework_us_per_action"] for h in history) for s in range(p)]
    predicted = []
    for h in history:
        compute = sum(h[f"pipeline/stage{s}/forward_ms"] + h[f"pipeline/stage{s}/backward_ms"] for s in range(p))
        predicted.append(compute / (p * (1 - h["pipeline/predicted_bubble_fraction"])))
    return {"idle_per_action_us": idle,
            "step_ms": statistics.median(h["pipeline/step_ms"] for h in history),
            "predicted_ms": statistics.median(predicted)}


def summarize_run(run: dict[str, Any], per_rank: list[dict[str, Any] | None]) -> dict[str, Any]:
    p, m, warmup = run["stages"], run["microbatches"], run["warmup"]
    if any(r is None or len(r["steps"]) <= warmup for r in per_rank):
        return {"failed": True}
    ranks: list[dict[str, Any]] = [r for r in per_rank if r is not None]
    count = min(len(r["steps"]) for r in ranks)
    windows: list[list[float]] = [[] for _ in range(p)]
    predicted: list[float] = []
    for i in range(warmup, count):
        step_predicted = predicted_step(run["schedule"], p, m, [r["steps"][i] for r in ranks])
        predicted.append(step_predicted)
        for s in range(p):
            windows[s].append(ranks[s]["steps"][i]["window"] - step_predicted)
    out: dict[str, Any] = {
        "window_ms": statistics.median(ranks[0]["steps"][i]["window"] for i in range(warmup, count)) * 1e3,
        "predicted_ms": statistics.median(predicted) * 1e3,
        "framework_per_action_us": [statistics.median(w) / (2 * m) * 1e6 for w in windows],
        "steps": count - warmup,
    }
    monitor = monitor_figures(ranks[0].get("history", [])[1:], p)  # the first measured step warms up
    if monitor:
        out["monitor"] = monitor
    if all("idle_per_action_us" in r for r in ranks):  # torch.distributed.pipelining, timed like the monitor
        out["monitor"] = {"idle_per_action_us": [statistics.median(r["idle_per_action_us"][1:]) for r in ranks]}
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    def us(values: list[float] | None) -> str:
        return " / ".join(f"{v:.0f}" for v in values) if values else "n/a"

    lines = ["| model, schedule, p, m | runner | step window ms | predicted ms | framework µs / action (per stage) "
             "| idle µs / action (per stage) | monitor step ms (predicted) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        s = row["summary"]
        config = f"{row['model']}, {row['schedule']}, p={row['stages']}, m={row['microbatches']}"
        if s.get("failed"):
            lines.append(f"| {config} | {RUNNERS[row['runner']]} | failed | | | | |")
            continue
        monitor = s.get("monitor")
        timed = monitor is not None and "step_ms" in monitor
        step = f"{monitor['step_ms']:.2f} ({monitor['predicted_ms']:.2f})" if timed else "n/a"
        lines.append(
            f"| {config} | {RUNNERS[row['runner']]} | {s['window_ms']:.2f} | {s['predicted_ms']:.2f} "
            f"| {us(s['framework_per_action_us'])} | {us(monitor['idle_per_action_us']) if monitor else 'n/a'} "
            f"| {step} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["sleep", "mlp"], choices=["sleep", "mlp"])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4])
    parser.add_argument("--sleep-ms", type=float, nargs=2, default=[2.0, 4.0], metavar=("FORWARD", "BACKWARD"),
                        help="what a sleep block's forward and backward take (default 2 4)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out (default 5)")
    parser.add_argument("--monitor-steps", type=int, default=15, help="steps of the PipelineMonitor run")
    parser.add_argument("--log", action="store_true", help="lightning_pp's step also calls self.log on the loss")
    parser.add_argument("--repeats", type=int, default=1, help="launch every runner this many times (rows each)")
    parser.add_argument("--profile", type=Path, help="write cProfile output of the timed steps here")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for overhead.md and overhead.json")
    parser.add_argument("--worker", choices=list(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec)
        return
    load_before = os.getloadavg()[0]
    runs = [{"model": model, "schedule": schedule, "stages": args.stages, "microbatches": m,
             "sleep_ms": args.sleep_ms, "steps": args.steps, "warmup": args.warmup, "log": args.log,
             "monitor_steps": args.monitor_steps, "profile": str(args.profile) if args.profile else None}
            for model in args.models for schedule in args.schedules for m in args.microbatches]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lpp_overhead_") as tmp_name:
        for repeat in range(args.repeats):
            for runner in args.runners:
                print(f"[{repeat + 1}/{args.repeats}] {runner}: {len(runs)} run(s) ...", file=sys.stderr, flush=True)
                per_rank = compare.launch(runner, "cpu", runs, args.stages, args.timeout, Path(tmp_name),
                                          script=Path(__file__).resolve())
                for index, run in enumerate(runs):
                    results = [r[index] if index < len(r) else None for r in per_rank]
                    rows.append({**{k: run[k] for k in ("model", "schedule", "stages", "microbatches")},
                                 "runner": runner, "repeat": repeat, "summary": summarize_run(run, results)})
    rows.sort(key=lambda r: (r["model"], r["schedule"], r["microbatches"], r["runner"] != "torch", r["repeat"]))
    machine = compare.machine_description("cpu")
    table = markdown(rows)
    print(f"Measured on {machine}; 1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after.\n")
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.md").write_text(f"Measured on {machine}.\n\n{table}\n")
    (args.out / "overhead.json").write_text(json.dumps({"machine": machine, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
