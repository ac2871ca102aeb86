"""Weights outside the blocks, kept only on the pipeline ranks whose work uses them.

Every rank runs the user's whole step, so at first every rank holds everything outside the block container. Most of
it serves one stage: an embedding before the blocks the first, a head after them the last. Which rank uses what is
observed on the first training step (and again once frozen weights outside the blocks become trainable):

- a rank uses a trainable weight when the weight gets a gradient there;
- a weight without a gradient that the rank's step computed with, inside the module that holds it (a module before
  the blocks on a later stage, whose output the received activation replaces), is not used there: the module becomes
  a stand-in that runs it on the meta device and returns NaN (integers: zeros) of the output's shape and dtype, for
  code that reads only those (a mask built from the embeddings' shape);
- a weight the rank's step never touched is not used there: its module becomes a stand-in that raises if called;
- kept where it is, because its use cannot be observed or stood in for: frozen weights (until they become
  trainable), weights read with gradients off or by code outside their module (``F.linear(x, self.wte.weight)``),
  weights the LightningModule holds itself, modules whose forward does not run on the meta device.

A weight is then held by the ranks that use or keep it: its gradient is summed among them (and averaged over
replicas), and its optimizer state exists only there. Weights no rank used in training (an evaluation-only head) stay
everywhere. ``restore`` puts every weight back on every rank, from a rank that held it, before a later run.

With ``data_parallel_mode="fsdp"``, :meth:`WeightPlacement.shardable` then picks the placed weights that can be sharded
over the replicas like the blocks (read only inside one module's forward, on every rank holding them); those stay
placed and sharded for later runs (``restore`` leaves them), as the blocks keep their shards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_pp import _compat
from lightning_pp.errors import PipelineConfigError
from lightning_pp.model.stage import meta_twin

__all__ = ["WeightPlacement"]


# reads of a tensor's metadata (not of its values): they do not make a weight used
_METADATA_PROPERTIES = frozenset({
    "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "layout", "ndim", "grad_fn", "is_cuda", "is_meta",
    "is_sparse", "is_quantized", "is_nested", "names", "itemsize", "nbytes", "_version", "_base", "is_mps", "is_xpu",
})
_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "is_floating_point", "is_complex", "element_size", "stride", "data_ptr",
    "get_device", "untyped_storage", "is_contiguous", "storage_offset", "__len__", "__hash__", "type",
})


def _reads_values(func: Any) -> bool:
    """Whether the torch function ``func`` reads its tensor arguments' values (not just their metadata)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _METADATA_PROPERTIES
    return name not in _METADATA_METHODS


class _ReadsObserver(TorchFunctionMode):
    """Records which watched weights each torch function reads, and where."""

    def __init__(self, observation: Observation) -> None:
        super().__init__()
        self.observation = observation

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # inside code dynamo compiles (a compiled block: no weight outside the blocks is there) nothing is recorded:
        # recording would make dynamo guard on the tensors' ids and compile anew for every micro-batch
        if _reads_values(func) and not torch.compiler.is_compiling():
            self.observation.record_reads(_compat.tree_tensors((args, kwargs)))
        return func(*args, **kwargs)


@dataclass
class _Holder:
    """A module that holds weights outside the blocks directly, and where it sits in the module tree."""

    path: str
    module: nn.Module
    places: list[tuple[nn.Module, str]]  # (parent, attribute name) of every place it is registered
    paths: list[str]  # its name at each of them


@dataclass
class Observation:
    """One observed training step (or several, with gradient accumulation) of one rank."""

    weights: list[nn.Parameter]
    holders: dict[int, list[_Holder]]  # id(weight) -> the modules holding it
    # ids of the weights read outside their module, or with gradients off: a use this rank cannot stand in for
    read_elsewhere: set[int] = field(default_factory=set)
    active: dict[int, int] = field(default_factory=dict)  # id(holder module) -> calls in progress
    called: set[int] = field(default_factory=set)
    meta_inputs: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # a call's arguments, on the meta device
    output_dtypes: dict[int, list[torch.dtype]] = field(default_factory=dict)
    feeds_loss: set[int] = field(default_factory=set)  # modules whose output got a gradient: it reached the loss
    # modules called after a pass reached the block container (on the last stage: the head, the loss), whose
    # outputs the step may read by value; modules called before it compute what the received activation replaces
    after_blocks: set[int] = field(default_factory=set)
    blocks_began: bool = False  # in the current pass
    handles: list[RemovableHandle] = field(default_factory=list)

    def record_reads(self, tensors: list[Tensor]) -> None:
        """Note the watched weights among ``tensors`` (read by the torch function being called) that are read outside
        a call of a module holding them, or with gradients off."""
        for t in tensors:
            holders = self.holders.get(id(t))
            if holders is None:
                continue
            if not (torch.is_grad_enabled() and any(self.active.get(id(h.module), 0) for h in holders)):
                self.read_elsewhere.add(id(t))

    def watch(self, module: nn.Module) -> None:
        """Count the calls in progress of ``module`` (a holder), and keep its first call's inputs and output dtypes."""
        def before(m: nn.Module, args: Any, kwargs: Any) -> None:
            self.active[id(m)] = self.active.get(id(m), 0) + 1
            if self.blocks_began:
                self.after_blocks.add(id(m))
            if id(m) not in self.called:
                self.called.add(id(m))
                self.meta_inputs[id(m)] = _compat.tree_map_tensors((args, kwargs), lambda t: t.detach().to("meta"))
            return None

        def after(m: nn.Module, args: Any, output: Any) -> None:
            self.active[id(m)] -= 1
            if output is not None and id(m) not in self.output_dtypes:
                self.output_dtypes[id(m)] = [t.dtype for t in _compat.tree_tensors(output)]
            for t in _compat.tree_tensors(output) if id(m) not in self.feeds_loss else ():
                if t.requires_grad:
                    t.register_hook(functools.partial(self._fed_loss, id(m)))

        self.handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        self.handles.append(module.register_forward_hook(after, always_call=True))

    def watch_blocks(self, container: nn.Module) -> None:
        """Note when a pass first calls a block of ``container`` (its own or a stand-in: whatever sits there)."""
        def began(m: nn.Module, args: Any) -> None:
            if not self.blocks_began and any(block is m for block in container.children()):
                self.blocks_began = True

        self.handles.append(register_module_forward_pre_hook(began))

    def _fed_loss(self, key: int, grad: Tensor) -> None:
        self.feeds_loss.add(key)

    def stop(self) -> None:
        """Remove the hooks :meth:`watch` installed."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _inspectable(original: nn.Module, path: str, position: int, holders: Sequence[int]) -> nn.Module | None:
    """A meta-device copy of ``original`` whose submodules can be read (their settings, their weights' metadata) but
    not called: calling one raises our error. None where ``original`` cannot be copied."""
    try:
        shadow = meta_twin(original)
    except Exception:  # a module that cannot be copied (it holds a lock, say): its submodules are not readable
        return None

    def refuse(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            raise PipelineConfigError(
                f"`{path}.{name}` was called on pipeline rank {position}, where the weights of `{path}` are not kept "
                f"(pipeline rank(s) {list(holders)} hold them: the first training step used them there). Pass "
                f"PipelineParallelStrategy(outside_weights=\"everywhere\") to keep every weight outside the blocks on "
                f"every rank."
            )

        return hook

    for name, submodule in shadow.named_modules():
        if name:
            submodule.register_forward_pre_hook(refuse(name))
    return shadow


def _shape_only(twin: nn.Module, dtypes: list[torch.dtype] | None, device: torch.device, training: bool,
                args: Any, kwargs: Any) -> Any:
    """What ``twin`` (a module's meta-device copy) outputs for these arguments, as NaN (integers: zeros) on
    ``device``, in ``dtypes`` (the observed call's, under autocast) where they match."""
    twin.train(training)
    with torch.no_grad():
        output = twin(*_compat.tree_map_tensors(args, lambda t: t.to("meta")),
                      **_compat.tree_map_tensors(kwargs, lambda t: t.to("meta")))
    shapes = list(_compat.tree_tensors(output))
    if dtypes is None or len(dtypes) != len(shapes):
        dtypes = [t.dtype for t in shapes]
    filled = iter([torch.full(t.shape, math.nan if dtype.is_floating_point else 0, dtype=dtype, device=device)
                   for t, dtype in zip(shapes, dtypes, strict=True)])
    return _compat.tree_map_tensors(output, lambda _: next(filled))


def _forward_shape_only(module: nn.Module, twin: nn.Module, dtypes: list[torch.dtype] | None, device: torch.device,
                        *args: Any, **kwargs: Any) -> Any:
    """The forward of a module whose output this rank's step replaces (see :meth:`WeightPlacement.shardable`)."""
    return _shape_only(twin, dtypes, device, module.training, args, kwargs)


def _compute_shapes_only(module: nn.Module, dtypes: list[torch.dtype] | None) -> None:
    """Make ``module`` (staying in its place, holding its weights) return NaN of its outputs' shapes."""
    module.forward = functools.partial(  # type: ignore[method-assign]
        _forward_shape_only, module, meta_twin(module), dtypes, next(module.parameters()).device)


def _agreed(weights: list[nn.Parameter], agree: Callable[[Tensor], Tensor],
            qualifies: Callable[[nn.Parameter, set[int]], bool]) -> set[int]:
    """The weights (ids) that every rank finds ``qualifies`` given the others that do: the largest such set. The
    candidates only shrink, and every rank sees the same agreed flags, so every rank runs the same rounds."""
    candidates = {id(p) for p in weights}
    while True:
        flags = torch.tensor([qualifies(p, candidates) for p in weights], dtype=torch.int32, device="cpu")
        agreed = {id(p) for p, ok in zip(weights, agree(flags).tolist(), strict=True) if ok}
        if agreed == candidates:
            return candidates
        candidates = agreed


def _runs_on_meta(module: nn.Module, observation: Observation) -> str | None:
    """Why ``module``'s observed call cannot be repeated on a meta-device copy of it (None: it can)."""
    try:
        args, kwargs = observation.meta_inputs[id(module)]
        with torch.no_grad():
            meta_twin(module)(*args, **kwargs)
    except Exception as error:  # any failure means it cannot be stood in for
        return f"it does not run on the meta device ({type(error).__name__}: {error})"
    return None


@dataclass(frozen=True)
class _HeldElsewhere:
    """An unused module's state: its path, a meta-device copy answering for its calls' shapes (None: calling it is
    refused), its weights' dtypes, this rank's pipeline position and the positions holding its weights."""

    path: str
    twin: nn.Module | None
    dtypes: list[torch.dtype] | None
    position: int
    holders: tuple[int, ...]
    kind: str


class _Unused(nn.Module):
    """Takes the place of a module outside the blocks whose weights this rank does not hold (see the module doc).

    Its plain attributes stay readable (an embedding's ``padding_idx``), and so do its weights' shape and dtype: they
    read as unregistered meta-device tensors, so ``x.to(self.wte.weight.dtype)`` works and computing with them fails.
    Its submodules read from a meta-device copy (Hugging Face's ViT reads
    ``self.embeddings.patch_embeddings.projection.weight.dtype`` on every stage); calling one raises our error.
    """

    def __init__(self, path: str, original: nn.Module, twin: nn.Module | None, dtypes: list[torch.dtype] | None,
                 position: int, holders: Sequence[int], placement: WeightPlacement) -> None:
        super().__init__()
        self.__dict__["_placement"] = placement  # its eager sharing (see WeightPlacement.share_through)
        for key, value in vars(original).items():
            # plain values only: a forward set on the instance (a hook library's) must not bypass this stand-in
            if not key.startswith("_") and key != "training" and not callable(value):
                self.__dict__[key] = value
        for name, p in original.named_parameters(recurse=False):
            self.__dict__[name] = torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
        self.training = original.training
        self.__dict__["_device"] = next(original.parameters()).device  # where its outputs would have been
        self.__dict__["_unused"] = _HeldElsewhere(path, twin, dtypes, position, tuple(holders),
                                                  type(original).__name__)
        self.__dict__["_inspected"] = _inspectable(original, path, position, holders)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inspected = self.__dict__.get("_inspected")
            children = dict(inspected.named_children()) if inspected is not None else {}
            if name in children:
                return children[name]
            raise

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        held: _HeldElsewhere = self.__dict__["_unused"]
        placement: WeightPlacement = self.__dict__["_placement"]
        link = placement.share_through()
        if link is not None:  # an eager pass: the output comes from a rank holding the weights
            source = placement.global_rank_of(placement.source_of(held.path, held.holders))
            return link.broadcast(None, source, f"the output of `{held.path}`")
        if held.twin is None:
            raise PipelineConfigError(
                f"`{held.path}` ({held.kind}) was called on pipeline rank {held.position}, where the first training "
                f"step did not call it; its weights are kept only on pipeline rank(s) {list(held.holders)}, which "
                f"used them. Pass PipelineParallelStrategy(outside_weights=\"everywhere\") to keep every weight "
                f"outside the blocks on every rank."
            )
        return _shape_only(held.twin, held.dtypes, self.__dict__["_device"], self.training, args, kwargs)

    def extra_repr(self) -> str:
        held: _HeldElsewhere = self.__dict__["_unused"]
        return (f"{held.kind} held by pipeline rank(s) {list(held.holders)}"
                + (", shape-only stand-in" if held.twin else ""))


def _share_output(placement: WeightPlacement, source: int, path: str, module: nn.Module, args: Any,
                  output: Any) -> Any:
    """A held module's output in an eager pass: broadcast from pipeline position ``source``, the same on every rank
    (see :meth:`WeightPlacement._share_held_outputs`)."""
    link = placement.share_through()
    if link is None:
        return None
    shared = link.broadcast(output, placement.global_rank_of(source), f"the output of `{path}`")
    return None if placement.position == source else shared


class WeightPlacement:
    """Where each weight outside the blocks of one split module is held (see the module doc).

    ``users`` maps ``id(weight)`` to the pipeline positions holding it once decided; a weight absent from it is held
    by every position.
    """

    def __init__(self, module: nn.Module, weights: list[nn.Parameter], position: int, num_positions: int,
                 container: nn.Module | None = None) -> None:
        self.module = module
        self.container = container  # the block container, whose first call in a pass ends what runs before it
        self.weights = weights  # every weight outside the blocks, in module order (the same on every rank)
        self.position = position
        self.num_positions = num_positions
        self.users: dict[int, frozenset[int]] = {}
        self._holders = self._find_holders(module)
        self._holder_modules = list({id(h.module): h for hs in self._holders.values() for h in hs}.values())
        self._undecided = list(weights)  # observed on the next training step where trainable
        self._released: dict[int, tuple[nn.Parameter, torch.Size]] = {}  # id -> (weight, its shape when held)
        self._replaced: list[tuple[_Holder, _Unused]] = []
        self._just_decided: set[int] = set()  # the weights the latest decision placed
        self._observed: Observation | None = None  # the step it observed
        self._sharded: set[int] = set()  # indices in `weights` sharded over the replicas: they stay as they are
        self._sources: dict[str, int] = {}  # a module's path -> the position whose output eager passes share
        self.observation: Observation | None = None
        # set by the stage's session: the link over which a module outputs what another rank's stand-in of it needs
        # in an eager pass (None outside such passes), and the global rank of a pipeline position in this replica
        self.share_through: Callable[[], Any] = lambda: None
        self.global_rank_of: Callable[[int], int] = lambda position: position
        self._sharing: list[RemovableHandle] = []

    def _find_holders(self, module: nn.Module) -> dict[int, list[_Holder]]:
        watched = {id(p) for p in self.weights}
        by_module: dict[int, _Holder] = {}
        holders: dict[int, list[_Holder]] = {id(p): [] for p in self.weights}
        for path, m in module.named_modules(remove_duplicate=False):
            for _, p in m.named_parameters(recurse=False):
                if id(p) not in watched:
                    continue
                holder = by_module.setdefault(id(m), _Holder(path, m, [], []))
                if holder not in holders[id(p)]:
                    holders[id(p)].append(holder)
            if id(m) in by_module:
                by_module[id(m)].paths.append(path)
        for holder in by_module.values():
            for path in holder.paths:
                if path:  # the LightningModule itself has no place to take
                    parent, _, name = path.rpartition(".")
                    holder.places.append((module.get_submodule(parent), name))
        return holders

    # ------------------------------------------------------------------------------------------------ observation

    def wants_observation(self) -> bool:
        """Whether the next training step must be observed: weights not yet placed are (now) trainable."""
        return self.observation is None and any(p.requires_grad for p in self._undecided)

    def cancel(self) -> None:
        """Stop an observation that will not be decided (the run ended before its optimizer step)."""
        if self.observation is not None:
            self.observation.stop()
            self.observation = None

    def observe(self) -> None:
        """Start observing: hooks on the modules holding undecided weights; :meth:`reads` is entered per pass."""
        watched = [p for p in self._undecided if p.requires_grad]
        self.observation = Observation(watched, {id(p): self._holders[id(p)] for p in watched})
        for holder in {id(h.module): h for p in watched for h in self._holders[id(p)]}.values():
            self.observation.watch(holder.module)
        if self.container is not None:
            self.observation.watch_blocks(self.container)

    def reads(self) -> AbstractContextManager[Any]:
        """Around one pass of the user's step: record the weights it reads (a no-op when not observing)."""
        if self.observation is None:
            return nullcontext()
        self.observation.blocks_began = False
        return _ReadsObserver(self.observation)

    # ------------------------------------------------------------------------------------------------ decision

    def decide(self, any_rank: Callable[[Tensor], Tensor], every_rank: Callable[[Tensor], Tensor],
               position_of: Callable[[int], int], optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
        """End the observation and place the observed weights; return what to log.

        ``any_rank(flags)`` is the max of an int tensor over the world; ``every_rank(flags)`` stacks every rank's
        (world x n); ``position_of(rank)`` is a rank's place in its pipeline. Every rank calls this at the same step.
        """
        observation = self.observation
        assert observation is not None
        observation.stop()
        self.observation = None
        weights = observation.weights
        frozen = {id(p) for p in weights if not p.requires_grad}  # frozen again before the step ended
        used_here = [id(p) in frozen or p.grad is not None or id(p) in observation.read_elsewhere
                     for p in weights]
        used_anywhere = any_rank(torch.tensor(used_here, dtype=torch.int32, device="cpu")).tolist()
        releasable = {id(p) for p, here, anywhere in zip(weights, used_here, used_anywhere, strict=True)
                      if anywhere and not here}
        replaceable, kept_why = self._replaceable(weights, releasable, observation)
        released_here = [id(p) in releasable and all(id(h.module) in replaceable for h in self._holders[id(p)])
                         for p in weights]
        keeps = every_rank(torch.tensor([not r for r in released_here], dtype=torch.int32, device="cpu"))
        by_position: dict[int, list[Tensor]] = {}
        for rank in range(keeps.shape[0]):
            by_position.setdefault(position_of(rank), []).append(keeps[rank])
        split = [pos for pos, rows in by_position.items() if any(not torch.equal(rows[0], row) for row in rows[1:])]
        if split:  # seen alike by every rank, so every rank raises
            raise PipelineConfigError(
                f"The data-parallel replicas of pipeline rank(s) {split} disagree on which weights outside the blocks "
                f"their step uses; the model's step must do the same on every replica. Pass "
                f"PipelineParallelStrategy(outside_weights=\"everywhere\") to keep those weights on every rank."
            )
        decided = {id(p) for p in weights if id(p) not in frozen}
        self._undecided = [p for p in self._undecided if id(p) not in decided]
        self._just_decided, self._observed = decided, observation
        for index, p in enumerate(weights):
            if id(p) in frozen:
                continue
            holders = frozenset(position_of(rank) for rank in range(keeps.shape[0]) if keeps[rank, index])
            if len(holders) < self.num_positions:
                self.users[id(p)] = holders
        lines = self._report(weights, released_here, kept_why)  # while the released weights still have their sizes
        self._release([p for p, r in zip(weights, released_here, strict=True) if r], replaceable, observation,
                      optimizers)
        self._share_held_outputs()
        return lines

    def _share_held_outputs(self) -> None:
        """On this rank, each module it holds that some pipeline ranks stand in for (or compute shapes only with)
        broadcasts its output in eager passes, from :meth:`source_of` (the others receive it)."""
        for handle in self._sharing:
            handle.remove()
        self._sharing = []
        replaced = {id(holder.module) for holder, _ in self._replaced}
        for holder in self._holder_modules:
            weights = list(holder.module.parameters())
            if holder.path in self._sources and id(holder.module) not in replaced:  # sharded: every rank calls it
                positions = {self.position}
            elif not weights or not all(id(p) in self.users for p in weights):
                continue
            else:
                positions = set().union(*(self.users[id(p)] for p in weights))
            if self.position in positions:
                self._sharing.append(holder.module.register_forward_hook(
                    functools.partial(_share_output, self, self.source_of(holder.path, positions), holder.path)))

    def source_of(self, path: str, positions: Iterable[int]) -> int:
        """The pipeline position whose output of the module at ``path`` (held by ``positions``) eager passes share:
        the first holding it, or for a sharded weight's module the first where it is an FSDP2 unit."""
        return self._sources.get(path, min(positions))

    def _replaceable(self, weights: list[nn.Parameter], releasable: set[int],
                     observation: Observation) -> tuple[set[int], dict[str, str]]:
        """The modules (ids) this rank can stand in for, and why the others holding releasable weights stay."""
        replaceable: set[int] = set()
        kept_why: dict[str, str] = {}
        candidates = {id(h.module): h for p in weights if id(p) in releasable for h in self._holders[id(p)]}
        for key, holder in candidates.items():
            why = None
            if not holder.places:
                why = "held by the LightningModule itself"
            elif any(id(q) not in releasable for q in holder.module.parameters()):
                used = next(n for n, q in holder.module.named_parameters() if id(q) not in releasable)
                why = f"it also holds `{used}`, which this rank uses (or which lies in its blocks)"
            elif key in observation.after_blocks:
                why = "the step calls it after the blocks, where it may read its output's values"
            elif key in observation.called:
                why = _runs_on_meta(holder.module, observation)
            if why is None:
                replaceable.add(key)
            else:
                kept_why[holder.path] = why
        return replaceable, kept_why

    def _release(self, released: list[nn.Parameter], replaceable: set[int], observation: Observation,
                 optimizers: Sequence[torch.optim.Optimizer]) -> None:
        ids = {id(p) for p in released}
        modules = {id(h.module): h for p in released for h in self._holders[id(p)] if id(h.module) in replaceable}
        for key, holder in modules.items():
            twin = meta_twin(holder.module) if key in observation.called else None
            holders = sorted(set().union(*(self.users[id(p)] for p in holder.module.parameters())))
            stand_in = _Unused(holder.path, holder.module, twin, observation.output_dtypes.get(key), self.position,
                               holders, self)
            for parent, name in holder.places:
                setattr(parent, name, stand_in)
            self._replaced.append((holder, stand_in))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in ids]
            for p in released:
                optimizer.state.pop(p, None)
        with torch.no_grad():
            for p in released:
                self._released[id(p)] = (p, p.shape)
                p.grad = None
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _report(self, weights: list[nn.Parameter], released_here: list[bool], kept_why: dict[str, str]) -> list[str]:
        def mib(params: list[nn.Parameter]) -> str:
            return f"{sum(p.numel() * p.element_size() for p in params) / 2**20:.1f} MiB"

        released = [p for p, r in zip(weights, released_here, strict=True) if r]
        lines = [f"pipeline rank {self.position}: of {len(weights)} weights outside the blocks ({mib(weights)}), "
                 f"{len(released)} ({mib(released)}) are held only by the ranks that use them"]
        lines += [f"pipeline rank {self.position}: `{path}` stays here: {why}" for path, why in kept_why.items()]
        return lines

    def missing_keys(self, position: int) -> set[str]:
        """The state-dict keys pipeline ``position`` does not hold: those of the modules it stands in for."""
        missing: set[str] = set()
        for holder in self._holder_modules:
            weights = list(holder.module.parameters())
            if weights and all(position not in self.users.get(id(p), (position,)) for p in weights):
                for path in holder.paths:
                    missing.update(f"{path}.{key}" for key in holder.module.state_dict())
        return missing

    def held(self) -> list[nn.Parameter]:
        """The weights outside the blocks this rank holds."""
        return [p for p in self.weights if id(p) not in self._released]

    # ------------------------------------------------------------------------------------------------ sharding

    def shardable(self, agree: Callable[[Tensor], Tensor]
                  ) -> tuple[list[tuple[str, nn.Module]], list[nn.Parameter]]:
        """After :meth:`decide`: the modules this rank holds whose weights can be FSDP2 units over the replicas
        (innermost first), and the weights this rank holds without using them (sharded bare: no pass reads them), so
        that each replica keeps 1/D of them. ``agree(flags)`` is the min of an int tensor over the world.

        A weight qualifies where every rank holding it (a tied one: each end) read it at most inside the forward of one
        module holding it whose output reached the loss (a unit gathers a weight only for its forward), that module
        holds nothing that does not qualify, and the other modules holding it there ran before the blocks or not at
        all; only trainable weights this decision placed, of at least one dimension, contiguous (what FSDP2 shards).
        The other modules holding it then compute shapes only (an embedding on the last stage, a tied head the first
        stage does not call), and eager passes take their outputs from a rank where the module is a unit."""
        observation = self._observed
        assert observation is not None
        replaced = {id(holder.module) for holder, _ in self._replaced}
        meta_runs: dict[int, bool] = {}

        def holding(p: nn.Parameter) -> list[_Holder]:
            return [h for h in self._holders[id(p)] if id(h.module) not in replaced]

        def unit_of(p: nn.Parameter) -> list[_Holder]:
            return [h for h in holding(p) if id(h.module) in observation.feeds_loss]

        def may_compute_shapes(h: _Holder) -> bool:
            key = id(h.module)
            if key not in observation.called:
                return True
            if key in observation.after_blocks:
                return False
            if key not in meta_runs:
                meta_runs[key] = _runs_on_meta(h.module, observation) is None
            return meta_runs[key]

        def qualifies(p: nn.Parameter, candidates: set[int]) -> bool:
            if id(p) in self._released:
                return True  # not held here: for the ranks that hold it to say
            units = unit_of(p)
            others = [h for h in holding(p) if h not in units]
            return (id(p) in self._just_decided and id(p) not in observation.read_elsewhere
                    and not isinstance(p, DTensor) and p.dim() > 0 and p.is_contiguous()
                    and (len(units) == 1 or (not units and id(p) in fed))
                    and all(h.places and all(id(q) in candidates for q in h.module.parameters())
                            for h in units + others)
                    and all(may_compute_shapes(h) for h in others))

        # the weights some rank's step trained (max over the world: 1 - min of 1 - flag); never a weight no pass used
        trained = torch.tensor([id(p) not in self._released and bool(unit_of(p)) for p in self.weights],
                               dtype=torch.int32, device="cpu")
        fed = {id(p) for p, none in zip(self.weights, agree(1 - trained).tolist(), strict=True) if not none}
        candidates = _agreed(self.weights, agree, qualifies)
        self._sharded |= {i for i, p in enumerate(self.weights) if id(p) in candidates}
        self._just_decided, self._observed = set(), None
        held = [p for p in self.weights if id(p) in candidates and id(p) not in self._released]
        units = {id(h.module): h for p in held for h in unit_of(p)}
        for holder in {id(h.module): h for p in held for h in holding(p) if id(h.module) not in units}.values():
            _compute_shapes_only(holder.module, observation.output_dtypes.get(id(holder.module)))
        self._agree_on_sources(agree, set(units))
        self._share_held_outputs()
        bare = [p for p in held if not unit_of(p)]
        return [(h.path, h.module) for h in sorted(units.values(), key=lambda h: -h.path.count("."))], bare

    def _agree_on_sources(self, agree: Callable[[Tensor], Tensor], units: set[int]) -> None:
        """Where each module is an FSDP2 unit (on some rank of which positions): there eager passes take its output
        from (:meth:`source_of`)."""
        flags = torch.ones(len(self._holder_modules), self.num_positions, dtype=torch.int32, device="cpu")
        for index, holder in enumerate(self._holder_modules):
            if id(holder.module) in units:
                flags[index, self.position] = 0
        agreed = agree(flags.flatten()).reshape(flags.shape)
        for index, holder in enumerate(self._holder_modules):
            positions = [position for position in range(self.num_positions) if agreed[index, position] == 0]
            if positions:
                self._sources[holder.path] = min(positions)

    def sharded_weights(self) -> list[nn.Parameter]:
        """The weights :meth:`shardable` chose on any rank (as this rank knows them: the shards, or released)."""
        return [self.weights[i] for i in sorted(self._sharded)]

    def replace_weights(self, replacements: dict[int, nn.Parameter]) -> None:
        """Follow weights replaced by new objects (``id`` of the old one -> the new one: FSDP2 makes new
        parameters), also in the other modules holding them here (a tied head the first stage does not call)."""
        def new_id(key: int) -> int:
            return id(replacements[key]) if key in replacements else key

        for key, new in replacements.items():
            for holder in self._holders[key]:
                for name, p in list(holder.module.named_parameters(recurse=False)):
                    if id(p) == key:
                        setattr(holder.module, name, new)

        self.weights = [replacements.get(id(p), p) for p in self.weights]
        self._holders = {new_id(key): holders for key, holders in self._holders.items()}
        for key in [key for key in self.users if key in replacements]:
            self.users[new_id(key)] = self.users.pop(key)

    # ------------------------------------------------------------------------------------------------ restore

    def restore(self, broadcast: Callable[[list[Tensor], int], None]) -> None:
        """Every weight back on every rank (collective): ``broadcast(tensors, position)`` sends a position's values.

        Stand-ins give their place back to the original modules, and each weight held by some ranks only is
        re-allocated and filled from the first position holding it. Weights sharded over the replicas stay where they
        are (as the blocks keep their shards), and so do the stand-ins for their modules.
        """
        self.cancel()
        for handle in self._sharing:
            handle.remove()
        self._sharing = []
        kept = {id(self.weights[i]) for i in self._sharded}
        kept_modules = {id(h.module) for h in self._holder_modules
                        if any(id(p) in kept for p in h.module.parameters())}
        for holder, _ in self._replaced:
            if id(holder.module) not in kept_modules:
                for parent, name in holder.places:
                    setattr(parent, name, holder.module)
        with torch.no_grad():
            for key, (weight, shape) in self._released.items():
                if key not in kept:
                    weight.data = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        by_source: dict[int, list[Tensor]] = {}
        for p in self.weights:
            if id(p) in self.users and id(p) not in kept:
                by_source.setdefault(min(self.users[id(p)]), []).append(p)
        # a stood-in module's buffers (a BatchNorm's statistics) are current only where it ran, and differ between
        # replicas (as DDP, the pipeline's replica 0 gives its buffers to the others)
        for holder in self._holder_modules:
            weights = list(holder.module.parameters())
            if weights and all(id(p) in self.users for p in weights):
                source = min(min(self.users[id(p)]) for p in weights)
                by_source.setdefault(source, []).extend(holder.module.buffers())
        for source in sorted(by_source):
            broadcast(by_source[source], source)
        self.users = {key: users for key, users in self.users.items() if key in kept}
        self._released = {key: value for key, value in self._released.items() if key in kept}
        self._replaced = [(h, stand_in) for h, stand_in in self._replaced if id(h.module) in kept_modules]
        self._undecided = [p for p in self.weights if id(p) not in kept]
        self._share_held_outputs()  # a kept module's output still reaches its stand-ins in eager passes
