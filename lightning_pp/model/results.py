"""What a pipelined step's last stage hands the pipeline's other stages, so that every stage returns what one device
returns: the loss, the ``self.log`` calls, and the step's outputs where something reads them.

Everything travels point to point on the host, in a gloo group of the lane (on NCCL, and under its emulation, one
made beside the NCCL groups): numbers in one fixed-size float64 message (the training loss, flags, and the first
:data:`_INLINE` logged numbers), whose receive the other stages post when their step starts
(:meth:`ResultExchange.expect`), and what the message says follows it. The last stage sends everything at once and
waits for none of it until its next step, so no stage meets another at the step's end: the first stage, which
finishes the step last, finds it waiting, and ``pipedream_2bw``'s last stage sends it after its last forward, so
the other stages end their step without waiting for its backwards. On NCCL that also keeps the results out of the
device's queues: a broadcast on the lane's NCCL group at the step's end held the first stage until the last stage's
step ended, which, on a timed step, waited for a send the first stage receives only in its next step (a deadlock),
and ranks entered two communicators in different orders. What follows the message: logged numbers beyond the first
:data:`_INLINE`; the names and options of the log records, pickled, when they change; and outputs (what an evaluation
or predict step returned, the other entries of a dict a training step returned), as tensors packed into one byte
buffer, their structure (containers, plain values, each tensor's dtype and shape) pickled only when it differs from
the previous step's. So a step whose outputs look like the previous step's costs one or two messages and no pickle.

Outputs travel only when something on some stage reads them (:func:`outputs_read`): ``trainer.predict`` returning
its predictions, a prediction writer, or a batch-end hook of a callback or the LightningModule that is not one of
Lightning's callbacks known to ignore them (progress bars, checkpointing, timers, device and throughput monitors). A
stage that gets none returns ``None`` (training: the loss alone), which those hooks ignore.
"""

from __future__ import annotations

import math
import pickle
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
from lightning_pp.model.logs import LogRecord, RecordLayout, join_records, split_records
from lightning_pp.parallel.nccl_emulation import follows_nccl
from lightning_pp.parallel.topology import StageGroups
from lightning_pp.runtime.wire import pack, packed_size, unpack

__all__ = ["ResultExchange", "outputs_read"]

# the fixed-size message: loss, flags, count of log numbers, then the first _INLINE of them
_INLINE = 13
_MESSAGE_LEN = 3 + _INLINE
# flags: the records' layout follows (pickled); outputs follow; their structure follows (pickled)
_LAYOUT, _OUTPUTS, _STRUCTURE, _AGAIN = 1, 2, 4, 8  # _AGAIN: the step runs again, eagerly (see model/eager.py)
_PLAIN = (type(None), bool, int, float, str)
# tags of the fixed-size message and of what follows it (the results' group carries no other point-to-point message)
_MESSAGE_TAG, _FOLLOWING_TAG = 7, 8

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
    """What the source sent of one step (see :meth:`ResultExchange.post`)."""

    loss: float
    layout: list[RecordLayout]
    numbers: list[float]
    flags: int
    outputs: Any


class ResultExchange:
    """Sends what a step's last stage produced to the pipeline's other stages, point to point on the host (see the
    module's docstring). ``host_group``: the lane's gloo group where ``groups.pipeline`` is not gloo (NCCL) or NCCL is
    emulated, as :attr:`~lightning_pp.runtime.p2p.StageP2P.results_group`."""

    def __init__(self, groups: StageGroups, host_group: Any = None) -> None:
        # NCCL, and its emulation (which must decide alike): not on the lane's NCCL group, where a broadcast at the
        # step's end would wait for the last stage and queue behind (or ahead of) the pipeline's pending transfers
        on_nccl = follows_nccl(groups.pipeline)
        group = host_group if on_nccl else groups.pipeline
        if group is None or dist.get_backend(group) != "gloo":
            raise ValueError(
                f"ResultExchange needs a gloo group of the lane's ranks {groups.pipeline_ranks}: the pipeline's group "
                f"is {dist.get_backend(groups.pipeline)!r} and host_group is "
                f"{'missing' if group is None else repr(dist.get_backend(group))}. Pass connect_stages(...)."
                f"results_group as host_group.")
        self.group = group
        self.source = groups.last_stage_rank
        self.is_source = dist.get_rank() == self.source
        self._others = [rank for rank in dist.get_process_group_ranks(self.group) if rank != self.source]
        self._posted: tuple[Tensor, dist.Work] | None = None  # the next message's receive (not on the source)
        # the source: what it sent and has not waited for yet (each buffer kept until its send has completed)
        self._sending: list[tuple[dist.Work, Tensor]] = []
        # the previous step's record layout and output structure, the same on every stage
        self._layout: list[RecordLayout] = []
        self._structure: _Flat | None = None

    def agree(self, wanted: bool) -> bool:
        """Whether any stage of the pipeline wants something (every stage calls this)."""
        flag = torch.tensor([float(wanted)], device="cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def expect(self) -> None:
        """Post the receive of the next step's message (not on the source; call when the step starts)."""
        if not self.is_source and self._posted is None:
            message = torch.empty(_MESSAGE_LEN, dtype=torch.float64, device="cpu")
            work = dist.irecv(message, self.source, group=self.group, tag=_MESSAGE_TAG)
            assert work is not None  # this rank is in the group
            self._posted = message, work

    def post(self, loss: float | None, records: list[LogRecord], outputs: Any, send_outputs: bool,
             again: bool = False) -> _Outgoing:
        """On the source: send what :meth:`share` returns everywhere, at once and without waiting (the sends complete
        when the other stages receive them, at the latest at their step's end). A step that knows its results before
        its schedule ends (``pipedream_2bw``'s last stage, after its last forward) posts them then, so the other stages
        end their step without waiting for the last stage's."""
        for sent, _ in self._sending:  # the previous step's: every other stage received them by its end
            sent.wait()
        layout, numbers = split_records(records)
        structure: _Flat | None = None
        tensors: list[Tensor] = []
        flags = (_LAYOUT if layout != self._layout else 0) | (_AGAIN if again else 0)
        if send_outputs and outputs is not None:
            structure, tensors = _structure(outputs)
            flags |= _OUTPUTS if self._structure is not None and _same(structure, self._structure) \
                else _OUTPUTS | _STRUCTURE
        head = [math.nan if loss is None else loss, float(flags), float(len(numbers)), *numbers[:_INLINE]]
        message = torch.tensor(head + [0.0] * (_MESSAGE_LEN - len(head)), dtype=torch.float64, device="cpu")
        buffers = [(message, _MESSAGE_TAG)]
        # what follows, in this order, where the message's flags and count say so
        if len(numbers) > _INLINE:
            buffers.append((torch.tensor(numbers[_INLINE:], dtype=torch.float64, device="cpu"), _FOLLOWING_TAG))
        if flags & (_LAYOUT | _STRUCTURE):
            # the structure travels rebuilt, not flattened: unpickling a flattened description warns
            rebuilt = tree_unflatten(*structure) if structure is not None and flags & _STRUCTURE else None
            pickled = self._pickle((layout if flags & _LAYOUT else None, rebuilt))
            buffers += [(torch.tensor([pickled.numel()], dtype=torch.int64, device="cpu"), _FOLLOWING_TAG),
                        (pickled, _FOLLOWING_TAG)]
        if flags & _OUTPUTS and tensors:
            buffers.append((pack(tensors, torch.device("cpu")), _FOLLOWING_TAG))
        self._sending = [(work, buffer) for rank in self._others for buffer, tag in buffers
                         if (work := dist.isend(buffer, rank, group=self.group, tag=tag)) is not None]
        self._layout = layout
        if flags & _STRUCTURE:
            self._structure = structure
        return _Outgoing(math.nan if loss is None else loss, layout, numbers, flags, outputs)

    @staticmethod
    def _pickle(obj: Any) -> Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    def share(self, loss: float | None, records: list[LogRecord], outputs: Any, send_outputs: bool,
              again: bool = False, posted: _Outgoing | None = None) -> tuple[float, list[LogRecord], Any, bool]:
        """On the source, send ``loss`` (``None``: no loss), ``records`` and, if ``send_outputs``, ``outputs``, or
        (``again``) that the step must run again, eagerly (unless :meth:`post` sent them already: ``posted``);
        elsewhere the arguments are ignored (but ``send_outputs`` must be the same on every stage). Returns what the
        source sent, on every stage: the outputs are ``None`` where they were not sent."""
        if self.is_source:
            out = posted if posted is not None else self.post(loss, records, outputs, send_outputs, again)
            return out.loss, join_records(out.layout, out.numbers), out.outputs, bool(out.flags & _AGAIN)
        self.expect()  # (posted already, unless the step did not start through expect)
        assert self._posted is not None
        message, work = self._posted
        self._posted = None
        work.wait()
        values = message.tolist()
        loss, flags, count = values[0], int(values[1]), int(values[2])
        numbers = values[3:3 + min(count, _INLINE)]
        if count > _INLINE:
            numbers += self._receive(torch.empty(count - _INLINE, dtype=torch.float64, device="cpu")).tolist()
        if flags & (_LAYOUT | _STRUCTURE):
            size = self._receive(torch.empty(1, dtype=torch.int64, device="cpu"))
            sent_layout, sent_structure = pickle.loads(
                self._receive(torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")).numpy().tobytes())
            if sent_layout is not None:
                self._layout = sent_layout
            if flags & _STRUCTURE:
                self._structure = tree_flatten(sent_structure)
        outputs = self._receive_outputs() if flags & _OUTPUTS else None
        return loss, join_records(self._layout, numbers), outputs, bool(flags & _AGAIN)

    def _receive(self, buffer: Tensor) -> Tensor:
        """``buffer`` filled with the source's next following message."""
        dist.recv(buffer, self.source, group=self.group, tag=_FOLLOWING_TAG)
        return buffer

    def _receive_outputs(self) -> Any:
        assert self._structure is not None
        leaves, spec = self._structure
        layout = [(leaf.dtype, list(leaf.shape)) for leaf in leaves if isinstance(leaf, _Slot)]
        tensors: list[Tensor] = []
        if layout:
            buffer = self._receive(torch.empty(packed_size(layout), dtype=torch.uint8, device="cpu"))
            # copies that own their memory: torch.save refuses tensors of several dtypes sharing one buffer
            tensors = [tensor.clone() for tensor in unpack(buffer, layout)]
        received = iter(tensors)
        return tree_unflatten([next(received) if isinstance(leaf, _Slot) else leaf for leaf in leaves], spec)
