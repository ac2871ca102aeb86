"""Compare lightning_pp with torch.distributed.pipelining and a single process, on CPU.

Run ``python benchmarks/compare.py`` (with ``PYTHONPATH`` pointing at the repository root, or the package installed).
One invocation measures, for every configuration (an MLP of 8 blocks ``Linear(H, H) + GELU``, batch 128, MSE loss
against a random target, SGD; hidden sizes ``--hidden``; and, unless ``--no-gpt``, the GPT-style module of
``examples/train_gpt.py`` with 8 blocks of width 256, 4 heads, sequences of 64 random tokens, batch 32, AdamW;
schedules ``--schedules``, 2 stages, 8 micro-batches):

1. **lightning_pp**: the LightningModule trained by ``L.Trainer(accelerator="cpu", devices=2,
   strategy=PipelineParallelStrategy(schedule=..., microbatches=8), max_steps=N)`` in two processes.
2. **torch.distributed.pipelining**: the same layers split by hand (first 4 blocks on rank 0, last 4 on rank 1),
   ``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B`` with ``n_microbatches=8, loss_fn=mse``, in a plain loop
   (``schedule.step`` then ``optimizer.step``/``zero_grad``) in two processes over gloo.
   Not for the GPT: its head is tied to the token embedding, one weight on the first and the last stage, which
   ``PipelineStage`` cannot express.
3. **torch.distributed.pipelining + freed memory kept**: the same, with glibc told to keep freed memory in the process
   (what ``PipelineParallelStrategy(reuse_cpu_memory=True)``, the default, does on CPU), to show how much of the
   difference is the allocator.
4. **single process**: the whole model in one process, plain PyTorch loop over the whole batch (no micro-batches).

Every process runs with one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``); the multi-process runs are
launched as two subprocesses the way torchrun would (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``NODE_RANK``); Lightning sees an external launcher because ``LOCAL_RANK`` is set.

Definitions (``p`` stages, ``m`` micro-batches, ``T_single`` the single-process median step time):

- **step time**: wall time of one optimizer step on rank 0 (first stage, which finishes last in both schedules), from
  the start of the step to the end of ``optimizer.step``/``zero_grad``. For lightning_pp: a Callback's
  ``on_train_batch_start`` to ``on_train_batch_end`` (``time.perf_counter``); for torch: around
  ``schedule.step`` + ``optimizer.step`` + ``zero_grad``. Reported: median over the steps after the first
  ``--warmup`` (default 3), with min-max.
- **ratio to torch**: median step of the runner / median step of torch.distributed.pipelining, same schedule.
- **ideal**: ``T_single * (m + p - 1) / (m * p)``, the step time of a perfect ``p``-way split of the work with the
  unavoidable fill/drain bubble of ``p - 1`` micro-batch slots and no other cost.
- **efficiency**: ``ideal / median step`` (1.0 = only the schedule's bubble is paid).
- **overhead per micro-batch**: ``(median step - T_single / p * (m + p - 1) / m) / m``, which equals
  ``(median step - ideal) / m``: everything beyond the ideal pipelined step (communication, framework code, the
  cost of smaller matmuls on micro-batches), spread over the micro-batches, in milliseconds.
- **measured bubble**: ``pipeline/bubble_fraction`` of :class:`lightning_pp.PipelineMonitor` (share of the step's
  wall time the stages did not compute), median over a separate short run with ``logging_interval=1`` (that run is
  not used for step times, as timing every action costs a little). lightning_pp only.
- **peak activation memory per stage**: on CPU there is no allocator peak to read, so this counts the bytes of
  tensors saved for backward. During one step (after warm-up), ``torch.autograd.graph.saved_tensors_hooks`` records
  every saved tensor; its storage is counted once (deduplicated by storage pointer) while any saved reference to it
  is alive, parameters (and views of them) excluded. The peak of that live total over the step is reported per stage.
  Measured the same way for all three runners (for lightning_pp in the monitor run).

Results are printed as a markdown table and written to ``benchmarks/results/compare.md`` and ``compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

NUM_LAYERS = 8
NUM_STAGES = 2
GPT_DIM, GPT_HEADS, GPT_BLOCK, GPT_VOCAB, GPT_BATCH = 256, 4, 64, 64, 32
RUNNER_LABELS = {  # --runners name -> label in the table
    "single": "single process",
    "torch": "torch.distributed.pipelining",
    "torch_kept": "torch.distributed.pipelining + freed memory kept",
    "lightning": "lightning_pp",
}
PIPELINE_RUNNERS = ("torch", "torch_kept", "lightning")
MICROBATCHES = 8
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


class SavedTensorMeter:
    """Peak bytes of live tensors saved for backward (storage-deduplicated, parameters excluded)."""

    def __init__(self, exclude_ptrs: set[int]) -> None:
        self.exclude = exclude_ptrs
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [nbytes, live references]
        self.live = 0
        self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[ptr]

    @contextmanager
    def measure(self) -> Iterator[None]:
        import torch

        meter = self

        class _Handle:
            __slots__ = ("ptr", "tensor")

            def __init__(self, tensor: torch.Tensor, ptr: int | None) -> None:
                self.tensor = tensor
                self.ptr = ptr

            def __del__(self) -> None:
                if self.ptr is not None:
                    meter._release(self.ptr)

        def pack(tensor: torch.Tensor) -> _Handle:
            try:
                storage = tensor.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):
                return _Handle(tensor, None)
            if ptr in meter.exclude or nbytes == 0:
                return _Handle(tensor, None)
            entry = meter.refs.get(ptr)
            if entry is None:
                meter.refs[ptr] = [nbytes, 1]
                meter.live += nbytes
                meter.peak = max(meter.peak, meter.live)
            else:
                entry[1] += 1
            return _Handle(tensor, ptr)

        def unpack(handle: _Handle) -> torch.Tensor:
            return handle.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def param_ptrs(module: Any) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def summarize(times: list[float], warmup: int) -> dict[str, float]:
    kept = times[warmup:] if len(times) > warmup else times
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "n": len(kept)}


# --------------------------------------------------------------------------------------------------------------------
# Workers (run in subprocesses)
# --------------------------------------------------------------------------------------------------------------------


def worker_single(run: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    model: Any
    if run["model"] == "gpt":
        model = make_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches: list[Any] = list(make_tokens(run["steps"]).split(GPT_BATCH))

        def loss_of(tokens: Any) -> Any:
            logits = model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    else:
        model = make_layers(run["hidden"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        batches = make_batches(run["hidden"], run["steps"])

        def loss_of(batch: Any) -> Any:
            return F.mse_loss(model(batch[0]), batch[1])

    meter = SavedTensorMeter(param_ptrs(model))
    times: list[float] = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        if i == run["warmup"]:
            with meter.measure():
                loss_of(batch).backward()
        else:
            loss_of(batch).backward()
        opt.step()
        opt.zero_grad()
        if i != run["warmup"]:  # the metered step pays for the hooks
            times.append(time.perf_counter() - start)
    return {"times": times, "peak_saved_bytes": meter.peak}


def worker_torch(run: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if run["model"] == "gpt":  # PipelineStage cannot share the tied embedding/head weight between stages
        return {"times": [], "peak_saved_bytes": None}
    layers = make_layers(run["hidden"])
    per_stage = NUM_LAYERS // world
    submodule = layers[rank * per_stage:(rank + 1) * per_stage]
    stage = PipelineStage(submodule, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[run["schedule"]]
    schedule = schedule_cls(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(submodule.parameters(), lr=LR)
    batches = make_batches(run["hidden"], run["steps"] + 1)
    meter = SavedTensorMeter(param_ptrs(submodule))
    is_first, is_last = rank == 0, rank == world - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        losses: list[torch.Tensor] = []
        if is_first:
            schedule.step(x)
        elif is_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()

    times: list[float] = []
    for x, y in batches[:run["steps"]]:
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    with meter.measure():  # one extra step, metered, not timed
        step(*batches[run["steps"]])
    return {"times": times if is_first else [], "peak_saved_bytes": meter.peak}


def worker_lightning(run: dict[str, Any], rank: int) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineMonitor, PipelineParallelStrategy

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
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if trainer.global_rank == 0:
                self.times.append(time.perf_counter() - self._start)

    class MemoryProbe(Callback):
        """Meters the saved tensors of one training step (hooks pushed at batch start, popped at batch end)."""

        def __init__(self, step: int) -> None:
            self.step = step
            self.meter: SavedTensorMeter | None = None
            self._ctx: Any = None

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if trainer.global_step == self.step:
                self.meter = SavedTensorMeter(param_ptrs(pl_module))
                self._ctx = self.meter.measure()
                self._ctx.__enter__()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self._ctx is not None:
                self._ctx.__exit__(None, None, None)
                self._ctx = None

    def fit(steps: int, callbacks: list[Callback]) -> None:
        module: L.LightningModule
        if run["model"] == "gpt":
            module, data, batch = make_gpt(), make_tokens(steps), GPT_BATCH
        else:
            batches = make_batches(hidden, steps)
            module = MLP()
            data = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
            batch = BATCH
        trainer = L.Trainer(
            accelerator="cpu", devices=NUM_STAGES,
            strategy=PipelineParallelStrategy(schedule=run["schedule"], microbatches=MICROBATCHES),
            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks,
        )
        trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=False))

    timer = StepTimer()
    fit(run["steps"], [timer])
    bubbles: list[float] = []
    peak_saved_bytes = None
    if run["monitor_steps"] > 0:
        monitor = PipelineMonitor(logging_interval=1, timeline_every_n_steps=0)
        probe = MemoryProbe(step=min(run["warmup"], run["monitor_steps"] - 1))
        fit(run["monitor_steps"], [monitor, probe])
        bubbles = [h["pipeline/bubble_fraction"] for h in monitor.history if "pipeline/bubble_fraction" in h]
        peak_saved_bytes = probe.meter.peak if probe.meter is not None else None
    return {"times": timer.times if rank == 0 else [], "bubble_fractions": bubbles, "peak_saved_bytes": peak_saved_bytes}


def worker_main(kind: str, spec_path: str, out_dir: str) -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if kind.startswith("torch"):
        import torch.distributed as dist

        if kind == "torch_kept":
            from lightning_pp._allocator import keep_freed_cpu_memory

            keep_freed_cpu_memory()
        dist.init_process_group("gloo", rank=rank, world_size=world)
    results: list[dict[str, Any]] = []
    try:
        for run in spec["runs"]:
            if kind == "single":
                results.append(worker_single(run))
            elif kind.startswith("torch"):
                results.append(worker_torch(run, rank, world))
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(kind: str, runs: list[dict[str, Any]], world: int, timeout: float, tmp: Path) -> list[list[dict[str, Any]]]:
    """Run ``runs`` in ``world`` fresh worker processes; returns per rank the list of per-run results."""
    spec = tmp / f"{kind}_spec.json"
    spec.write_text(json.dumps({"runs": runs}))
    port = free_port()
    procs: list[tuple[subprocess.Popen[bytes], Any, Path]] = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        if world == 1:
            for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
                env.pop(key)
        log_path = tmp / f"{kind}_rank{rank}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec), "--out", str(tmp)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, log_path))
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc, _, _ in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc, log, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    failed = timed_out or any(proc.returncode != 0 for proc, _, _ in procs)
    if failed:
        why = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        for rank, (proc, _, log_path) in enumerate(procs):
            tail = log_path.read_text(errors="replace")[-2500:]
            print(f"--- {kind} rank {rank} {why} (exit {proc.returncode}) ---\n{tail}", file=sys.stderr)
    per_rank: list[list[dict[str, Any]]] = []
    for rank in range(world):
        path = tmp / f"{kind}_rank{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else [])
    return per_rank


def fmt_s(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "failed"
    return f"{stats['median']:.4f} ({stats['min']:.4f}-{stats['max']:.4f})"


def fmt_mib(values: list[int | None]) -> str:
    if not values or any(v is None for v in values):
        return "n/a"
    return " / ".join(f"{v / 2**20:.1f}" for v in values if v is not None) + " MiB"


def build_rows(args: argparse.Namespace, pooled: dict[str, list[list[dict[str, Any]]]],
               models: list[tuple[str, int]], configs: list[tuple[str, int, str]]) -> list[dict[str, Any]]:
    p, m = NUM_STAGES, MICROBATCHES
    single = pooled["single"]
    pipelines = [(RUNNER_LABELS[kind], pooled[kind]) for kind in PIPELINE_RUNNERS]
    rows: list[dict[str, Any]] = []

    def get(per_rank: list[list[dict[str, Any]]], rank: int, index: int) -> dict[str, Any] | None:
        return per_rank[rank][index] if rank < len(per_rank) and index < len(per_rank[rank]) else None

    t_single: dict[int, float] = {}
    for i, (model, hidden) in enumerate(models if single else []):
        res = get(single, 0, i)
        stats = summarize(res["times"], args.warmup) if res else None
        if stats:
            t_single[model_label(model, hidden)] = stats["median"]
        rows.append({
            "model": model_label(model, hidden), "hidden": hidden, "schedule": "-", "stages": 1, "microbatches": 1,
            "runner": "single process", "step_s": stats, "ratio_to_torch": None, "efficiency": None,
            "bubble_fraction": None, "peak_saved_bytes": [res["peak_saved_bytes"]] if res else [None],
            "overhead_per_microbatch_ms": None,
        })
    for i, (model, hidden, schedule) in enumerate(configs):
        runner_stats: dict[str, dict[str, float] | None] = {}
        for name, per_rank in pipelines:
            res0 = get(per_rank, 0, i)
            runner_stats[name] = summarize(res0["times"], args.warmup) if res0 and res0["times"] else None
        torch_median = runner_stats[RUNNER_LABELS["torch"]]
        for name, per_rank in pipelines:
            if not per_rank:  # runner not selected with --runners
                continue
            if model == "gpt" and name != RUNNER_LABELS["lightning"]:  # see worker_torch
                continue
            stats = runner_stats[name]
            res0 = get(per_rank, 0, i)
            ts = t_single.get(model_label(model, hidden))
            ideal = ts * (m + p - 1) / (m * p) if ts is not None else None
            bubbles = res0.get("bubble_fractions") if res0 else None
            kept_bubbles = (bubbles[args.warmup:] or bubbles) if bubbles else None
            rows.append({
                "model": model_label(model, hidden), "hidden": hidden, "schedule": schedule, "stages": p,
                "microbatches": m, "runner": name, "step_s": stats,
                "ratio_to_torch": stats["median"] / torch_median["median"] if stats and torch_median else None,
                "efficiency": ideal / stats["median"] if stats and ideal else None,
                "bubble_fraction": statistics.median(kept_bubbles) if kept_bubbles else None,
                "peak_saved_bytes": [(get(per_rank, r, i) or {}).get("peak_saved_bytes") for r in range(p)],
                "overhead_per_microbatch_ms": (stats["median"] - ideal) / m * 1e3 if stats and ideal else None,
            })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def opt(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [
        "| config (model, schedule, stages, micro-batches) | runner | median step s (min-max) | ratio to torch "
        "| efficiency | measured bubble | peak saved activations / stage | overhead / micro-batch ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        config = f"{r['model']}, {r['schedule']}, p={r['stages']}, m={r['microbatches']}"
        bubble = "n/a" if r["runner"] != "lightning_pp" else opt(r["bubble_fraction"], ".3f")
        lines.append(
            f"| {config} | {r['runner']} | {fmt_s(r['step_s'])} | {opt(r['ratio_to_torch'], '.2f')} "
            f"| {opt(r['efficiency'], '.2f')} | {bubble} | {fmt_mib(r['peak_saved_bytes'])} "
            f"| {opt(r['overhead_per_microbatch_ms'], '.2f')} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024],
                        help="MLP hidden sizes (default 512 1024)")
    parser.add_argument("--gpt", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the GPT-style example model (default on)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
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
    if args.quick:
        args.steps, args.warmup, args.monitor_steps = 10, 2, 5
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def pool(results: list[list[list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    """Merge repeated launches: times and bubble fractions concatenated (warm-up dropped per repeat), peaks maxed."""
    if len(results) == 1:
        return results[0]
    merged: list[list[dict[str, Any]]] = []
    for rank in range(len(results[0])):
        runs: list[dict[str, Any]] = []
        for index in range(min(len(rep[rank]) for rep in results)):
            parts = [rep[rank][index] for rep in results]
            out: dict[str, Any] = {"times": [], "peak_saved_bytes": None}
            for part in parts:
                out["times"] += part["times"]
                if "bubble_fractions" in part:
                    out.setdefault("bubble_fractions", []).extend(part["bubble_fractions"])
                if part.get("peak_saved_bytes") is not None:
                    out["peak_saved_bytes"] = max(out["peak_saved_bytes"] or 0, part["peak_saved_bytes"])
            runs.append(out)
        merged.append(runs)
    return merged


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
    configs = [(model, h, s) for model, h in models for s in args.schedules]
    common = {"steps": args.steps, "warmup": args.warmup, "monitor_steps": args.monitor_steps}
    single_runs = [{"model": model, "hidden": h, **common} for model, h in models]
    pipe_runs = [{"model": model, "hidden": h, "schedule": s, **common} for model, h, s in configs]
    collected: dict[str, list[list[list[dict[str, Any]]]]] = {kind: [] for kind in RUNNER_LABELS}
    with tempfile.TemporaryDirectory(prefix="lpp_compare_") as tmp_name:
        tmp = Path(tmp_name)
        for repeat in range(args.repeats):
            for kind in RUNNER_LABELS:
                runs, world = (single_runs, 1) if kind == "single" else (pipe_runs, NUM_STAGES)
                if kind not in args.runners:
                    continue
                t0 = time.perf_counter()
                print(f"[{repeat + 1}/{args.repeats}] {kind}: {len(runs)} run(s) ...", file=sys.stderr, flush=True)
                for old in tmp.glob(f"{kind}_rank*.json"):
                    old.unlink()
                per_rank = launch(kind, runs, world, args.timeout, tmp)
                # a repeat's warm-up is dropped before pooling, so later repeats' warm-up is not counted either
                if repeat > 0:
                    for rank_runs in per_rank:
                        for res in rank_runs:
                            res["times"] = res["times"][args.warmup:]
                            if "bubble_fractions" in res:
                                res["bubble_fractions"] = res["bubble_fractions"][args.warmup:]
                collected[kind].append(per_rank)
                print(f"    done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    pooled = {kind: pool(reps) if reps else [] for kind, reps in collected.items()}
    rows = build_rows(args, pooled, models, configs)
    table = markdown(rows)
    elapsed = time.perf_counter() - started
    print(table)
    print(f"\ntotal runtime: {elapsed:.1f} s  (steps={args.steps}, warm-up={args.warmup}, "
          f"monitor steps={args.monitor_steps}, repeats={args.repeats}; threads per process: 1; "
          f"1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.md").write_text(table + "\n")
    meta = {"steps": args.steps, "warmup": args.warmup, "monitor_steps": args.monitor_steps,
            "repeats": args.repeats, "batch": BATCH, "layers": NUM_LAYERS, "stages": NUM_STAGES,
            "microbatches": MICROBATCHES, "runtime_s": elapsed, "cpu_count": os.cpu_count(),
            "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]}
    (args.out / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
