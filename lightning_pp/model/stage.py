"""One stage's view of the block container: its own blocks stay, every other block becomes a weightless stand-in.

Every stage runs the user's whole step, so whatever the blocks need besides the hidden state (masks, rotary tables,
position ids) is computed where it is used. Inside a pipelined step:

- a stand-in (a block held by another stage) does not compute: it returns what the previous stage sent, i.e. the
  output of the block just before this stage's first one. The user's loop hands it on as it would that block's output,
  so this stage's first block receives it in place of its input, whatever the loop does in between;
- right after this stage's last block returns, a non-last stage (and, in evaluation, the last stage too) stops the
  step by raising :class:`StageOutput` with that block's output, which is what travels on.

Blocks keep their container, names and positions, so the model's own forward works unchanged whether it calls a
Sequential, loops, enumerates, slices or takes ``len()``, and state-dict keys keep their full-model names.
"""

from __future__ import annotations

import copy
import enum
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.eager import CacheMirror, EagerLink, cache_of
from lightning_pp.model.sides import SideOutputs, Sides, not_ours, ours, split_sides
from lightning_pp.runtime.remote import marked_remote, remote_placeholder
from lightning_pp.runtime.wire import map_tensors

__all__ = ["Mode", "SeveralPasses", "StageOutput", "StageView", "meta_twin"]


class StageOutput(BaseException):  # a control-flow signal, not an error
    """Raised after the stage's last block to end the user's step with that block's output and the side outputs
    recorded inside this and earlier stages' blocks (see :mod:`lightning_pp.model.sides`).

    A BaseException, so that an ``except Exception`` in the user's code cannot swallow it.
    """

    def __init__(self, output: Any, sides: Sides) -> None:
        super().__init__()
        self.output = output
        self.sides = sides


def _holds_objects(value: Any) -> bool:
    """Whether ``value`` (a call's arguments) holds something besides tensors, plain values and their containers."""
    if isinstance(value, (tuple, list)):
        return any(_holds_objects(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_objects(v) for v in value.values())
    return not isinstance(value, (torch.Tensor, type(None), bool, int, float, str))


def _on_meta(value: Any) -> Any:
    """``value`` with its tensors as plain meta tensors, everything else (a cache) as it is."""
    return _compat.tree_map_tensors(value, lambda t: t.detach().as_subclass(torch.Tensor).to("meta"))


def _fresh(received: Any) -> Any:
    """``received`` with a fresh tensor for each that needs gradients (not the received leaf itself)."""
    return map_tensors(received, lambda t: t.clone() if t.requires_grad else t)


class SeveralPasses(BaseException):  # a control-flow signal, not an error
    """Raised when the step run on the whole batch on the last stage passes through the blocks a second time
    (generation): the step then runs again, eagerly, on every stage (see :mod:`lightning_pp.model.eager`)."""


def _by_block(sides: Sides) -> dict[int, Sides]:
    grouped: dict[int, Sides] = {}
    for record in sides:
        grouped.setdefault(record[0], []).append(record)
    return grouped


class Mode(enum.Enum):
    OFF = "off"  # outside a pipelined step: eager passes while a run is connected (see model/eager.py), else refused
    MICROBATCH = "microbatch"  # one micro-batch through this stage's blocks
    FINISH = "finish"  # evaluation on the last stage: every block returns the joined output of all micro-batches
    EAGER = "eager"  # a step whose passes run now, on the whole batch, every rank in step (see model/eager.py)


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose weights, buffers and other tensor attributes live on the meta device (nothing real
    is copied): the module's structure and metadata without its memory, and without its hooks."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in module.modules():
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
            elif name.endswith("hooks") and isinstance(value, dict):  # a hook's closure may hold anything: not copied
                memo[id(value)] = type(value)()
    return copy.deepcopy(module, memo)


def _weightless_twin_or_none(block: nn.Module) -> nn.Module | None:
    """A meta copy of ``block`` whose weights and buffers are plain attributes, not registered: readable as the
    block's are (``q_proj.weight.dtype``), yet nothing in the module's parameters, buffers or state dict. None for a
    block that cannot be copied (it holds a lock, say): its attributes are not readable then."""
    try:
        twin = meta_twin(block)
    except Exception:
        return None
    for module in twin.modules():
        _compat.unregister_tensors(module)
    return twin


@dataclass(frozen=True)
class _Elsewhere:
    """A stand-in's state: block ``index`` of the view's container, held by stage ``owner``, and what answers for its
    attributes here (``twin``)."""

    view: StageView
    index: int
    owner: int
    block_type: str
    twin: nn.Module | None


class _StandIn(nn.Module):
    """Takes the place of a block held by another stage: no weights, no compute. Reading an attribute reads it from
    ``twin``, because a model's loop may inspect its blocks: PyTorch's ``nn.TransformerEncoder`` reads
    ``layers[0].self_attn.batch_first`` and the first layer's weights to choose its fast path, Hugging Face decoders a
    layer's ``attention_type``. The twin is the block itself where this rank holds it, else a weightless meta-device
    copy (its submodules and settings, its weights as unregistered meta tensors); ``None`` for a block that cannot be
    copied. The twin's submodules are the stand-in's own, so that a model installing hooks on its blocks' submodules
    installs them here too (see :mod:`lightning_pp.model.sides`); for the same reason ``isinstance`` sees the
    block's class (the model's own: not the class FSDP2 made of it, so that FSDP does not take the stand-in for one of
    its units), and the stand-in of a block this rank holds shares that block's hooks."""

    def __init__(self, block: nn.Module, index: int, owner: int, view: StageView, twin: nn.Module | None) -> None:
        super().__init__()
        self.__dict__["_pipeline"] = _Elsewhere(view, index, owner, type(block).__name__, None)
        self.__dict__["_block_class"] = _compat.unsharded_class(type(block))
        for name, child in twin.named_children() if twin is not None else []:
            self.add_module(name, child)
        if twin is block:
            _compat.share_forward_hooks(block, self)
        elif twin is not None:  # hooks the block and its submodules had (a meta copy has none): the same functions
            for path, module in block.named_modules():
                _compat.copy_forward_hooks(module, self if not path else twin.get_submodule(path), keep=not_ours)
        self.__dict__["_pipeline"] = _Elsewhere(view, index, owner, type(block).__name__, twin)

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickled as what it is, not as the class it shows
        return _new_stand_in, (), self.__getstate__()

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # what `isinstance` checks after the type: the block's class
        return self.__dict__["_block_class"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        held: _Elsewhere = self.__dict__["_pipeline"]
        if held.view.eager_now():
            return held.view.eager_stand_in(held.index, held.owner, self, args, kwargs)
        return held.view.stand_in_output(held.index, held.owner, self)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            held: _Elsewhere = self.__dict__["_pipeline"]
            if held.twin is not None and name != "forward" and hasattr(held.twin, name):
                return getattr(held.twin, name)
            raise AttributeError(
                f"Block {held.index} of `{held.view.container_name}` ({held.block_type}) is held by pipeline stage "
                f"{held.owner}; this is stage {held.view.stage}, where it is a weightless stand-in without `{name}`."
            ) from None

    def extra_repr(self) -> str:
        held: _Elsewhere = self.__dict__["_pipeline"]
        return f"{held.block_type} on stage {held.owner}"


def _new_stand_in() -> _StandIn:
    return _StandIn.__new__(_StandIn)


class _Recomputed:
    """A block's forward whose activations are recomputed in backward (see :meth:`StageView.checkpoint_blocks`)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


class StageView:
    """Installs and drives the stand-ins and the hooks of one rank, which holds ``stages`` (``ranges[s]`` are the blocks
    of stage ``s``). A pass runs one of them, :attr:`stage`: the blocks of the rank's other stages are stand-ins then.
    """

    def __init__(self, container_name: str, container: nn.Module, stages: Sequence[int], ranges: list[range]) -> None:
        self.container_name = container_name
        self.container = container
        self.stages = tuple(stages)
        self.stage = self.stages[0]  # the stage the current (or next) pass runs
        self.ranges = ranges
        self.num_stages = len(ranges)
        self.mode = Mode.OFF
        self.stop_after_blocks = False  # set per pass: end the step after this stage's last block
        self.last_block_calls = 0  # how often this stage's last block ran in the current pass
        # called when this stage's first block is about to run in a micro-batch pass (where its own randomness starts)
        self.on_blocks_start: Callable[[], None] | None = None
        # entered around each micro-batch pass of the user's step (the weight placement's observation)
        self.pass_context: Callable[[], AbstractContextManager[Any]] = nullcontext
        self._received: Any = None  # what the previous stage sent (micro-batch) or the joined output (finish)
        self._handed: Any = None  # the received structure as handed to the blocks (cloned once per micro-batch)
        self.placeholders: list[torch.Tensor] = []  # what stood in for other stages' DTensor outputs in this pass
        self.sides = SideOutputs()  # the outputs that hooks inside this stage's blocks record
        self._received_sides: Sides = []  # what the blocks of earlier stages recorded, as received
        self._sides_of: dict[int, Sides] = {}  # those records by block, until its stand-in replays them
        self._boundary_output: Any = None  # the received activation: the output of the block before this stage's
        # passes outside the pipelined micro-batches (see model/eager.py): the link over the pipeline (None: one
        # stage), each stage's rank, the passes made outside the steps since the last pipelined one, and the passes
        # of the step the last stage finishes on the whole batch
        self.eager: EagerLink | None = None
        self.rank_of: Callable[[int], int] = int  # set with the link
        self.passes_at_rest = 0
        self._finish_passes = 0
        self.mirror = CacheMirror()  # a cache the blocks are handed, mirrored where they are stand-ins
        self.keys = _compat.child_names(container)
        owner = {i: s for s, blocks in enumerate(ranges) for i in blocks}
        self._local_blocks: dict[str, nn.Module] = {}
        self._stand_ins: dict[str, _StandIn] = {}  # for this rank's own blocks, when a pass or the finish needs them
        for i, key in enumerate(self.keys):
            block = getattr(container, key)
            if owner[i] in self.stages:
                self._local_blocks[key] = block
                self._stand_ins[key] = _StandIn(block, i, owner[i], self, twin=block)
            else:
                container.register_module(key, _StandIn(block, i, owner[i], self, twin=_weightless_twin_or_none(block)))
        for stage in self.stages:
            first, last = self._block(ranges[stage][0]), self._block(ranges[stage][-1])
            first.register_forward_pre_hook(ours(functools.partial(self._before_first_block, stage)))
            first.register_forward_pre_hook(ours(functools.partial(self._eager_before_first_block, stage)),
                                            with_kwargs=True)
            last.register_forward_hook(ours(functools.partial(self._after_last_block, stage)))

    @property
    def local(self) -> range:
        """The blocks of the stage the current pass runs."""
        return self.ranges[self.stage]

    def checkpoint_blocks(self, every: int) -> None:
        """Recompute the activations of every ``every``-th block of the container (this rank's) in backward instead
        of keeping them, with ``torch.utils.checkpoint`` (non-reentrant; the random state is restored for the
        recompute, so dropout draws the same masks). Only when gradients are on: evaluation runs blocks as they are."""
        for index in range(0, len(self.keys), every):
            block = self._local_blocks.get(self.keys[index])
            if block is not None and not isinstance(block.forward, _Recomputed):
                block.forward = _Recomputed(block.forward)  # type: ignore[method-assign]

    def blocks_of(self, stage: int) -> list[nn.Module]:
        """The real blocks of ``stage``, one of this rank's."""
        return [self._block(i) for i in self.ranges[stage]]

    def _block(self, index: int) -> nn.Module:
        return self._local_blocks[self.keys[index]]

    def local_blocks(self) -> list[nn.Module]:
        return list(self._local_blocks.values())

    def named_local_blocks(self) -> list[tuple[str, nn.Module]]:
        """This rank's blocks with their names in the whole model."""
        return [(f"{self.container_name}.{key}", block) for key, block in self._local_blocks.items()]

    def eager_now(self) -> bool:
        """Whether a pass through the blocks runs eagerly now: in an eager step, or outside the pipelined steps when
        there are several stages (a hook generating text)."""
        return self.eager is not None and (self.mode is Mode.EAGER or self.mode is Mode.OFF)

    def sharing_outputs(self) -> EagerLink | None:
        """The link over which modules outside the blocks share their outputs now: within an eager pass (a step's,
        or outside the steps once a pass has run there), else None."""
        if self.eager is not None and (self.mode is Mode.EAGER or (self.mode is Mode.OFF and self.passes_at_rest)):
            return self.eager
        return None

    def eager_stand_in(self, index: int, owner: int, stand_in: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """What the stand-in of block ``index`` (held by stage ``owner``) returns in an eager pass: where the block ends
        that stage, its output as that stage sent it to this rank (the next stage's; every rank the last stage's);
        else zeros, marked, of its input's shape (of its output's, where its copy ran).
        A cache it is handed advances by the description the owner's output brings (see
        :mod:`lightning_pp.model.eager`); a cache of another kind by running the block's weightless copy on the meta
        device, so that it changes as on one device (its length)."""
        link = self.eager
        assert link is not None
        if link.replay:
            cache, mirrored = None, not _holds_objects((args, kwargs))
        else:
            cache, mirrored = cache_of(args, kwargs, index)
        shapes = None
        if not mirrored:
            twin = stand_in.__dict__["_pipeline"].twin
            if twin is None:
                raise PipelineConfigError(
                    f"Block {index} of `{self.container_name}` (held by stage {owner}) could not be copied, so a pass "
                    f"through the blocks outside the pipelined micro-batches (generation) cannot advance the state it "
                    f"is given here.")
            with torch.no_grad():
                shapes = twin(*_on_meta(args), **_on_meta(kwargs))
        if index == self.ranges[owner][-1]:
            what = f"the output of stage {owner}"
            last = owner == self.num_stages - 1
            if link.replay or last or owner + 1 in self.stages:
                if link.replay:
                    output, carried = link.broadcast_noted(None, self.rank_of(owner), what)
                else:
                    output, carried = link.recv(self.rank_of(owner), what)
                self.mirror.arrived(carried, cache)
                if last:
                    self.mirror.reset()
                self._count_pass(index)
                return output
        if shapes is None:  # what the loop hands on is ignored by the next stand-in: the input's shape will do
            shapes = args[0] if args else next(iter(kwargs.values()))
        device = link.device
        return map_tensors(shapes, lambda t: marked_remote(torch.zeros(t.shape, dtype=t.dtype, device=device)))

    def _count_pass(self, index: int) -> None:
        if index == len(self.keys) - 1 and self.mode is Mode.OFF:
            self.passes_at_rest += 1

    def stand_in_output(self, index: int, owner: int, stand_in: nn.Module) -> Any:
        """What the stand-in of block ``index`` returns: the received activation where it is that block's output
        (the block just before this stage's own, or in the finish the container's last), else marked
        (:class:`RemoteBlockOutput`). First, the hooks inside it get what the block's submodules recorded."""
        if self.mode is Mode.OFF:
            raise PipelineConfigError(
                f"Block {index} of `{self.container_name}` is held by pipeline stage {owner} (this is stage "
                f"{self.stage}): the blocks run only while a Trainer runs the module with PipelineParallelStrategy "
                f"(in its steps and hooks, on every rank), not after `fit`, `validate`, `test` or `predict` has "
                f"returned. Run the code in a hook (on_validation_epoch_end, on_train_end), or load the checkpoint "
                f"into the module on one device. (Where the module sets `example_input_array`, the pass Lightning's "
                f"model summary makes on it when fit starts is skipped for you; other code running the module on it, "
                f"such as `to_onnx`, cannot run pipelined.)"
            )
        if self._received is None:
            raise PipelineConfigError(
                f"Block {index} of `{self.container_name}` (held by stage {owner}) was called on stage {self.stage} "
                f"after this stage's own blocks; the step must run the blocks once, in order."
            )
        recorded = SideOutputs.replay(stand_in, self._sides_of.pop(index, []))
        if self._handed is None:
            # a fresh tensor, not the received leaf itself: the first block may work in place (ReLU(inplace=True))
            self._handed = _fresh(self._received)
        if index == (len(self.keys) - 1 if self.mode is Mode.FINISH else self.local.start - 1):
            if self.mode is Mode.FINISH:
                self._finish_passes += 1
                if self._finish_passes > 1:
                    raise SeveralPasses()
            return self._handed
        return _fresh(recorded) if recorded is not None else map_tensors(self._handed, self._remote)

    def _remote(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return marked_remote(t)
        placeholder = remote_placeholder(t)  # a DTensor cannot be marked: see StepDriver's first-step check
        self.placeholders.append(placeholder)
        return placeholder

    def _before_first_block(self, stage: int, module: nn.Module, args: Any) -> None:
        if self.mode is Mode.MICROBATCH and stage == self.stage:
            self._received = None  # stand-ins after this point mean the step runs the blocks out of order
            self.sides.start((i, self._block(i)) for i in self.ranges[stage])
            if self.on_blocks_start is not None:
                self.on_blocks_start()

    def _eager_before_first_block(self, stage: int, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.eager_now() and not self.eager.replay:  # type: ignore[union-attr]
            cache, mirrored = cache_of(args, kwargs, self.ranges[stage][0])
            self.mirror.before_blocks(cache if mirrored else None)

    def _after_last_block(self, stage: int, module: nn.Module, args: Any, output: Any) -> None:
        if self.eager_now():
            link, what = self.eager, f"the output of stage {stage}"
            assert link is not None
            self.mirror.after_blocks()
            if link.replay:
                link.broadcast_noted(output, self.rank_of(stage), what)
            elif stage == self.num_stages - 1:
                # to every rank, the code after the blocks runs everywhere: the first stage's first, which goes on with
                # the next pass's blocks while the others run that code up to their stand-ins
                here = self.rank_of(stage)
                ranks = dict.fromkeys(self.rank_of(s) for s in range(self.num_stages))
                link.send(output, [rank for rank in ranks if rank != here], what, self.mirror.carried, wait=True)
                self.mirror.reset()
            elif stage + 1 not in self.stages:  # else this rank's next stage runs on with it
                link.send(output, [self.rank_of(stage + 1)], what, self.mirror.carried)
            self._count_pass(self.ranges[stage][-1])
            return
        if self.mode is not Mode.MICROBATCH or stage != self.stage:
            return
        self.last_block_calls += 1
        if self.last_block_calls > 1:
            raise PipelineConfigError(
                f"The step ran block {self.local[-1]} of `{self.container_name}` twice; a pipelined step must run the "
                f"blocks once per micro-batch (one pass through `{self.container_name}`)."
            )
        if self.stop_after_blocks:
            raise StageOutput(output, self._carried_sides())

    def _carried_sides(self) -> Sides:
        """The records that go on with this stage's output: the earlier stages', the received activation as the
        record of the block it is the output of (where that block's output is recorded), and this stage's own, but
        for its last block's output, which travels anyway."""
        carried = [[i, path, _fresh(value)] for i, path, value in self._received_sides]
        boundary = self.local.start - 1
        if boundary >= 0 and self.sides.records_output(getattr(self.container, self.keys[boundary])):
            carried.append([boundary, "", _fresh(self._boundary_output)])
        return carried + [record for record in self.sides.stop() if record[:2] != [self.local[-1], ""]]

    @contextmanager
    def microbatch(self, stage: int, received: Any, stop_after_blocks: bool) -> Iterator[None]:
        """Run the user's step for one micro-batch through ``stage``: stand-ins hand on ``received``."""
        others = [key for other in self.stages if other != stage for key in (self.keys[i] for i in self.ranges[other])]
        self._swap(others, to_stand_ins=True)
        self.stage = stage
        received, self._received_sides = split_sides(received)
        self._boundary_output = received
        self._sides_of = _by_block(self._received_sides)
        self.mode, self._received, self._handed = Mode.MICROBATCH, received, None
        self.placeholders = []
        self.stop_after_blocks, self.last_block_calls = stop_after_blocks, 0
        self.passes_at_rest = 0
        try:
            with self.pass_context():
                yield
        finally:
            self.mode, self._received, self._handed = Mode.OFF, None, None
            self._received_sides, self._sides_of, self._boundary_output = [], {}, None
            self.sides.stop()
            self._swap(others, to_stand_ins=False)

    @contextmanager
    def eager_step(self) -> Iterator[None]:
        """Run a step's passes through the blocks eagerly (see :mod:`lightning_pp.model.eager`)."""
        self.mode, self.passes_at_rest = Mode.EAGER, 0
        self.mirror.reset()
        try:
            yield
        finally:
            self.mode = Mode.OFF

    @contextmanager
    def finishing(self, joined: Any, sides: Sides) -> Iterator[None]:
        """Run the user's step once on the whole batch: every block, this rank's too, returns ``joined``, and the
        hooks inside the blocks get ``sides``, every block's records joined over the micro-batches."""
        self._swap(list(self._local_blocks), to_stand_ins=True)
        self.mode, self._received, self._handed = Mode.FINISH, joined, joined
        self._sides_of = _by_block(sides)
        self._finish_passes, self.passes_at_rest = 0, 0
        try:
            yield
        finally:
            self.mode, self._received, self._handed = Mode.OFF, None, None
            self._sides_of = {}
            self._swap(list(self._local_blocks), to_stand_ins=False)

    def _swap(self, keys: list[str], to_stand_ins: bool) -> None:
        for key in keys:
            if to_stand_ins:  # in train or eval mode as the block is (the model may read it: `layers[0].training`)
                self._stand_ins[key].training = self._local_blocks[key].training  # not its submodules: the block's
            self.container.register_module(key, self._stand_ins[key] if to_stand_ins else self._local_blocks[key])
