"""What a pipelined step's last stage hands the pipeline's other stages, so that every stage returns what one device
returns: the loss, the ``self.log`` calls, and the step's outputs where something reads them.

Numbers travel in one fixed-size float64 message: the training loss, flags, and the first :data:`_INLINE` logged
numbers (more numbers follow in a second tensor). On gloo the other stages post its receive when their step starts
(:meth:`ResultExchange.expect`) and the last stage sends it point to point, so the first stage, which finishes the step
last, finds it waiting instead of meeting the source in a broadcast; elsewhere (NCCL, where a receive posted early
would hold back the collectives queued behind it) it is broadcast. Outputs (what an evaluation or predict step
returned, the other entries of a dict a training step returned) travel as tensors: their tensors packed into one byte
buffer, and their structure (containers, plain values, each tensor's dtype and shape) pickled only when it differs
from the previous step's. The names and options of the log records are likewise pickled only when they change. So a
step whose outputs look like the previous step's costs one or two messages and no pickle.

Outputs travel only when something on some stage reads them (:func:`outputs_read`): ``trainer.predict`` returning
its predictions, a prediction writer, or a batch-end hook of a callback or the LightningModule that is not one of
Lightning's callbacks known to ignore them (progress bars, checkpointing, timers, device and throughput monitors). A
stage that gets none returns ``None`` (training: the loss alone), which those hooks ignore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import (
    Callback,
    DeviceStatsMonitor,
    ModelCheckpoint,
    RichProgressBar,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
    WeightAveraging,
)
from lightning.pytorch.core.hooks import ModelHooks
from torch import Tensor

from lightning_pp._compat import tree_flatten, tree_unflatten
from lightning_pp._logs import LogRecord, RecordLayout, join_records, split_records
from lightning_pp._nccl_emulation import emulating_nccl
from lightning_pp._tree import pack, packed_size, unpack
from lightning_pp.topology import StageGroups

__all__ = ["ResultExchange", "outputs_read"]

# the fixed-size message: loss, flags, count of log numbers, then the first _INLINE of them
_INLINE = 13
_MESSAGE_LEN = 3 + _INLINE
# flags: the records' layout follows (pickled); outputs follow; their structure follows (pickled)
_LAYOUT, _OUTPUTS, _STRUCTURE, _AGAIN = 1, 2, 4, 8  # _AGAIN: the step runs again, eagerly (see model/eager.py)
_PLAIN = (type(None), bool, int, float, str)
_MESSAGE_TAG = 7  # the message's tag on gloo (the lane's results group carries no other point-to-point message)

_BATCH_END = {"training_step": "on_train_batch_end", "validation_step": "on_validation_batch_end",
              "test_step": "on_test_batch_end", "predict_step": "on_predict_batch_end"}
# where a batch-end hook defined by one of these is the callback's (or the module's), it ignores the step's outputs;
# so does one defined by a class that says so in its own body (`ignores_step_outputs = True`: PipelineMonitor), which a
# subclass overriding the hook does not inherit
_IGNORE_OUTPUTS = (Callback, ModelHooks, TQDMProgressBar, RichProgressBar, ModelCheckpoint, Timer, DeviceStatsMonitor,
                   ThroughputMonitor, WeightAveraging)


def outputs_read(trainer: pl.Trainer, step_name: str) -> bool:
    """Whether anything on this rank reads what ``step_name`` returns beyond a training loss: ``trainer.predict``'s
    returned predictions, or a batch-end hook of a callback or the LightningModule (a prediction writer's included)
    other than Lightning's own callbacks that ignore it."""
    if step_name == "predict_step" and trainer.predict_loop.return_predictions:
        return True
    hook = _BATCH_END[step_name]

    def defined_by(obj: object) -> type:
        return next(klass for klass in type(obj).__mro__ if hook in vars(klass))

    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set in Trainer.__init__
    readers = [*callbacks, trainer.lightning_module]
    return any(defined_by(obj) not in _IGNORE_OUTPUTS and not vars(defined_by(obj)).get("ignores_step_outputs", False)
               for obj in readers)


class _Slot:
    """A tensor of the outputs in their sent structure: its data is the next one in the packed buffer."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Slot) and (self.dtype, self.shape) == (other.dtype, other.shape)

    __hash__ = None  # type: ignore[assignment]


# the outputs' structure, flattened: their leaves (a _Slot for each packed tensor) and the rest's description
_Flat = tuple[list[Any], Any]


def _structure(outputs: Any) -> tuple[_Flat, list[Tensor]]:
    """``outputs`` flattened, with each dense tensor replaced by a :class:`_Slot`, and those tensors in order. Other
    tensors (sparse, subclasses) stay in the structure, on the CPU, and travel pickled, as do objects the structure
    does not look into (a dataclass and what it holds)."""
    tensors: list[Tensor] = []

    def place(leaf: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return leaf
        if type(leaf) is Tensor and leaf.layout == torch.strided and not leaf.is_quantized:
            tensors.append(leaf.detach())
            return _Slot(leaf.dtype, tuple(leaf.shape))
        return leaf.detach().cpu()

    leaves, spec = tree_flatten(outputs)
    return ([place(leaf) for leaf in leaves], spec), tensors


def _same(structure: _Flat, previous: _Flat) -> bool:
    """Whether ``structure`` is ``previous`` again: the same containers, slots and plain values (of the same types).
    Anything else (an array, an object) counts as changed, so it is sent."""
    (leaves, spec), (previous_leaves, previous_spec) = structure, previous
    return spec == previous_spec and all(
        type(a) is type(b) and isinstance(a, (_Slot, *_PLAIN)) and a == b
        for a, b in zip(leaves, previous_leaves, strict=True)
    )


@dataclass
class _Outgoing:
    """What the source sends of one step (see :meth:`ResultExchange.post`)."""

    loss: float
    layout: list[RecordLayout]
    numbers: list[float]
    flags: int
    structure: _Flat | None
    tensors: list[Tensor]
    message: Tensor


class ResultExchange:
    """Sends what a step's last stage produced to the pipeline's other stages (see the module's docstring)."""

    def __init__(self, groups: StageGroups, device: torch.device) -> None:
        self.group = groups.pipeline
        self.source = groups.last_stage_rank
        self.is_source = dist.get_rank() == self.source
        # NCCL's emulation takes the branch of a real NCCL run (see lightning_pp._nccl_emulation)
        self.on_host = dist.get_backend(self.group) == "gloo" and not emulating_nccl()
        self.device = torch.device("cpu") if self.on_host else device
        self._others = [rank for rank in dist.get_process_group_ranks(self.group) if rank != self.source]
        self._posted: tuple[Tensor, dist.Work] | None = None  # the next message's receive (gloo, not the source)
        # the previous step's record layout and output structure, the same on every stage
        self._layout: list[RecordLayout] = []
        self._structure: _Flat | None = None

    def agree(self, wanted: bool) -> bool:
        """Whether any stage of the pipeline wants something (every stage calls this)."""
        flag = torch.tensor([float(wanted)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def expect(self) -> None:
        """Post the receive of the next step's message (gloo, not on the source; call when the step starts)."""
        if self.on_host and not self.is_source and self._posted is None:
            message = torch.empty(_MESSAGE_LEN, dtype=torch.float64, device="cpu")
            work = dist.irecv(message, self.source, group=self.group, tag=_MESSAGE_TAG)
            assert work is not None  # this rank is in the group
            self._posted = message, work

    def _exchange_message(self, message: Tensor) -> Tensor:
        """The source's ``message`` as every stage receives it."""
        if not self.on_host:
            dist.broadcast(message, self.source, group=self.group)
            return message
        if self.is_source:
            works = [dist.isend(message, rank, group=self.group, tag=_MESSAGE_TAG) for rank in self._others]
            for work in works:
                assert work is not None
                work.wait()  # at once: every other stage posted its receive when its step started
            return message
        self.expect()  # (posted already, unless the step did not start through expect)
        assert self._posted is not None
        message, work = self._posted
        self._posted = None
        work.wait()
        return message

    def post(self, loss: float | None, records: list[LogRecord], outputs: Any, send_outputs: bool,
             again: bool = False) -> _Outgoing:
        """On the source: what :meth:`share` sends, its fixed-size message already on its way where it travels
        point to point (gloo); the rest follows in :meth:`share`. A step that knows its results before its schedule
        ends (``pipedream_2bw``'s last stage, after its last forward) posts them then."""
        layout, numbers = split_records(records)
        structure: _Flat | None = None
        tensors: list[Tensor] = []
        flags = (_LAYOUT if layout != self._layout else 0) | (_AGAIN if again else 0)
        if send_outputs and outputs is not None:
            structure, tensors = _structure(outputs)
            flags |= _OUTPUTS if self._structure is not None and _same(structure, self._structure) \
                else _OUTPUTS | _STRUCTURE
        head = [math.nan if loss is None else loss, float(flags), float(len(numbers)), *numbers[:_INLINE]]
        message = torch.tensor(head + [0.0] * (_MESSAGE_LEN - len(head)), dtype=torch.float64, device=self.device)
        if self.on_host:
            self._exchange_message(message)
        return _Outgoing(math.nan if loss is None else loss, layout, numbers, flags, structure, tensors, message)

    def share(self, loss: float | None, records: list[LogRecord], outputs: Any, send_outputs: bool,
              again: bool = False, posted: _Outgoing | None = None) -> tuple[float, list[LogRecord], Any, bool]:
        """On the source, send ``loss`` (``None``: no loss), ``records`` and, if ``send_outputs``, ``outputs``, or
        (``again``) that the step must run again, eagerly (or what :meth:`post` took, ``posted``); elsewhere the
        arguments are ignored (but ``send_outputs`` must be the same on every stage). Returns what the source sent,
        on every stage: the outputs are ``None`` where they were not sent."""
        if self.is_source:
            out = posted if posted is not None else self.post(loss, records, outputs, send_outputs, again)
            if not self.on_host:
                self._exchange_message(out.message)
            loss, layout, numbers, flags = out.loss, out.layout, out.numbers, out.flags
            structure, tensors, count = out.structure, out.tensors, len(out.numbers)
        else:
            values = self._exchange_message(torch.empty(_MESSAGE_LEN, dtype=torch.float64, device=self.device)
                                            ).tolist()
            loss, flags, count = values[0], int(values[1]), int(values[2])
            layout, numbers = self._layout, values[3:3 + min(count, _INLINE)]
            structure, tensors = None, []
        if count > _INLINE:
            more = (torch.tensor(numbers[_INLINE:], dtype=torch.float64, device=self.device) if self.is_source
                    else torch.empty(count - _INLINE, dtype=torch.float64, device=self.device))
            dist.broadcast(more, self.source, group=self.group)
            if not self.is_source:
                numbers += more.tolist()
        if flags & (_LAYOUT | _STRUCTURE):
            # the structure travels rebuilt, not flattened: unpickling a flattened description warns
            rebuilt = tree_unflatten(*structure) if structure is not None and flags & _STRUCTURE else None
            box = [(layout if flags & _LAYOUT else None, rebuilt)]
            dist.broadcast_object_list(box, src=self.source, group=self.group)
            sent_layout, sent_structure = box[0]
            if sent_layout is not None:
                layout = sent_layout
            if flags & _STRUCTURE:
                self._structure = structure if self.is_source else tree_flatten(sent_structure)
        self._layout = layout
        if self.is_source:
            if flags & _OUTPUTS and tensors:
                dist.broadcast(pack(tensors, self.device), self.source, group=self.group)
        else:
            outputs = self._receive_outputs() if flags & _OUTPUTS else None
        return loss, join_records(layout, numbers), outputs, bool(flags & _AGAIN)

    def _receive_outputs(self) -> Any:
        assert self._structure is not None
        leaves, spec = self._structure
        layout = [(leaf.dtype, list(leaf.shape)) for leaf in leaves if isinstance(leaf, _Slot)]
        tensors: list[Tensor] = []
        if layout:
            buffer = torch.empty(packed_size(layout), dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, self.source, group=self.group)
            # copies that own their memory: torch.save refuses tensors of several dtypes sharing one buffer
            tensors = [tensor.clone() for tensor in unpack(buffer, layout)]
        received = iter(tensors)
        return tree_unflatten([next(received) if isinstance(leaf, _Slot) else leaf for leaf in leaves], spec)
