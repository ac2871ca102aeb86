"""Everything of lightning_pp that one GPU can run, checked in one call: one line ``CHECK name PASS|FAIL|SKIP detail``
per check, then ``gpu_check: N passed, N failed, N skipped``.

A lent GPU machine has one GPU, no package registry and a few minutes: this runs with whatever Python it has (torch,
lightning; transformers optional), the repository on ``PYTHONPATH``, and installs nothing. NCCL refuses two ranks on
one GPU, so every pipeline here is one process holding several stages (``interleaved_1f1b``, ``zbv``, ``dualpipev``;
``zb_h1`` and ``1f1b`` with their one stage), on a one-rank NCCL group. What it checks, against plain
Lightning on the same device (fp32 with TF32 off, so that the comparisons are tight):

- ``equal/...``: losses and weights after a few steps, per schedule and stage count (the MLP and the GPT);
- ``bf16_mixed``: ``precision="bf16-mixed"`` losses close to plain Lightning's bf16 run;
- ``monitor``: :class:`~lightning_pp.PipelineMonitor` on the device (event timing, the allocator's peak, the bubble);
- ``generate/...``: greedy generation through the pipeline (the GPT's own loop; Hugging Face GPT-2's ``generate``
  with its key/value cache) gives one device's tokens;
- ``checkpoint/full`` and ``checkpoint/sharded``: saved mid-run, loaded by plain Lightning (full) or resumed (both):
  the resumed run ends where the uninterrupted one does; the sharded one is torch's distributed checkpoint;
- ``compiled_blocks``: blocks wrapped in ``torch.compile`` train as one device (inductor on a GPU);
- ``pipedream_2bw/weight_stash``: the asynchronous schedule's kept version of the weights, read back by a backward
  after the optimizer updated the live ones in place (the schedule itself needs 2 ranks);
- ``timing/...``: median step time of a plain loop, plain Lightning, lightning_pp and torch.distributed.pipelining
  (the same blocks, one process, the same interleaved schedule), as ratios to the plain loop.

``--cpu`` runs the same checks on the CPU with small models (CI's fast tier runs it, so the script cannot rot).
``--budget`` seconds (default 420) bound the run: a check not started in time is a SKIP; one still running when the
budget and a grace of 60 s are spent is a FAIL, the rest SKIPs, and the process exits.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

GRACE_S = 60.0


class Skip(Exception):
    """A check that does not apply here (its reason is the detail)."""


# ---------------------------------------------------------------------------------------------------------- settings
class Settings:
    """Sizes and tolerances of one mode (GPU, or ``--cpu``)."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.device = torch.device("cpu") if cpu else torch.device("cuda", 0)
        self.accelerator = "cpu" if cpu else "gpu"
        self.width = 32 if cpu else 512  # the equality checks' MLP
        self.gpt = {"dim": 32, "layers": 4, "heads": 2, "block_size": 16} if cpu else \
            {"dim": 256, "layers": 8, "heads": 4, "block_size": 64}
        self.timing_mlp = (64, 8, 64) if cpu else (4096, 8, 1024)  # width, blocks, batch
        self.timing_gpt = {"dim": 64, "layers": 4, "heads": 2, "block_size": 32, "batch": 16} if cpu else \
            {"dim": 1024, "layers": 8, "heads": 16, "block_size": 256, "batch": 32}
        self.timed_steps = 4 if cpu else 12
        self.atol = 1e-5 if cpu else 5e-5


S: Settings


# ------------------------------------------------------------------------------------------------------------ models
class RecordingLogger(Logger):
    """Keeps every logged value (one process: rank 0 is this one)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int, dict[str, float]]] = []

    name = "recording"  # type: ignore[assignment]
    version = 0  # type: ignore[assignment]

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def values(self, key: str) -> list[float]:
        return [m[key] for _, m in sorted(self.history, key=lambda item: item[0]) if key in m]


class MLP(L.LightningModule):
    """8 blocks of ``Linear + GELU`` between an input and a head, MSE, SGD with momentum."""

    def __init__(self, width: int, blocks: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.inp = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def mlp_data(batches: int = 4, batch: int = 16, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(batches * batch, 16, generator=generator), torch.randn(batches * batch, 4, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def gpt_class() -> Any:
    import train_gpt  # examples/train_gpt.py: a ModuleList of blocks looped over, the head tied to the embedding

    class CheckGPT(train_gpt.GPT):
        """The example's GPT with SGD (exact comparisons) and greedy generation in ``predict_step``."""

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens = batch[:, :4]
            for _ in range(6):  # one pass through the pipeline per token
                logits = self(tokens[:, -self.hparams["block_size"]:])
                tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            return tokens

    return CheckGPT


def gpt(**overrides: Any) -> L.LightningModule:
    return gpt_class()(vocab_size=48, **{**S.gpt, **overrides})


def token_data(batches: int = 4, batch: int = 8, length: int | None = None, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 48, (batches * batch, (length or S.gpt["block_size"]) + 1), generator=generator)
    return DataLoader(tokens, batch_size=batch)


# ------------------------------------------------------------------------------------------------------- harnesses
def trainer(strategy: Any = "auto", **kwargs: Any) -> L.Trainer:
    settings = {"accelerator": S.accelerator, "devices": 1, "max_steps": 4, "logger": False,
                "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                "num_sanity_val_steps": 0, "limit_val_batches": 0, "log_every_n_steps": 1, **kwargs}
    return L.Trainer(strategy=strategy, **settings)


def pipeline(schedule: str, stages: int = 1, **kwargs: Any) -> Any:
    from lightning_pp import PipelineParallelStrategy

    per_rank = {"stages_per_rank": stages} if stages > 1 else {}
    return PipelineParallelStrategy(schedule=schedule, microbatches=kwargs.pop("microbatches", 4), **per_rank,
                                    **kwargs)


def fit(make: Callable[[], L.LightningModule], data: Callable[[], DataLoader], strategy: Any = "auto",
        **kwargs: Any) -> tuple[L.LightningModule, RecordingLogger, L.Trainer]:
    torch.manual_seed(0)
    module, logger = make(), RecordingLogger()
    run = trainer(strategy, logger=logger, **kwargs)
    run.fit(module, data())
    return module, logger, run


def full_state(module: L.LightningModule, run: L.Trainer, folder: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights as a full checkpoint holds them (what plain Lightning loads)."""
    path = folder / "weights.ckpt"
    run.save_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> float:
    """Largest difference of two state dicts (``AssertionError`` beyond ``atol``)."""
    got = {k.replace("_orig_mod.", ""): v for k, v in got.items()}  # a compiled block's wrapper
    if set(got) != set(want):
        raise AssertionError(f"keys differ: {sorted(set(got) ^ set(want))[:5]}")
    worst = max(float((got[k].float().cpu() - want[k].float().cpu()).abs().max()) for k in want if want[k].numel())
    if worst > atol:
        raise AssertionError(f"weights differ by {worst:.2e} (> {atol:.0e})")
    return worst


def compare_losses(got: list[float], want: list[float], rtol: float) -> float:
    if len(got) != len(want) or not want:
        raise AssertionError(f"{len(got)} losses logged, {len(want)} by plain Lightning")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want, strict=True))
    if worst > rtol:
        raise AssertionError(f"losses {got} vs {want}: relative difference {worst:.2e} (> {rtol:.0e})")
    return worst


_references: dict[str, tuple[dict[str, torch.Tensor], list[float]]] = {}


def reference(name: str, make: Callable[[], L.LightningModule], data: Callable[[], DataLoader],
              **kwargs: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain Lightning's weights and losses, computed once per name."""
    if name not in _references:
        with tempfile.TemporaryDirectory() as folder:
            module, logger, run = fit(make, data, **kwargs)
            _references[name] = full_state(module, run, Path(folder)), logger.values("train_loss")
    return _references[name]


def equal_check(model: str, schedule: str, stages: int) -> Callable[[], str]:
    def check() -> str:
        make, data = (lambda: MLP(S.width), mlp_data) if model == "mlp" else (gpt, token_data)
        want, want_losses = reference(model, make, data)
        with tempfile.TemporaryDirectory() as folder:
            module, logger, run = fit(make, data, pipeline(schedule, stages))
            worst = compare(full_state(module, run, Path(folder)), want, S.atol)
        loss_error = compare_losses(logger.values("train_loss"), want_losses, 1e-5)
        return f"4 steps: weights within {worst:.1e}, losses within {loss_error:.1e} (relative)"
    return check


# ---------------------------------------------------------------------------------------------------------- checks
def check_bf16() -> str:
    make = lambda: MLP(S.width)  # noqa: E731
    _, want, _ = fit(make, mlp_data, precision="bf16-mixed")
    _, got, _ = fit(make, mlp_data, pipeline("interleaved_1f1b", 2), precision="bf16-mixed")
    error = compare_losses(got.values("train_loss"), want.values("train_loss"), 2e-2)
    return f"interleaved_1f1b x2, 4 steps: losses within {error:.1e} of plain bf16 (relative)"


def check_monitor() -> str:
    from lightning_pp import PipelineMonitor

    _, logger, _ = fit(lambda: MLP(S.width), mlp_data, pipeline("interleaved_1f1b", 2),
                       callbacks=[PipelineMonitor(logging_interval=1, timeline_every_n_steps=0)])
    last = {k: v for _, metrics in logger.history for k, v in metrics.items()}
    for key in ("pipeline/stage0/forward_ms", "pipeline/stage1/backward_ms", "pipeline/stage0/peak_memory_mb",
                "pipeline/bubble_fraction", "pipeline/step_ms"):
        if key not in last:
            raise AssertionError(f"{key} not logged; logged: {sorted(last)[:12]}")
    if not (last["pipeline/stage0/forward_ms"] > 0 and 0 <= last["pipeline/bubble_fraction"] <= 1
            and last["pipeline/stage0/peak_memory_mb"] > 0):
        raise AssertionError(f"implausible values: {last}")
    return (f"step {last['pipeline/step_ms']:.2f} ms, stage0 forward {last['pipeline/stage0/forward_ms']:.3f} ms, "
            f"bubble {last['pipeline/bubble_fraction']:.3f}, peak {last['pipeline/stage0/peak_memory_mb']:.3f} MiB")


def check_generate_gpt() -> str:
    def generate(strategy: Any) -> torch.Tensor:
        torch.manual_seed(0)
        module = gpt()
        return torch.cat(trainer(strategy).predict(module, token_data(batches=1)))  # type: ignore[arg-type]

    want = generate("auto")
    got = generate(pipeline("interleaved_1f1b", 2))
    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(f"tokens {got.tolist()} != {want.tolist()}")
    return f"{got.shape[0]} prompts x 6 tokens, one pass per token: equal to plain Lightning"


def check_generate_hf() -> str:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as error:
        raise Skip(f"transformers not importable ({error})") from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    class Generating(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=48, n_positions=32, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)
            self.model = GPT2LMHeadModel(config)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self.model.generate(batch[:, :4], max_new_tokens=6, do_sample=False, use_cache=True,
                                      pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            scores = torch.stack(out.scores, dim=1).flatten(1)
            return torch.cat([out.sequences.to(scores.dtype), scores], dim=1)

    def generate(strategy: Any) -> torch.Tensor:
        torch.manual_seed(0)
        return torch.cat(trainer(strategy).predict(Generating(), token_data(batches=1)))  # type: ignore[arg-type]

    want, got = generate("auto"), generate(pipeline("interleaved_1f1b", 2))
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)
    return "GPT-2 generate (key/value cache, greedy, scores): tokens equal, scores within 1e-4"


def resumed_run(make: Callable[[], L.LightningModule], data: Callable[[], DataLoader], path: Path, strategy: Any
                ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Fit from the checkpoint at ``path`` to step 4: the weights and the losses logged."""
    torch.manual_seed(0)
    module, logger = make(), RecordingLogger()
    trainer(strategy, logger=logger).fit(module, data(), ckpt_path=str(path))
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}, logger.values("train_loss")


def check_checkpoint(fmt: str) -> Callable[[], str]:
    """Saved after 2 steps, resumed to step 4, against plain Lightning doing the same (its resume is the reference:
    where the data restarts is Lightning's rule, not ours)."""
    def check() -> str:
        make, data = (lambda: MLP(S.width)), (lambda: mlp_data(batches=2))
        with tempfile.TemporaryDirectory() as folder:
            plain_path, path = Path(folder) / "plain.ckpt", Path(folder) / "pipeline.ckpt"
            fit(make, data, max_steps=2)[2].save_checkpoint(plain_path)
            want, want_losses = resumed_run(make, data, plain_path, "auto")
            _, _, run = fit(make, data, pipeline("interleaved_1f1b", 2, state_dict_type=fmt), max_steps=2)
            run.save_checkpoint(path)
            detail = ""
            if fmt == "full":  # plain Lightning resumes from it
                compare(resumed_run(make, data, path, "auto")[0], want, S.atol)
                detail = "plain Lightning resumed it as its own; "
            got, losses = resumed_run(make, data, path, pipeline("interleaved_1f1b", 2, state_dict_type=fmt))
            worst = compare(got, want, S.atol)
            compare_losses(losses, want_losses, 1e-5)
        return f"{detail}saved at step 2, resumed to 4: weights within {worst:.1e} of plain Lightning's resume"
    return check


def check_compiled() -> str:
    def make() -> L.LightningModule:
        module = MLP(S.width)
        backend = "aot_eager" if S.cpu else "inductor"  # no C++ build on CI's CPU; code generation on the GPU
        module.blocks = nn.Sequential(*[torch.compile(block, backend=backend) for block in module.blocks])
        return module

    torch._dynamo.reset()
    for name in ("cache_size_limit", "recompile_limit"):  # a graph per block (and per first step), none eager
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    want, want_losses = reference("mlp", lambda: MLP(S.width), mlp_data)
    with tempfile.TemporaryDirectory() as folder:
        module, logger, run = fit(make, mlp_data, pipeline("interleaved_1f1b", 2))
        worst = compare(full_state(module, run, Path(folder)), want, S.atol)
    compare_losses(logger.values("train_loss"), want_losses, 1e-4)
    return (f"{'aot_eager' if S.cpu else 'inductor'}-compiled blocks, interleaved_1f1b x2: weights within {worst:.1e} "
            f"of eager plain Lightning")


def check_weight_stash() -> str:
    """pipedream_2bw's two versions of the weights (it needs 2 ranks, so not through the Trainer here): a forward's
    saved weights are read back from the version kept before the optimizer's in-place update."""
    from lightning_pp.pipedream.step import _Version

    torch.manual_seed(0)
    layer = nn.Linear(64, 64).to(S.device)
    x = torch.randn(8, 64, device=S.device, requires_grad=True)
    version = _Version(list(layer.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(version.pack, _Version.unpack):
        out = layer(x)
    expected = torch.autograd.grad(layer(x).sum(), x)[0]
    version.keep()
    with torch.no_grad():  # the optimizer step updates the live weights in place
        layer.weight.add_(1.0)
    got = torch.autograd.grad(out.sum(), x)[0]
    if not torch.equal(got, expected):
        raise AssertionError("the backward did not read the kept version of the weights")
    return "the backward read the kept weights after an in-place update"


# ---------------------------------------------------------------------------------------------------------- timing
def synchronize() -> None:
    if S.device.type == "cuda":
        torch.cuda.synchronize(S.device)


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        synchronize()
        self.marks.append(time.perf_counter())


def median_step(marks: list[float], warmup: int = 3) -> float:
    return statistics.median(b - a for a, b in zip(marks[warmup:], marks[warmup + 1:], strict=False))


def timing_check(model: str) -> Callable[[], str]:
    def check() -> str:
        steps = 3 + S.timed_steps
        if model == "mlp":
            width, blocks, batch = S.timing_mlp

            def make() -> L.LightningModule:
                return MLP(width, blocks, lr=1e-4)

            def data() -> DataLoader:
                return mlp_data(batches=steps + 1, batch=batch)
        else:
            config = dict(S.timing_gpt)
            batch = config.pop("batch")

            def make() -> L.LightningModule:
                return gpt(**config)

            def data() -> DataLoader:
                return token_data(batches=steps + 1, batch=batch, length=config["block_size"])
        times = {"plain loop": plain_loop(make, data, steps)}
        for label, strategy in (("plain Lightning", "auto"),
                                ("lightning_pp", pipeline("interleaved_1f1b", 2, microbatches=8))):
            clock = StepClock()
            fit(make, data, strategy, max_steps=steps + 1, callbacks=[clock])
            times[label] = median_step(clock.marks)
        times["torch.distributed.pipelining"] = torch_pipelining(make, data, steps, gpt=model == "gpt")
        base = times["plain loop"]
        return ", ".join(f"{label} {t * 1e3:.2f} ms ({t / base:.2f}x)" for label, t in times.items())
    return check


def plain_loop(make: Callable[[], L.LightningModule], data: Callable[[], DataLoader], steps: int) -> float:
    torch.manual_seed(0)
    module = make().to(S.device)

    def step(index: int, batch: Any) -> None:
        batch = [t.to(S.device) for t in batch] if isinstance(batch, list) else batch.to(S.device)
        module.training_step(batch, index).backward()

    return timed_loop(data(), steps, step, module.configure_optimizers())


def timed_loop(batches: DataLoader, steps: int, step: Callable[[int, Any], None], optimizer: Any) -> float:
    """The median step of a plain loop: the clock read at the top of every iteration, after the device's queue."""
    marks = []
    for index, batch in enumerate(batches):
        synchronize()
        marks.append(time.perf_counter())
        if index == steps:
            break
        step(index, batch)
        optimizer.step()
        optimizer.zero_grad()
    return median_step(marks)


class _GPTFront(nn.Module):
    """The GPT's embeddings and first blocks: torch.distributed.pipelining's first stage."""

    def __init__(self, model: Any, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.model, self.blocks = [model], nn.ModuleList(blocks)  # (the model in a list: not a submodule)
        self.token_embedding, self.position_embedding = model.token_embedding, model.position_embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(tokens.shape[1], device=tokens.device))
        return _run_blocks(self.blocks, x)


class _GPTBack(nn.Module):
    """The GPT's last blocks, norm and head (tied to the embedding: the same weight, in this one process)."""

    def __init__(self, model: Any, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks, self.norm, self.head = nn.ModuleList(blocks), model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(_run_blocks(self.blocks, x)))


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
    for block in blocks:
        x = block(x, mask)
    return x


def torch_pipelining(make: Callable[[], L.LightningModule], data: Callable[[], DataLoader], steps: int,
                     gpt: bool) -> float:
    """The model split by hand into 2 stages in this one process (the MLP: input and first half, second half and
    head; the GPT: embeddings and first half, second half, norm and head), torch.distributed.pipelining's interleaved
    1F1B over 8 micro-batches, the module's own optimizer."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    module = make().to(S.device)
    half = len(module.blocks) // 2
    if gpt:
        parts: list[nn.Module] = [_GPTFront(module, list(module.blocks[:half])),
                                  _GPTBack(module, list(module.blocks[half:]))]

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    else:
        parts = [nn.Sequential(module.inp, *module.blocks[:half]), nn.Sequential(*module.blocks[half:], module.head)]
        loss_fn = F.mse_loss
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo" if S.cpu else "nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=None if S.cpu else S.device)
    try:
        stages = [PipelineStage(part, index, 2, S.device) for index, part in enumerate(parts)]
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)

        def step(index: int, batch: Any) -> None:
            x, y = (batch[:, :-1], batch[:, 1:]) if gpt else batch
            schedule.step(x.to(S.device), target=y.to(S.device))

        return timed_loop(data(), steps, step, module.configure_optimizers())
    finally:
        if created:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------------- run
def checks() -> list[tuple[str, Callable[[], str]]]:
    found: list[tuple[str, Callable[[], str]]] = [
        (f"equal/mlp/{schedule}x{stages}", equal_check("mlp", schedule, stages))
        for schedule, stages in (("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zbv", 2), ("dualpipev", 2),
                                 ("zb_h1", 1), ("1f1b", 1))]
    found += [("equal/gpt/interleaved_1f1bx2", equal_check("gpt", "interleaved_1f1b", 2)),
              ("equal/gpt/zbvx2", equal_check("gpt", "zbv", 2)),
              ("bf16_mixed", check_bf16), ("monitor", check_monitor),
              ("generate/gpt", check_generate_gpt), ("generate/hf_gpt2", check_generate_hf),
              ("checkpoint/full", check_checkpoint("full")), ("checkpoint/sharded", check_checkpoint("sharded")),
              ("pipedream_2bw/weight_stash", check_weight_stash), ("compiled_blocks", check_compiled),
              ("timing/mlp", timing_check("mlp")), ("timing/gpt", timing_check("gpt"))]
    return found


@contextmanager
def quiet() -> Iterator[None]:
    """Lightning's and torch's chatter off: one line per check."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_pp", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with small models (CI)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all checks (default 420)")
    parser.add_argument("--grace", type=float, default=GRACE_S, help=argparse.SUPPRESS)
    parser.add_argument("-k", dest="only", default="", help="run only the checks whose name contains this")
    args = parser.parse_args(argv)

    global S
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device answers; run with --cpu for the CPU checks", flush=True)
        return 2
    S = Settings(args.cpu)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons stay tight
    torch.backends.cudnn.allow_tf32 = False
    if args.cpu:
        torch.set_num_threads(1)
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "lightning": L.__version__}
    for name in ("torchmetrics", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "absent"
    device = "cpu" if args.cpu else (f"{torch.cuda.get_device_name(0)} "
                                     f"(capability {torch.cuda.get_device_capability(0)})")
    print("VERSIONS " + " ".join(f"{k}={v}" for k, v in versions.items()), flush=True)
    print(f"DEVICE {device}", flush=True)

    try:
        import lightning_pp
    except Exception as error:  # e.g. an API this torch lacks: say which, as the one failed check
        print(f"CHECK import FAIL {type(error).__name__}: {error}", flush=True)
        print("gpu_check: 0 passed, 1 failed, 0 skipped", flush=True)
        return 1
    print(f"LIGHTNING_PP {Path(lightning_pp.__file__).parent}", flush=True)

    selected = [(name, run) for name, run in checks() if args.only in name]
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    started = time.monotonic()
    current: dict[str, Any] = {"index": 0}
    lock = threading.Lock()
    stdout = sys.stdout  # a running check's output is redirected; the report lines are not

    def report(name: str, outcome: str, detail: str) -> None:
        with lock:
            counts[outcome] += 1
            print(f"CHECK {name} {outcome} {detail}", file=stdout, flush=True)

    def summary() -> str:
        return f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"

    def watchdog() -> None:  # a check hung past the budget: report it and the rest, then end the process
        index = current["index"]
        report(selected[index][0], "FAIL", f"still running after the budget of {args.budget:g} s + {args.grace:g} s")
        for name, _ in selected[index + 1:]:
            report(name, "SKIP", "time budget spent")
        print(summary(), file=stdout, flush=True)
        os._exit(1)

    timer = threading.Timer(args.budget + args.grace, watchdog)
    timer.daemon = True
    timer.start()
    with quiet():
        for index, (name, run) in enumerate(selected):
            current["index"] = index
            if time.monotonic() - started > args.budget:
                report(name, "SKIP", "time budget spent")
                continue
            begin = time.monotonic()
            said = io.StringIO()  # what Lightning and the library print: shown only for a failed check
            try:
                with redirect_stdout(said):
                    detail = run()
            except Skip as reason:
                report(name, "SKIP", str(reason))
            except Exception as error:  # one line; the output's and the traceback's last lines go to stderr
                lines = str(error).strip().splitlines() or [""]
                report(name, "FAIL", f"{type(error).__name__}: {lines[0][:300]} ({time.monotonic() - begin:.1f} s)")
                print("".join(said.getvalue().splitlines(keepends=True)[-5:]), file=sys.stderr, end="")
                traceback.print_exc(limit=-4, file=sys.stderr)
            else:
                report(name, "PASS", f"{detail} ({time.monotonic() - begin:.1f} s)")
            finally:
                if S.device.type == "cuda":
                    torch.cuda.empty_cache()
    timer.cancel()
    print(summary(), flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
