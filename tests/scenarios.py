"""What a rank of a multi-process test does; each function returns what the test compares (saved per rank)."""

from __future__ import annotations

import os
import signal
from typing import Any

from models import fit

from lightning_pp import PipelineParallelStrategy

WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read once: Lightning's environment deletes it at teardown
# per node: torchrun sets LOCAL_WORLD_SIZE and RANK (tests/_launch.py's launch_torchrun); `launch` runs one node
DEVICES = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD_SIZE))
NUM_NODES = WORLD_SIZE // DEVICES
GLOBAL_RANK = int(os.environ.get("RANK", os.environ["LOCAL_RANK"]))


def train(model: str, trainer: dict[str, Any] | None = None, timeout: float = 60, seed_per_rank: bool = False,
          max_steps: int | None = None, max_epochs: int | None = None, batch_size: int = 8,
          ckpt_path: str | None = None, save_to: str | None = None, dirpath: str | None = None,
          fp16_scaler: bool = False, record_steps: bool = False, **strategy: Any) -> dict[str, Any]:
    """`models.fit` pipelined (``strategy``: PipelineParallelStrategy's options; ``trainer``: `fit`'s and the
    Trainer's; each rank seeded differently with ``seed_per_rank``): this rank's result."""
    if isinstance(strategy.get("microbatch_weight"), str):  # named: a function cannot travel in the job's JSON
        import real_models

        strategy["microbatch_weight"] = getattr(real_models, strategy["microbatch_weight"])
    return _fit(model, PipelineParallelStrategy(transfer_timeout=timeout, **strategy), trainer,
                seed=7 + GLOBAL_RANK if seed_per_rank else 7, max_steps=max_steps, max_epochs=max_epochs,
                batch_size=batch_size, ckpt_path=ckpt_path, save_to=save_to, dirpath=dirpath, fp16_scaler=fp16_scaler,
                record_steps=record_steps)


def train_ddp(model: str, trainer: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """`train` with Lightning's own ``strategy="ddp"`` on every process of the job: the data-parallel reference."""
    return _fit(model, "ddp", trainer, **options)


def train_model_parallel(model: str, data_parallel_size: int, tensor_parallel_size: int,
                         trainer: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """`train` with Lightning's own ``ModelParallelStrategy``: the reference of tensor parallelism."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return _fit(model, ModelParallelStrategy(data_parallel_size=data_parallel_size,
                                             tensor_parallel_size=tensor_parallel_size), trainer, **options)


def _fit(model: str, strategy: Any, trainer: dict[str, Any] | None, **options: Any) -> dict[str, Any]:
    """`models.fit` with ``strategy`` on ``DEVICES`` processes per node and ``NUM_NODES`` nodes: its result."""
    if NUM_NODES > 1:
        options["num_nodes"] = NUM_NODES
    return fit(model, strategy, devices=DEVICES, **options, **(trainer or {})).result


def meta_memory(model: str = "wide", **strategy: Any) -> dict[str, Any]:
    """Fit ``model`` (`models.Wide` or alike) built on the meta device for one step; return how far this process's
    peak resident memory rose above its resident memory before the build by the start of training (Linux: the peak is
    reset there), the bytes of the module's tensors there, and the whole model's bytes."""
    from pathlib import Path

    import lightning as L
    from models import MODELS, make_data
    from torch.distributed.tensor import DTensor

    def resident_kib(field: str) -> int:  # VmRSS: now; VmHWM: the peak since the last reset
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
        return int(line.split()[1])

    seen: dict[str, int] = {}

    class AtTrainStart(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen["peak"] = resident_kib("VmHWM:") * 1024
            seen["held"] = sum(local.numel() * local.element_size() for t in (*pl_module.parameters(),
                                                                              *pl_module.buffers())
                               if not (local := t.to_local() if isinstance(t, DTensor) else t).is_meta)

    L.seed_everything(7, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[AtTrainStart()],
                        strategy=PipelineParallelStrategy(transfer_timeout=60, **strategy))
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the present
    before = resident_kib("VmRSS:") * 1024
    with trainer.init_module(empty_init=True):
        module = MODELS[model].build()
    whole = sum(p.numel() * p.element_size() for p in module.parameters())
    trainer.fit(module, make_data(model))
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    return {"growth": seen["peak"] - before, "held": seen["held"], "whole": whole,
            "finite": all(bool(p.isfinite().all()) for p in local)}


def fit_then_validate(model: str, timeout: float = 60, **strategy: Any) -> dict[str, Any]:
    """Fit, then ``trainer.validate`` the same module (a later run on it); return what validate returned."""
    from models import make_data

    module = fit(model, PipelineParallelStrategy(transfer_timeout=timeout, **strategy), devices=DEVICES).module
    return {"validate": module.trainer.validate(module, make_data(model, seed=99), verbose=False)}


def fit_twice(model: str, timeout: float = 60, **strategy: Any) -> dict[str, Any]:
    """Fit, then fit the same module again with a new Trainer (a later run keeps the split, the placement and the
    shards); the weights after both (sharded ones gathered, on every replica alike)."""
    import lightning as L
    from models import RecordingLogger, make_data
    from torch.distributed.tensor import DTensor

    module = fit(model, PipelineParallelStrategy(transfer_timeout=timeout, **strategy), devices=DEVICES).module
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=PipelineParallelStrategy(transfer_timeout=timeout,
                                                                                          **strategy),
                        max_steps=2, logger=RecordingLogger(), enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, make_data(model, seed=5))
    return {"state": {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                      for k, v in module.state_dict().items()}, "history": []}


def expect_error(model: str, trainer: dict[str, Any] | None = None, **strategy: Any) -> dict[str, Any]:
    """Run a configuration that must fail; return the error instead of dying, so one job checks several. Also
    whether a default process group exists after it (none does when the error came before any collective and no
    earlier run of the job created one)."""
    import torch.distributed as dist

    try:
        train(model, **strategy, trainer=trainer)
    except Exception as error:
        return {"type": type(error).__name__, "message": str(error), "process_group": dist.is_initialized()}
    return {"type": "none", "message": "no error raised", "process_group": dist.is_initialized()}


def die_at_step(model: str, rank_to_kill: int, step: int, **strategy: Any) -> dict[str, Any]:
    """Rank ``rank_to_kill`` SIGKILLs itself at the start of ``step``; the others must fail with a timeout error."""
    import lightning as L

    class Killer(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step and trainer.global_rank == rank_to_kill:
                os.kill(os.getpid(), signal.SIGKILL)

    return train(model, trainer={"callbacks": [Killer()]}, **strategy)


def hang_at_step(model: str, rank_to_hang: int, step: int, **strategy: Any) -> dict[str, Any]:
    """Rank ``rank_to_hang`` stops responding (sleeps) at ``step``, then exits once the others have failed."""
    import time

    import lightning as L

    class Sleeper(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step and trainer.global_rank == rank_to_hang:
                time.sleep(3 * strategy.get("timeout", 60))
                os._exit(3)

    return train(model, trainer={"callbacks": [Sleeper()]}, **strategy)


def stuck_at_step(model: str, rank_to_hang: int, step: int, **strategy: Any) -> dict[str, Any]:
    """Rank ``rank_to_hang`` gets stuck for good at ``step`` (ignoring SIGTERM, as Lightning's handler does)."""
    import time

    import lightning as L

    class Stuck(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == step and trainer.global_rank == rank_to_hang:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                while True:
                    time.sleep(3600)

    return train(model, trainer={"callbacks": [Stuck()]}, **strategy)


def monitored(model: str, schedule: str, microbatches: int, log_dir: str | None, max_steps: int = 3,
              timeline_every_n_steps: int = 2, timeout: float = 60, logging_interval: int = 1,
              **strategy: Any) -> dict[str, Any]:
    """Train with a PipelineMonitor measuring every ``logging_interval``-th step; return its history (rank 0) and the
    bytes of each parameter this rank's module holds after training, by name (a tied weight once)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from models import MODELS, make_data

    from lightning_pp import PipelineMonitor

    L.seed_everything(0, verbose=False)
    monitor = PipelineMonitor(logging_interval=logging_interval, timeline_every_n_steps=timeline_every_n_steps,
                              trace_dir=f"{log_dir}/traces" if log_dir else None)
    held: list[int] = []  # after each batch end: the monitor's sends of rows still held (not reaped)

    class HeldSends(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            held.append(len(monitor._sends))

    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, max_steps=max_steps, log_every_n_steps=1,
        strategy=PipelineParallelStrategy(schedule=schedule, microbatches=microbatches, transfer_timeout=timeout,
                                        **strategy),
        logger=TensorBoardLogger(log_dir, name="tb") if log_dir else False, callbacks=[monitor, HeldSends()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = MODELS[model].build()
    trainer.fit(module, make_data(model))
    optimizer = trainer.optimizers[0]
    return {"history": monitor.history, "held_sends": held,
            "param_bytes": {name: p.numel() * p.element_size() for name, p in module.named_parameters()},
            "optimizer_bytes": {name: sum(t.numel() * t.element_size() for t in optimizer.state[p].values())
                                for name, p in module.named_parameters() if p in optimizer.state}}


def save_by_hand_after_fit(save_to: str, **strategy: Any) -> dict[str, Any]:
    """`train` the MLP, then ``trainer.save_checkpoint(save_to)`` (the Trainer's own checkpointing is off, so every
    object gather and distributed-checkpoint write is the saving's): `train`'s result, and for each such call, which
    group it used (``"default"``: the default group) and that group's backend."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    used: list[tuple[str, str, str]] = []

    def described(group: Any) -> tuple[str, str]:
        return "default" if group is None or group is dist.group.WORLD else "own", str(dist.get_backend(group))

    gather, save = dist.gather_object, dcp.save

    def recording_gather(obj: Any, object_gather_list: Any = None, dst: int = 0, group: Any = None,
                         **kwargs: Any) -> Any:
        used.append(("gather_object", *described(group)))
        return gather(obj, object_gather_list, dst, group=group, **kwargs)

    def recording_save(state_dict: Any, *args: Any, process_group: Any = None, **kwargs: Any) -> Any:
        used.append(("dcp.save", *described(process_group)))
        return save(state_dict, *args, process_group=process_group, **kwargs)

    dist.gather_object, dcp.save = recording_gather, recording_save
    try:
        result = train("mlp", save_to=save_to, **strategy)
    finally:
        dist.gather_object, dcp.save = gather, save
    return {**result, "used": used}


def with_callbacks(dirpath: str, timeout: float = 60, **strategy: Any) -> dict[str, Any]:
    import models

    return models.with_callbacks(dirpath, PipelineParallelStrategy(transfer_timeout=timeout, **strategy),
                                 devices=WORLD_SIZE)


def p2p_exchange(steps: list[list[tuple[str, list[int]]]], prefetch: int = 2,
                 header_groups: bool = False, timeout: float = 30) -> list[list[Any]]:
    """Stage 0 sends each step's tensors (dtype, shape) forward, stage 1 sends them back; return what arrived.
    ``header_groups``: headers in groups of their own and batched payloads, NCCL's way (on gloo here)."""
    import torch
    import torch.distributed as dist

    from lightning_pp.runtime.p2p import StageP2P
    from lightning_pp.schedule import Action, ActionType

    stage = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=stage, world_size=WORLD_SIZE)
    headers = [dist.new_group([0, 1], backend="gloo") for _ in range(2)] if header_groups else None
    p2p = StageP2P([0, 1], torch.device("cpu"), timeout=timeout, prefetch=prefetch, header_groups=headers)
    received = []
    try:
        for step, tensors in enumerate(steps):
            made = [torch.arange(torch.Size(shape).numel()).reshape(shape).to(getattr(torch, dtype)) + step
                    for dtype, shape in tensors]
            if stage == 0:
                actions = [Action(0, ActionType.SEND_F, mb) for mb in range(len(made))]
                actions += [Action(0, ActionType.RECV_B, mb) for mb in range(len(made))]
            else:
                actions = [Action(1, ActionType.RECV_F, mb) for mb in range(len(made))]
                actions += [Action(1, ActionType.SEND_B, mb) for mb in range(len(made))]
            p2p.start_step(actions)
            arrived = []
            for action in actions:
                if action.is_send:
                    p2p.send(made[action.microbatch], action)
                else:
                    tensor = p2p.recv(action)[0]
                    p2p.flush()  # as the runtime does before computing with it
                    arrived.append(tensor.clone())
            p2p.wait_sends()
            received.append(arrived)
    finally:
        dist.destroy_process_group()
    return received


def p2p_nested(sizes: list[list[int]]) -> list[list[float]] | None:
    """Stage 0 sends a nested tensor (sequence ``i`` of shape ``sizes[i]`` filled with ``i + 7``) to stage 1 with the
    headers in groups of their own, as on NCCL (``nn.TransformerEncoder``'s evaluation); stage 1 returns each
    sequence it rebuilt, flattened."""
    import torch
    import torch.distributed as dist

    from lightning_pp.runtime.p2p import StageP2P
    from lightning_pp.schedule import Action, ActionType

    stage = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=stage, world_size=WORLD_SIZE)
    headers = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    p2p = StageP2P([0, 1], torch.device("cpu"), timeout=30, header_groups=headers)
    try:
        with torch.no_grad():
            if stage == 0:
                action = Action(0, ActionType.SEND_F, 0)
                p2p.start_step([action])
                p2p.send(torch.nested.nested_tensor([torch.full(size, i + 7.0) for i, size in enumerate(sizes)]),
                         action)
                arrived = None
            else:
                action = Action(1, ActionType.RECV_F, 0)
                p2p.start_step([action])
                nested = p2p.recv(action)[0]
                arrived = [t.flatten().tolist() for t in nested.unbind()]
                assert [list(t.shape) for t in nested.unbind()] == sizes
            p2p.wait_sends()
    finally:
        dist.destroy_process_group()
    return arrived


def payload_wait_timing(delay: float) -> list[tuple[str, str, float]]:
    """Two stages run one micro-batch of GPipe timed, with the headers in groups of their own (NCCL's protocol);
    stage 0 posts its payloads ``delay`` seconds late. Return stage 1's timed events: (action, category, seconds)."""
    import time

    import torch
    import torch.distributed as dist

    from lightning_pp.runtime.executor import HostClock, run_stage
    from lightning_pp.runtime.p2p import StageP2P
    from lightning_pp.schedule import build_schedule
    from lightning_pp.schedule.simulate import TimelineEvent

    stage = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=stage, world_size=WORLD_SIZE)
    headers = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    p2p = StageP2P([0, 1], torch.device("cpu"), timeout=30, header_groups=headers)
    if stage == 0:  # the header leaves at once; the payload only when the batch is flushed, late
        flush = p2p.flush

        def late_flush() -> Any:
            time.sleep(delay)
            return flush()

        p2p.flush = late_flush  # type: ignore[method-assign]
    weight = torch.ones(4, requires_grad=True)
    events: list[TimelineEvent] = []
    try:
        run_stage(build_schedule("gpipe", 2, 1), stage,
                  lambda s, mb, received: weight * 2 if s == 0 else (received * weight).sum(), p2p, training=True,
                  events=events, clock=HostClock())
    finally:
        dist.destroy_process_group()
    return [(str(e.action), e.category, e.end - e.start) for e in events]


def ignore_sigterm_forever(pid_dir: str) -> None:
    """Ignore SIGTERM, start a child that does too, write both pids to ``pid_dir``, then sleep until killed."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(3600)"])
    path = Path(pid_dir) / f"rank{GLOBAL_RANK}.pids"
    path.with_suffix(".tmp").write_text(f"{os.getpid()} {child.pid}")
    path.with_suffix(".tmp").rename(path)  # whole or absent for a reader
    while True:
        time.sleep(3600)


def result_exchange(steps: int, host_group: bool = False) -> list[dict[str, Any]]:
    """The pipeline's last stage (rank 1) sends ``models.step_outputs(step)`` for each step, and 20 logged numbers;
    every other step without outputs. Return, per step, what arrived, how many pickles it took on this rank and how
    many collectives. ``host_group``: the results' gloo group made apart, as connect_stages makes it on NCCL."""
    import pickle
    from collections.abc import Callable
    from types import SimpleNamespace

    import torch.distributed as dist
    from models import step_outputs

    from lightning_pp.model import results
    from lightning_pp.parallel.topology import PipelineLayout, create_groups

    dist.init_process_group("gloo", rank=GLOBAL_RANK, world_size=WORLD_SIZE)
    pickled = 0

    def counting(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def counted(obj: Any) -> Any:
            nonlocal pickled
            pickled += 1
            return real(obj)
        return counted

    collectives = 0

    def collective(*args: Any, **kwargs: Any) -> None:
        nonlocal collectives
        collectives += 1
        raise AssertionError("a collective in the results' exchange: every stage would wait for the last one")

    # the source pickles (dumps) what the others unpickle (loads): each side counts its own
    results.pickle = SimpleNamespace(dumps=counting(pickle.dumps), loads=counting(pickle.loads))  # type: ignore
    real_dist = results.dist
    try:
        layout, new_group = PipelineLayout(WORLD_SIZE, 1), lambda ranks: dist.new_group(ranks)
        groups = create_groups(layout, GLOBAL_RANK, new_group)
        apart = create_groups(layout, GLOBAL_RANK, new_group).pipeline if host_group else None
        exchange = results.ResultExchange(groups, apart)
        results.dist = SimpleNamespace(  # type: ignore[attr-defined]
            **{name: getattr(dist, name) for name in ("isend", "irecv", "recv", "Work")},
            broadcast=collective, broadcast_object_list=collective, all_reduce=collective)
        arrived = []
        for step in range(steps):
            for send in (True, False):
                pickled = 0
                records: list[Any] = [(f"m{i}", float(step + i), {"prog_bar": i == 0}) for i in range(20)]
                loss, logged, outputs, _ = exchange.share(0.5 + step, records, step_outputs(step), send)
                arrived.append({"loss": loss, "logged": logged, "outputs": outputs, "pickled": pickled,
                                "collectives": collectives})
    finally:
        results.pickle, results.dist = pickle, real_dist  # type: ignore[attr-defined]
        dist.destroy_process_group()
    return arrived


def model_summary(model: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Fit ``model`` for a step with Lightning's model summary on; what it printed on this rank (global rank 0)."""
    from support import summarized

    return summarized(lambda **kwargs: fit(model, PipelineParallelStrategy(schedule="1f1b"), devices=WORLD_SIZE,
                                           max_steps=1, enable_model_summary=True, **kwargs))


def sigterm_words(signal_at: int, steps: int) -> int | None:
    """``pipedream_2bw``'s SIGTERM agreement (``SigtermAtNextStep``) over ``steps`` step starts: global rank 0 gets the
    signal before step ``signal_at``'s start; returns the step at whose start this rank stopped (None: it did not)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_pp.pipedream.step import SigtermAtNextStep

    dist.init_process_group("gloo", rank=GLOBAL_RANK, world_size=WORLD_SIZE)
    trainer = SimpleNamespace(received_sigterm=False)
    agree = SigtermAtNextStep(trainer, None)
    try:
        for step in range(steps):
            trainer.received_sigterm = GLOBAL_RANK == 0 and step >= signal_at
            try:
                agree()
            except SIGTERMException:
                return step
        agree.finish()
        return None
    finally:
        dist.destroy_process_group()


def sigterm_during_fit(model: str, step: int, **strategy: Any) -> dict[str, Any]:
    """Train; global rank 0 receives a real SIGTERM as step ``step`` starts. Returns how this rank's fit ended."""
    import lightning as L

    class Signal(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            if trainer.global_rank == 0 and trainer.global_step == step:
                os.kill(os.getpid(), signal.SIGTERM)

    try:
        train(model, max_steps=12, trainer={"callbacks": [Signal()]}, **strategy)
    except BaseException as error:  # SIGTERMException is a SystemExit
        return {"type": type(error).__name__, "message": str(error)[:2000]}
    return {"type": "none", "message": ""}


# ------------------------------------------------------------------------------------------------ checkpoints


def die_while_saving_sharded(dirpath: str, rank_to_kill: int, at_save: int, max_epochs: int = 3,
                             **strategy: Any) -> dict[str, Any]:
    """Train the MLP by epochs with ``ModelCheckpoint(save_last=True, save_top_k=1)`` in the sharded format (each
    epoch saves ``epoch=E-step=S.ckpt``, removes the previous one and saves ``last.ckpt`` again); global rank
    ``rank_to_kill`` ends at once (``os._exit``) inside torch's distributed-checkpoint write of the ``at_save``-th
    ``last.ckpt``, before writing its shard, while the other ranks write theirs. Returns how this rank's fit ended
    (``rank_to_kill=-1``: nobody dies)."""
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint import FileSystemWriter

    write, last_saves = FileSystemWriter.write_data, []

    def dying_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(self.path).name.startswith("last.ckpt"):  # that folder, or one written beside it
            last_saves.append(str(self.path))
            if len(last_saves) == at_save and rank_to_kill == GLOBAL_RANK:
                os._exit(1)
        return write(self, *args, **kwargs)

    every_epoch = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=1, every_n_epochs=1,
                                  save_on_train_epoch_end=True)
    FileSystemWriter.write_data = dying_write  # type: ignore[method-assign]
    try:
        train("mlp", max_steps=-1, max_epochs=max_epochs, state_dict_type="sharded",
              trainer={"callbacks": [every_epoch], "enable_checkpointing": True}, **strategy)
    except BaseException as error:
        return {"type": type(error).__name__, "message": str(error)[:2000], "last_saves": last_saves}
    finally:
        FileSystemWriter.write_data = write  # type: ignore[method-assign]
    return {"type": "none", "message": "", "last_saves": last_saves}
