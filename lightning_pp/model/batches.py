"""The same batch on every stage of a pipeline, checked: each stage loads the step's batch itself from the user's
DataLoader, so a sampler that shards over the whole world or shuffles by rank, or a rank with fewer batches, would
train the stages on different samples without any error.

Each step, every stage sends the other stages of its pipeline a fingerprint of its batch, four numbers: the batch size,
a hash of its structure (containers, keys, types, dtypes, shapes), a hash of its values (of each tensor a position-
weighted float64 sum of a strided sample: every sample's row, at most about 64 elements of each; plain values such as
strings whole) and whether the loader ends after this batch. The fingerprint is taken on the host from the batch as the
loader gave it, before Lightning moves it to the device (:meth:`BatchGuard.note`), so it costs no device synchronization
(a loader that yields device tensors is read once per step). The messages travel point to point on the host, in the gloo
group the step's results use (:class:`~lightning_pp.model.results.ResultExchange`, under another tag), posted when the
step starts and read when it ends, when every stage has long sent its own: no stage waits for another. Every stage
compares all of them and raises the same :class:`~lightning_pp.errors.PipelineBatchError`, before the step's gradients
reach the optimizer. A step that fails (a loss of mismatched shapes) is explained the same way when the stages' batches
differ. A ``DistributedSampler`` that does not shard over the data-parallel replicas is refused when Lightning hands the
strategy the DataLoader, before any step (:func:`refuse_wrong_sampler`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pp.errors import PipelineBatchError, PipelineConfigError
from lightning_pp.runtime.microbatch import _children, _Whole, batch_size, per_sample

__all__ = ["BatchGuard", "fingerprint", "refuse_wrong_sampler"]

_TAG = 9  # the fingerprints' tag in the results' group (the results use 7 and 8)
_PER_ROW = 64  # elements of each sample's row in a tensor's checksum, at most
_SIZE, _STRUCTURE, _VALUES, _ENDS = range(4)
_PLAIN = (type(None), bool, int, float, str, bytes)
_LOOPS = {"training_step": "train", "validation_step": "val", "test_step": "test", "predict_step": "predict"}
_weights: dict[tuple[int, torch.device], torch.Tensor] = {}


def _position_weights(count: int, device: torch.device) -> torch.Tensor:
    """1, 2, ..., 251, 1, 2, ...: a checksum that changes when samples swap places."""
    key = (count, device)
    if key not in _weights:
        if len(_weights) > 64:
            _weights.clear()
        _weights[key] = (torch.arange(count, device=device) % 251 + 1).double()
    return _weights[key]


def _sampled(tensor: torch.Tensor) -> torch.Tensor:
    """Every row of ``tensor`` (dimension 0), each at most about ``_PER_ROW`` evenly strided elements, as float64."""
    if tensor.dim() > 1:
        per_dim = max(2, int(_PER_ROW ** (1 / (tensor.dim() - 1)) + 1e-9))
        tensor = tensor[(slice(None), *(slice(None, None, max(1, n // per_dim)) for n in tensor.shape[1:]))]
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    sample = tensor.reshape(-1).double()
    return sample.nan_to_num(0.0, 1.0, -1.0) if tensor.is_floating_point() else sample


def fingerprint(batch: Any) -> list[float]:
    """``batch``'s size (0 if it has none), structure hash, tensor checksum (hashes of 52 bits, exact in a float64)
    and 0.0 in the place of the loader's end (see the module's docstring)."""
    parts: list[str] = []
    sums: list[torch.Tensor] = []
    plain: list[str] = []  # the plain values' reprs, hashed with the tensors' sums
    sizes: set[int] = set()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            parts.append(f"T{value.dtype}{tuple(value.shape)}")
            if value.dim():
                sizes.add(value.shape[0])
            if value.numel():
                sample = _sampled(value.detach())
                sums.append(sample @ _position_weights(sample.numel(), sample.device))
        elif type(value) in _PLAIN or (type(value) in (list, tuple) and all(type(v) in _PLAIN for v in value)):
            parts.append(type(value).__name__ + (f"[{len(value)}]" if type(value) in (list, tuple) else ""))
            plain.append(repr(value))  # a collated text field: one repr
        elif isinstance(value, _Whole):
            parts.append(f"whole[{len(value)}]")  # type: ignore[arg-type]  # a list or tuple
            plain.append(repr(value))
        elif (children := _children(value)) or isinstance(value, (list, tuple, Mapping)) \
                or dataclasses.is_dataclass(value):
            parts.append(f"{type(value).__name__}(")
            for name, child in children:
                parts.append(name)
                walk(child)
            parts.append(")")
        else:
            parts.append(type(value).__name__)

    walk(batch)
    size = sizes.pop() if len(sizes) == 1 else 0
    if not sizes and not size:
        with contextlib.suppress(PipelineConfigError):  # the step refuses it; until then, it is compared as it is
            size = batch_size(batch)
    values = torch.stack(sums).tolist() if sums else []  # one read of the host (or, for device tensors, the device)
    checksum = hashlib.blake2b(struct.pack(f"{len(values)}d", *values) + "\0".join(plain).encode(),
                               digest_size=8).digest()
    structure = hashlib.blake2b("".join(parts).encode(), digest_size=8).digest()
    return [float(size), float(int.from_bytes(structure, "little") >> 12),
            float(int.from_bytes(checksum, "little") >> 12), 0.0]


def _samplers(loader: Any) -> list[Any]:
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return [s for s in (sampler, inner) if s is not None]


def refuse_wrong_sampler(loader: Any, num_replicas: int, replica: int, which: str, rank: int) -> None:
    """Refuse a ``DistributedSampler`` in ``loader`` (the ``which`` DataLoader, on global ``rank``) that does not shard
    over the data-parallel replicas: every stage of a pipeline must load the same samples, so it must be built with
    ``num_replicas`` and ``replica``. (Raised alike on every rank, before any step.)"""
    for sampler in _samplers(loader):
        if isinstance(sampler, DistributedSampler) and (sampler.num_replicas, sampler.rank) != (num_replicas, replica):
            raise PipelineConfigError(
                f"The {which} DataLoader's {type(sampler).__name__} has num_replicas={sampler.num_replicas}, "
                f"rank={sampler.rank} on global rank {rank}, so the stages of a pipeline would load different "
                f"samples. Every stage loads the step's batch itself: shard over the {num_replicas} data-parallel "
                f"replica(s) only, with DistributedSampler(dataset, num_replicas={num_replicas}, rank={replica}) on "
                f"this rank (num_replicas=trainer.strategy.num_replicas, rank=trainer.strategy.replica), or leave "
                f"the sampler to Lightning (use_distributed_sampler=True, the default), which does so.")


def _describe_loaders(loaders: Any) -> str:
    """The DataLoaders' samplers and datasets, for an error message."""
    flat: list[Any] = []
    stack = [loaders]
    while stack:
        item = stack.pop(0)
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None:
            flat.append(item)
    described = []
    for loader in flat:
        if not isinstance(loader, DataLoader):
            described.append(type(loader).__name__)
            continue
        samplers = []
        for sampler in _samplers(loader):
            extra = (f"(num_replicas={sampler.num_replicas}, rank={sampler.rank}, shuffle={sampler.shuffle}, "
                     f"seed={sampler.seed})" if isinstance(sampler, DistributedSampler) else "")
            generator = getattr(sampler, "generator", None)
            extra += f" with a generator of seed {generator.initial_seed()}" if generator is not None else ""
            samplers.append(f"{type(sampler).__name__}{extra}")
        described.append(f"DataLoader of {type(loader.dataset).__name__} (sampler {', '.join(samplers) or 'none'}, "
                         f"batch_size={loader.batch_size})")
    return "; ".join(described) or "unknown"


class BatchGuard:
    """This rank's check of each step's batch: the same on every stage of its pipeline (``group``: the results'
    gloo group of the pipeline, None with one stage; ``stage_of``: the stage of a global rank), and split the same
    way from batch to batch (a list as long as the batch in one batch and not in another is refused)."""

    def __init__(self, group: Any, rank: int, stage_of: Callable[[int], int], timeout: float,
                 trainer: Callable[[], Any], replicas: tuple[int, int]) -> None:
        self.group = group
        self.rank = rank
        self.stage_of = stage_of
        self.timeout = timeout
        self.trainer = trainer
        self.replicas = replicas  # (count, this rank's replica)
        self.peers = sorted(r for r in dist.get_process_group_ranks(group) if r != rank) if group is not None else []
        self._noted: list[float] | None = None
        self._sending: list[tuple[dist.Work, torch.Tensor]] = []
        self._per_sample: dict[tuple[str, str], tuple[bool, int, int]] = {}  # (step, path) -> (split, length, size)

    def note(self, batch: Any) -> None:
        """The fingerprint of the next step's batch, taken on the host before Lightning moves it to the device."""
        self._noted = fingerprint(batch)

    @contextmanager
    def checking(self, step_name: str, args: tuple[Any, ...]) -> Iterator[None]:
        """Around one step: sends this stage's fingerprint, and afterwards raises :class:`PipelineBatchError` on every
        stage of the pipeline if the stages' batches differ (also when the step itself failed: then from its
        error)."""
        batch = args[0] if args else None
        noted, self._noted = self._noted, None
        self._refuse_changing_splits(step_name, batch)
        if not self.peers:
            yield
            return
        mine = torch.tensor(noted if noted is not None else fingerprint(batch), dtype=torch.float64, device="cpu")
        mine[_ENDS] = float(self._ends_loop(step_name))
        for sent, _ in self._sending:  # the previous step's: every peer received them by the end of that step
            sent.wait()
        theirs = {}
        for peer in self.peers:  # receives first: on gloo a send that finds its receive posted leaves at once
            buffer = torch.empty(4, dtype=torch.float64, device="cpu")
            theirs[peer] = (buffer, dist.irecv(buffer, peer, group=self.group, tag=_TAG))
        self._sending = [(work, mine) for peer in self.peers
                         if (work := dist.isend(mine, peer, group=self.group, tag=_TAG)) is not None]
        try:
            yield
        except BaseException as error:
            mismatch = self._mismatch(mine, theirs, step_name, args, wait=min(self.timeout, 10.0))
            if mismatch is not None:
                raise mismatch from error
            raise
        mismatch = self._mismatch(mine, theirs, step_name, args, wait=self.timeout)
        if mismatch is not None:
            raise mismatch

    def _ends_loop(self, step_name: str) -> bool:
        """Whether the loader has no batch after this one (Lightning's fetcher looks one batch ahead)."""
        trainer = self.trainer()
        if step_name == "training_step":
            loop = trainer.fit_loop.epoch_loop
        elif step_name == "validation_step":
            loop = trainer.fit_loop.epoch_loop.val_loop if trainer.state.fn == TrainerFn.FITTING \
                else trainer.validate_loop
        else:
            loop = trainer.test_loop if step_name == "test_step" else trainer.predict_loop
        return bool(loop.batch_progress.is_last_batch)

    def _mismatch(self, mine: torch.Tensor, theirs: dict[int, tuple[torch.Tensor, Any]], step_name: str,
                  args: tuple[Any, ...], wait: float) -> PipelineBatchError | None:
        """The error to raise on this rank if the stages' fingerprints differ (None: they agree, or a peer's did not
        arrive within ``wait`` seconds)."""
        prints = {self.rank: mine.tolist()}
        for peer, (buffer, work) in theirs.items():
            try:
                work.wait(timedelta(seconds=wait))
            except RuntimeError:
                return None
            prints[peer] = buffer.tolist()
        if all(p == prints[self.rank] for p in prints.values()):
            return None
        return self._error(prints, step_name, args)

    def _error(self, prints: dict[int, list[float]], step_name: str, args: tuple[Any, ...]) -> PipelineBatchError:
        ranks = sorted(prints, key=self.stage_of)
        differ = []
        if len({prints[r][_SIZE] for r in ranks}) > 1 or len({prints[r][_STRUCTURE] for r in ranks}) > 1:
            differ.append("their structure, shapes or dtypes")
        elif len({prints[r][_VALUES] for r in ranks}) > 1:
            differ.append("their values (same structure and shapes)")
        if len({prints[r][_ENDS] for r in ranks}) > 1:
            ending = [f"stage {self.stage_of(r)}" for r in ranks if prints[r][_ENDS]]
            differ.append(f"how many batches the loader gives: on {', '.join(ending)} it ends after this batch, on "
                          f"the other stages it does not")
        loop = _LOOPS.get(step_name, step_name)
        trainer = self.trainer()
        loaders = getattr(trainer, "train_dataloader" if loop == "train" else f"{loop}_dataloaders", None)
        index = args[1] if len(args) > 1 and isinstance(args[1], int) else "?"
        count, replica = self.replicas
        sizes = ", ".join(f"stage {self.stage_of(r)} (rank {r}): {int(prints[r][_SIZE])} samples" for r in ranks)
        return PipelineBatchError(
            f"The stages of a pipeline loaded different batches at {step_name} of batch {index}: {sizes}; they "
            f"differ in {' and in '.join(differ)}. This is stage {self.stage_of(self.rank)} (rank {self.rank}); its "
            f"{loop} loader: {_describe_loaders(loaders)}. Every stage of a pipeline loads the step's batch itself "
            f"from your DataLoader, so each must draw the same samples in the same order and the same number of "
            f"batches: do not seed a shuffle or a random transform by the rank (seed it alike on every rank, e.g. "
            f"torch.Generator().manual_seed(seed)); shard only over the {count} data-parallel replica(s), with "
            f"DistributedSampler(dataset, num_replicas={count}, rank={replica}) on this rank "
            f"(trainer.strategy.num_replicas, trainer.strategy.replica), or leave the sampler to Lightning "
            f"(use_distributed_sampler=True, the default).")

    def _refuse_changing_splits(self, step_name: str, batch: Any) -> None:
        """A list or tuple that was split as per-sample values in one batch and kept whole in another (its length
        matched the batch size only sometimes) is refused: it is one or the other (see
        :mod:`lightning_pp.runtime.microbatch`).
        """
        try:
            size = batch_size(batch)
        except PipelineConfigError:
            return  # the step refuses it
        for path, value in _sequences(batch, size, ""):
            split = per_sample(value, size)
            seen = self._per_sample.setdefault((step_name, path), (split, len(value), size))
            if seen[0] == split:
                continue
            was, length, then = seen
            raise PipelineConfigError(
                f"batch{path} is a {type(value).__name__} of {len(value)} items in a batch of {size} samples, so it "
                f"is {'split into micro-batches' if split else 'kept whole in every micro-batch'}; an earlier batch "
                f"of {then} samples had {length} items there, which was {'split' if was else 'kept whole'}. The rule "
                f"(lightning_pp.whole's docstring): a list or tuple without tensors that has as many items as the "
                f"batch has samples holds one item per sample and is split; any other is shared by every micro-batch. "
                f"If it holds values shared by the whole batch, mark it with lightning_pp.whole(...); if it holds one "
                f"value per sample, give it one item per sample in every batch.")


def _sequences(value: Any, size: int, path: str) -> Iterator[tuple[str, Any]]:
    """The lists and tuples without tensors in ``value`` that the split decides on: per-sample ones, and those kept
    whole (not their items, unless they hold further sequences)."""
    if isinstance(value, (list, tuple)) and not isinstance(value, _Whole) and not hasattr(value, "_fields") \
            and per_sample(value, len(value)):
        yield path, value
        if per_sample(value, size):
            return
    for name, child in _children(value):
        yield from _sequences(child, size, path + name)
