"""``schedule="pipedream_2bw"`` on one rank: each training step runs its cut of the never-draining stream
(:mod:`lightning_pp.pipedream.stream`), keeps the weights its micro-batches still in flight will back up through, and
hands Lightning the previous batch's gradient.

Two versions of a stage's weights: the live parameters (``W_{t-1}`` during batch ``t``'s step), and, from the
optimizer step that ends batch ``t``'s step until its last backward has run (in the next step or a drain), a copy of
``W_{t-1}`` taken just before that optimizer step updated the parameters in place. The forwards of a stage with
backwards left over save, instead of its parameters (or views of them), a reference that the backward reads from the
live parameters while they still hold that batch's version and from the copy afterwards (saved-tensor hooks: autograd
saves the parameter itself, so an in-place update would otherwise reach the saved value, or be refused).

Gradients: each batch's accumulate apart from the next one's (the leftover backwards of batch ``t - 1`` into its own
buffer), and the strategy's backward hands Lightning batch ``t - 1``'s, complete by the end of step ``t`` on every
stage, so the optimizer step that ends step ``t`` applies it (the first step applies none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_pp.errors import PipelineConfigError
from lightning_pp.pipedream.stream import StreamCuts
from lightning_pp.runtime.executor import StageRun
from lightning_pp.schedule.actions import Action, ActionType, Schedule

__all__ = ["DelayedUpdates", "SigtermAtNextStep", "refuse_accumulation", "refuse_for_delayed_updates"]

_Grads = dict[torch.nn.Parameter, Tensor | None]


class _Version:
    """The weights one batch's passes use: the live parameters' storages until :meth:`keep` copies them (before the
    optimizer step that updates them in place while that batch's backwards are still to come). Kept per storage, so
    parameters sharing one (views of a fused tensor) or starting inside one are read back where they lie."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.storages = {ptr: p.untyped_storage() for p in params
                         if p.numel() and (ptr := p.untyped_storage().data_ptr())}
        self.kept: dict[int, torch.UntypedStorage] | None = None

    def keep(self) -> int:
        """Copy the weights; returns the copy's bytes."""
        self.kept = {ptr: storage.clone() for ptr, storage in self.storages.items()}
        return sum(storage.nbytes() for storage in self.kept.values())

    def pack(self, tensor: Tensor) -> Any:
        """What a forward saves: for a parameter or a view of one, where to find it later."""
        if not tensor.numel() or tensor.is_conj() or tensor.is_neg():  # (a lazy view's bit is not in its storage)
            return tensor
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass, a nested tensor)
            return tensor
        if ptr not in self.storages:
            return tensor
        return self, ptr, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()

    def read(self, ptr: int, dtype: torch.dtype, size: Any, stride: Any, offset: int) -> Tensor:
        """The tensor at ``offset`` (size, stride, dtype) of this version's storage ``ptr``."""
        storage = self.kept[ptr] if self.kept is not None else self.storages[ptr]
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)

    @staticmethod
    def unpack(saved: Any) -> Tensor:
        if not (isinstance(saved, tuple) and saved and isinstance(saved[0], _Version)):
            return saved  # type: ignore[no-any-return]
        return saved[0].read(*saved[1:])

    @contextmanager
    def in_place(self) -> Iterator[None]:
        """The parameters hold this (kept) version meanwhile: what a leftover backward reads other than through
        autograd's saved tensors (a forward recomputed in backward, a weight a custom function keeps) is it too."""
        if self.kept is None:
            yield
            return
        live = [p.data for p in self.params]
        torch.clear_autocast_cache()  # its casts are keyed by the parameter, whatever data it holds
        try:
            for p in self.params:
                ptr = p.untyped_storage().data_ptr()
                if ptr in self.storages:
                    p.data = self.read(ptr, p.dtype, p.size(), p.stride(), int(p.storage_offset()))
            yield
        finally:
            for p, data in zip(self.params, live, strict=True):
                p.data = data
            torch.clear_autocast_cache()


class DelayedUpdates:
    """PipeDream-2BW's state on one rank between steps: what the stream left in flight, the version of the weights
    its backwards need, and the gradient buffers of the batches in flight (see the module's docstring)."""

    def __init__(self, cuts: StreamCuts, position: int) -> None:
        self.cuts, self.position = cuts, position
        self.has_leftovers = cuts.leftovers(position) > 0
        self.batch = -1  # the batch of the latest step
        self.open = False  # whether the latest batch still has backwards in flight somewhere (no drain since)
        self.broken = False  # a step failed half-way: what is in flight is lost (nothing drains it)
        self.carried: StageRun | None = None
        self.previous: _Grads = {}  # the previous batch's gradients (its leftovers accumulate into them)
        self.version: _Version | None = None  # the weights the in-flight batch's forwards used
        self.last_schedule: Schedule | None = None
        # the weights trainable during the batch whose gradient the latest step handed over (some may be frozen since:
        # their gradient is still applied, so it is synchronized too)
        self.handed_weights: set[torch.nn.Parameter] = set()
        # resumed from a checkpoint: the gradient its run had not applied yet, by name, synchronized already
        self.restored: dict[str, Tensor] = {}

    def run_step(self, params: list[torch.nn.Parameter], run: Callable[..., StageRun], microbatches: int,
                 after_forwards: Callable[[], None] | None = None) -> list[tuple[torch.nn.Parameter, Tensor]]:
        """One training step of ``microbatches`` micro-batches, its gradients accumulating from ``None`` in the
        ``params`` (this rank's trainable weights): ``run(schedule, stream=, carried=, around=)`` runs this rank's
        cut, calling ``after_forwards`` once its last forward has run. Returns the gradients to hand Lightning: the
        previous batch's."""
        if microbatches != self.cuts.num_microbatches:  # every rank sees the same batch: every rank raises
            raise PipelineConfigError(
                f"schedule='pipedream_2bw' got a training batch split into {microbatches} micro-batches, not "
                f"{self.cuts.num_microbatches}: the stream runs batches of one size. Use batches of at least "
                f"{self.cuts.num_microbatches} samples (DataLoader(drop_last=True) for a short last batch).")
        self.batch += 1
        schedule = self.last_schedule = self.cuts.for_step("steady" if self.open else "first", self.batch)
        version = _Version(params) if self.has_leftovers else None
        previous_version = self.version
        m = self.cuts.num_microbatches
        current = range((self.batch % 2) * m, (self.batch % 2) * m + m)
        last_forward = [a for a in schedule.actions[self.position] if a.type is ActionType.FORWARD][-1]

        def around(action: Action) -> AbstractContextManager[Any]:
            if action.microbatch not in current:
                return self._leftover(params, previous_version)
            stack = ExitStack()
            if version is not None and action.type is ActionType.FORWARD:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(version.pack, _Version.unpack))
            if action == last_forward and after_forwards is not None:
                stack.enter_context(_then(after_forwards))
            return stack

        self.broken = True  # until the step has run
        self.carried = run(schedule, stream=True, carried=self.carried, around=around)
        self.broken = False
        handed = [(p, g) for p, g in self.previous.items() if g is not None]
        self.handed_weights = set(self.previous)
        self.previous, self.version, self.open = {p: p.grad for p in params}, version, True
        return handed

    def keep_weights(self) -> int:
        """Before the optimizer step: copy the weights the in-flight batch's leftover backwards will need; returns
        the copy's bytes."""
        return self.version.keep() if self.open and self.version is not None else 0

    def drain(self, params: list[torch.nn.Parameter], run: Callable[..., StageRun]) -> None:
        """Back up the latest batch's leftovers (every rank calls this at once: before validation, a checkpoint and
        the end of fit). Its gradient stays for the next step to hand over."""
        if not self.open or self.broken:
            return
        version = self.version
        run(self.cuts.for_step("drain", self.batch), stream=False, carried=self.carried,
            around=lambda action: self._leftover(params, version))
        self.carried, self.version, self.open = None, None, False

    @contextmanager
    def showing_latest_grads(self) -> Iterator[None]:
        """The latest batch's gradients (so far) in the weights' ``.grad`` where they have none: which weights the
        step used, for the placement of the weights outside the blocks after the first step."""
        shown = [p for p, g in self.previous.items() if p.grad is None and g is not None]
        for p in shown:
            p.grad = self.previous[p]
        try:
            yield
        finally:
            for p in shown:
                p.grad = None

    def hand_over_restored(self, module: torch.nn.Module) -> None:
        """At the first optimizer step after resuming: put the checkpoint's gradient in place of what the hand-over
        synchronized (nothing: the resumed stream has no previous batch), as the uninterrupted run would apply it."""
        for name, p in module.named_parameters():  # frozen since the checkpoint's batch too, as the handed gradient
            if name in self.restored:
                p.grad = self.restored[name].to(device=p.device, dtype=p.dtype)
        self.restored = {}

    @contextmanager
    def _leftover(self, params: list[torch.nn.Parameter], version: _Version | None) -> Iterator[None]:
        """Run a leftover backward of the previous batch into that batch's gradients (also of weights frozen since),
        on the version of the weights its forward used."""
        frozen = [p for p in version.params if not p.requires_grad] if version is not None else []
        weights = list(dict.fromkeys([*params, *self.previous, *frozen]))
        current = {p: p.grad for p in weights}
        for p in weights:
            p.grad = self.previous.get(p)
        for p in frozen:  # trainable when the forward ran: autograd would skip their gradient now
            p.requires_grad_(True)
        try:
            with version.in_place() if version is not None else nullcontext():
                yield
        finally:
            for p in frozen:
                p.requires_grad_(False)
            for p in weights:
                self.previous[p], p.grad = p.grad, current[p]


@contextmanager
def _then(call: Callable[[], None]) -> Iterator[None]:
    """Call ``call`` once the block ran without an error."""
    yield
    call()


class SigtermAtNextStep:
    """Lightning's per-step agreement on a SIGTERM without its barrier. Lightning broadcasts, at every training step's
    start, whether global rank 0 received SIGTERM, so that every rank stops at the same step; a gloo broadcast waits
    for every rank, so the last stage, which ends a ``pipedream_2bw`` step last, would hold back the first stage's next
    forward. Here rank 0 sends its word point to point, and every rank acts on the word of the step before (Lightning's
    handler no longer broadcasts: see :func:`lightning_pp._compat.replace_sigterm_handling`). A rank that receives the
    signal still stops at the end of its step, as Lightning stops it; the word stops the others at the next step's
    start when rank 0 got the signal between two steps, else they end on the failure it reports.
    ``group``: a gloo group of every rank."""

    _TAG = 11

    def __init__(self, trainer: Any, group: Any) -> None:
        self.trainer, self.group = trainer, group
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # rank 0: the word it sent last; the others: the word they await
        self._word = torch.zeros(1, dtype=torch.int64, device="cpu")
        self._works: list[dist.Work] = []
        self._previous = False  # rank 0: its word at the previous step

    def __call__(self) -> None:
        stop = self._previous if self.rank == 0 else self._await()
        self._wait_sent()
        if self.rank == 0:
            self._previous = bool(getattr(self.trainer, "received_sigterm", False))
            self._word = torch.tensor([int(self._previous)], dtype=torch.int64, device="cpu")
            self._works = [work for peer in range(1, self.world)
                           if (work := dist.isend(self._word, peer, group=self.group, tag=self._TAG)) is not None]
        else:
            self._word = torch.zeros(1, dtype=torch.int64, device="cpu")
            work = dist.irecv(self._word, 0, group=self.group, tag=self._TAG)
            self._works = [work] if work is not None else []
        if stop:
            raise SIGTERMException

    def _await(self) -> bool:
        """The word of the step before (False at the first step)."""
        if not self._works:
            return False
        self._works.pop().wait()
        return bool(self._word.item())

    def _wait_sent(self) -> None:
        """Rank 0: the previous step's words have left (every rank posted its receive at that step's start)."""
        for work in self._works:
            work.wait()
        self._works = []

    def finish(self) -> None:
        """At the end of training: complete the last step's word (every rank is past that step's start)."""
        if self.rank == 0:
            self._wait_sent()
        else:
            self._await()


def refuse_accumulation(accumulation: int) -> None:
    """Accumulated batches, refused alike on every rank (at setup, and at each step: a scheduler may raise the
    count): each optimizer step applies one batch's gradient, one step late."""
    if accumulation != 1:
        raise PipelineConfigError(
            f"schedule='pipedream_2bw' with accumulate_grad_batches={accumulation}: each optimizer step applies one "
            f"batch's gradient (the previous batch's). Use larger batches instead, or a synchronous schedule "
            f"(schedule='1f1b').")


def refuse_for_delayed_updates(trainer: Any) -> None:
    """What ``pipedream_2bw`` cannot run, refused alike on every rank: accumulated batches and a loss scaler (fp16:
    skipping a step would leave two versions apart)."""
    refuse_accumulation(trainer.accumulate_grad_batches)
    if str(trainer.precision) in ("16-mixed", "16"):
        raise PipelineConfigError(
            f"schedule='pipedream_2bw' with precision={trainer.precision!r}: a loss scaler skips optimizer steps, "
            f"which the delayed update does not follow. Use precision='bf16-mixed' or '32-true', or a synchronous "
            f"schedule (schedule='1f1b').")
