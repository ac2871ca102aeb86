"""The private Lightning and torch APIs lightning_pp relies on, gathered in one place so an upgrade touches one file."""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as pl
import torch
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_pp.errors import PipelineConfigError

# The oldest releases lightning_pp runs on (pyproject.toml's `>=` pins say the same; a test compares them). torch:
# `distribute_tensor(..., src_data_rank=None)` (2.7), FSDP2 and its `FSDPModule`, `MixedPrecisionPolicy` in
# `torch.distributed.fsdp` (2.6), DTensor public in `torch.distributed.tensor` and the pipelining backward split (2.5).
# Lightning: 2.6, the releases the suite runs on (the private hooks below are read from 2.6's loops and strategies).
TORCH_MINIMUM = (2, 7)
LIGHTNING_MINIMUM = (2, 6)


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string (``2.11.0+cu130``, ``2.13.0a0+git1234``)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION = _release(torch.__version__)


def check_versions(version: str = torch.__version__, lightning_version: str = pl.__version__) -> None:
    """Refuse a torch or Lightning older than :data:`TORCH_MINIMUM` / :data:`LIGHTNING_MINIMUM`, naming both versions
    and the fix (an import or attribute error later would name neither)."""
    for package, found, minimum, needs in (
            ("torch", version, TORCH_MINIMUM, "distribute_tensor's src_data_rank, FSDP2 in torch.distributed.fsdp"),
            ("lightning", lightning_version, LIGHTNING_MINIMUM, "the strategy hooks of Lightning 2.6")):
        if _release(found) < minimum:
            least = ".".join(map(str, minimum))
            raise PipelineConfigError(
                f"lightning_pp needs {package}>={least} ({needs}), but {package} {found} is installed. Upgrade it: "
                f"pip install '{package}>={least}'.")


check_versions()


def _found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: Any) -> dict[torch.device, torch.Tensor]:
    """The scaler's per-device inf/NaN flags for ``optimizer``, filled by ``unscale_`` and read by ``step``."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # type: ignore[no-any-return]


def _default_store() -> Any:
    """The store of the default process group (where a failing rank leaves word for the others)."""
    return torch.distributed.distributed_c10d._get_default_store()


def replace_metric_sync(metric: Any, sync: Callable[..., None] | None) -> None:
    """Have ``metric`` sync its states with ``sync(dist_sync_fn, process_group)`` (``None``: torchmetrics' own)."""
    if sync is None:
        metric.__dict__.pop("_sync_dist", None)
    else:
        metric._sync_dist = sync


def sync_metric_states(metric: Any, dist_sync_fn: Callable[..., Any] | None, group: Any) -> None:
    """torchmetrics' own state sync (gather, then each state's reduction) over ``group``."""
    type(metric)._sync_dist(metric, dist_sync_fn or gather_all_tensors, process_group=group)


def metric_forward_value(metric: Any) -> Any:
    """What the metric's latest ``forward`` returned (torchmetrics keeps it for ``self.log``)."""
    return metric._forward_cache


def mark_metric_updated(metric: Any, counted: bool, forward_value: torch.Tensor | None) -> None:
    """Make ``metric`` look as the last stage's copy does after a step: updated (when ``counted``), with no stale
    computed value, and the step's forward value."""
    if counted:
        metric._update_count += 1
        metric._computed = None
    if forward_value is not None:
        metric._forward_cache = forward_value


def tree_map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` (nested containers, also registered ones such as Hugging Face's ModelOutput) with ``fn`` applied to
    each tensor."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, fn, tree)


def tree_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree`` in :func:`tree_map_tensors`' order."""
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of ``tree`` (in :func:`tree_map_tensors`' order) and a comparable description of the rest, from
    which :func:`tree_unflatten` rebuilds it (in this process: unpickling one warns of deprecated classes)."""
    from torch.utils._pytree import tree_flatten as flatten

    return flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils._pytree import tree_unflatten as unflatten

    return unflatten(leaves, spec)


def train_data_source(trainer: Any) -> Any | None:
    """Where ``fit`` takes its training batches from (the loaders passed to it, or the module's or datamodule's
    ``train_dataloader`` hook), with ``dataloader()`` to ask for them; None when there is none."""
    source = trainer.fit_loop._data_source
    return source if source.instance is not None and source.is_defined() else None


@contextmanager
def fresh_persistent_workers(loaders: list[Any]) -> Iterator[None]:
    """Iterating a DataLoader with ``persistent_workers`` keeps its iterator (and its workers) for the next ``iter``,
    which then draws no new seed for them: drop the iterators created in here, so that the fit loop's ``iter`` starts
    the workers (and draws from the random generator) as it would have."""
    before = [getattr(loader, "_iterator", None) for loader in loaders]
    try:
        yield
    finally:
        for loader, kept in zip(loaders, before, strict=True):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and kept is None:
                shutdown = getattr(iterator, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
                loader._iterator = None


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (what autograd checks before using a saved tensor)."""
    return tensor._version


def child_names(container: torch.nn.Module) -> list[str]:
    """Every entry of a block container in order, also a block listed twice (``named_children`` skips repeats)."""
    return list(container._modules)


def forward_hooks(module: torch.nn.Module) -> list[tuple[Callable[..., Any], bool]]:
    """The module's own forward hooks in call order, each with whether it takes the call's kwargs."""
    with_kwargs = module._forward_hooks_with_kwargs
    return [(hook, key in with_kwargs) for key, hook in module._forward_hooks.items()]


def share_forward_hooks(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Give ``target`` the very hook registries of ``source``: a forward (pre-)hook registered on either is on both."""
    for name in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs"):
        target.__dict__[name] = source.__dict__[name]


def summary_depth(callback: Any) -> int:
    """The ``max_depth`` a Lightning ``ModelSummary`` callback summarizes to."""
    return int(callback._max_depth)


def replace_sigterm_handling(trainer: Any, agree: Callable[[], None],
                             record: Callable[[], None] | None = None) -> Callable[[], None]:
    """Have the training loop call ``agree()`` where it broadcasts, at every step's start, whether rank 0 received
    SIGTERM (a barrier of every rank), and Lightning's SIGTERM handler leave out its own broadcast (which meets that
    one): it still stops the processes Lightning launched and records the signal (``record()`` instead, where given:
    then ``trainer.received_sigterm`` stays false, and no rank stops at its own step's end). Returns what undoes both;
    a no-op where the loop or the handler are not as expected, or off the main thread (where no handler can be set)."""
    loop = trainer.fit_loop.epoch_loop
    connector = trainer._signal_connector
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    handler = signal.getsignal(signal.SIGTERM)
    if (not hasattr(type(loop), "_broadcast_sigterm_tensor") or notifier is None
            or threading.current_thread() is not threading.main_thread()):
        return lambda: None
    others = [h for h in getattr(handler, "signal_handlers", [handler]) if h != notifier and callable(h)]

    forwarded: list[bool] = []

    def notify(signum: int, frame: Any) -> None:
        if not (connector.received_sigterm or forwarded) and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        forwarded.append(True)
        if record is not None:
            record()
        else:
            connector.received_sigterm = True
        for other in others:
            other(signum, frame)

    loop._broadcast_sigterm_tensor = agree
    signal.signal(signal.SIGTERM, notify)

    def undo() -> None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
    return undo


def mark_sigterm_received(trainer: Any) -> None:
    """Set what ``trainer.received_sigterm`` reads, as Lightning's SIGTERM handler does."""
    trainer._signal_connector.received_sigterm = True


def replace_summary(callback: Any, summary: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """Make a Lightning ``ModelSummary`` callback build its summary with ``summary(callback, module)``; returns the
    undo."""
    callback._summary = lambda trainer, module: summary(callback, module)
    return lambda: callback.__dict__.pop("_summary", None)


def copy_forward_hooks(source: torch.nn.Module, target: torch.nn.Module, keep: Callable[[Any], bool]) -> None:
    """Register on ``target`` the forward hooks of ``source`` that ``keep`` accepts (the same functions, in order)."""
    with_kwargs = source._forward_hooks_with_kwargs
    always = source._forward_hooks_always_called
    for key, hook in source._forward_hooks.items():
        if keep(hook):
            target.register_forward_hook(hook, with_kwargs=key in with_kwargs, always_call=key in always)


def current_hook(module: Any) -> str | None:
    """The name of the Lightning hook (or step) running on ``module`` now, if any."""
    return getattr(module, "_current_fx_name", None)


def unregister_tensors(module: torch.nn.Module) -> None:
    """Make the module's own parameters and buffers plain attributes: still readable by name, no longer part of its
    parameters, buffers or state dict."""
    for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
        module._parameters.pop(name, None)
        module._buffers.pop(name, None)
        module._non_persistent_buffers_set.discard(name)
        module.__dict__[name] = tensor  # None too: `linear.bias is None` stays readable


__all__ = [
    "_SubprocessScriptLauncher",
    "_default_store",
    "_found_inf_per_device",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
    "averaging_arguments",
    "averaging_model",
    "batch_statistics_classes",
    "check_versions",
    "child_names",
    "copy_forward_hooks",
    "current_hook",
    "distributed_checkpoint_extents",
    "forward_hooks",
    "fresh_persistent_workers",
    "fsdp_param_groups",
    "hf_init_weights",
    "init_fsdp_root",
    "is_persistent_buffer",
    "mark_metric_updated",
    "mark_sigterm_received",
    "metric_forward_value",
    "move_forward_hooks_last",
    "own_initializer",
    "reduce_fsdp_grads",
    "replace_metric_sync",
    "replace_sigterm_handling",
    "replace_summary",
    "set_averaging_model",
    "set_module_device_mesh",
    "set_submodule",
    "share_forward_hooks",
    "submodule",
    "summary_depth",
    "sync_metric_states",
    "tensor_version",
    "throughputs",
    "train_data_source",
    "tree_flatten",
    "tree_map_tensors",
    "tree_tensors",
    "tree_unflatten",
    "unregister_tensors",
    "unscale_local_grads",
    "unsharded_class",
    "unwrapped_optimizer",
]


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (Lightning's ``ModelParallelStrategy`` sets the same attribute)."""
    module._device_mesh = mesh


def reduce_fsdp_grads(module: Any) -> None:
    """Reduce-scatter the gradients an FSDP2 module accumulated over backwards run without gradient sync, and
    reshard its weights: what torch.distributed.pipelining's REDUCE_GRAD action does after a step's last backward
    (FSDP's end-of-backward callback, queued by each backward, reduces nothing while gradient sync is off)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    for each in state._state_ctx.all_states:
        for param_group in fsdp_param_groups(each):
            param_group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_param_groups(state: Any) -> list[Any]:
    """The parameter groups of one FSDP2 state: a list (``_fsdp_param_groups``; a module may hold several) in torch
    2.12 and later, at most one before (``_fsdp_param_group``, None for a unit without parameters of its own; torch
    2.11 has only that one, as found on the lent GPU machine). Told apart by the attribute, so that a build between
    releases works too; 2.13 keeps ``_fsdp_param_group`` as a property that refuses a state of several groups."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


def init_fsdp_root(module: torch.nn.Module) -> None:
    """Make the FSDP2 unit ``module`` the root of the units inside it now, as its first forward would: so that
    :func:`reduce_fsdp_grads` reduces it alike on every replica, whether or not it ran there (a head on the first
    stage, an expert no sample reached)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]


def unsharded_class(cls: type) -> type:
    """``cls``, or for the class ``fully_shard`` made of a module's class (``FSDP<Class>``), that class."""
    from torch.distributed.fsdp import FSDPModule

    return next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))


def move_forward_hooks_last(module: torch.nn.Module, last: Callable[[Any], bool]) -> None:
    """Reorder ``module``'s forward hooks so that those for which ``last(hook)`` holds run after the others."""
    hooks = module._forward_hooks  # an OrderedDict: the call order
    for key in [key for key, hook in hooks.items() if last(hook)]:
        hooks.move_to_end(key)  # type: ignore[attr-defined]


def unscale_local_grads(scaler: torch.amp.GradScaler, optimizer: Any, grads: list[torch.Tensor],
                        device: torch.device) -> None:
    """Unscale ``grads`` (plain tensors: sharded gradients' local shards) as ``scaler.unscale_(optimizer)`` unscales
    the optimizer's gradients, adding their inf/NaN verdict to the one it recorded for ``device``."""
    found = _found_inf_per_device(scaler, optimizer)
    verdict = found.setdefault(device, torch.zeros(1, dtype=torch.float32, device=device))
    inverse = scaler._scale.double().reciprocal().float()  # type: ignore[union-attr]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, verdict, inverse.to(device))


def distributed_checkpoint_extents(metadata: Any) -> dict[str, int]:
    """Each data file of a distributed checkpoint (relative to its folder) and how many bytes of it the entries its
    ``.metadata`` lists reach: ``Metadata.storage_data`` holds torch's private ``_StorageInfo`` records
    (``relative_path``, ``offset``, ``length``) for a checkpoint ``FileSystemWriter`` wrote; other writers' records
    are skipped."""
    extents: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
        if isinstance(path, str) and isinstance(offset, int) and isinstance(length, int):
            extents[path] = max(extents.get(path, 0), offset + length)
    return extents


def averaging_model(callback: Any) -> Any:
    """The ``AveragedModel`` a Lightning ``WeightAveraging`` callback keeps (None outside fit until one is made)."""
    return callback._average_model


def set_averaging_model(callback: Any, model: Any) -> None:
    callback._average_model = model


def averaging_arguments(callback: Any) -> tuple[Any, bool, dict[str, Any]]:
    """A ``WeightAveraging`` callback's ``device``, ``use_buffers`` and the rest of ``AveragedModel``'s arguments."""
    return callback._device, callback._use_buffers, dict(callback._kwargs)


def throughputs(callback: Any) -> list[Any]:
    """The ``Throughput`` meters a ``ThroughputMonitor`` made in its ``setup`` (one per running stage)."""
    return list(callback._throughputs.values())


def batch_statistics_classes() -> tuple[type[torch.nn.Module], type[torch.nn.Module]]:
    """torch's bases of the norms that keep batch statistics: every BatchNorm (SyncBatchNorm and the lazy ones too),
    and InstanceNorm (which keeps running statistics only with ``track_running_stats=True``)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    return _BatchNorm, _InstanceNorm


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (the optimizer itself otherwise)."""
    return getattr(optimizer, "_optimizer", optimizer)


def own_initializer(module: torch.nn.Module) -> Callable[[], None] | None:
    """What initializes ``module``'s own weights: ``reset_parameters``, or torch's ``_reset_parameters`` (as
    ``nn.MultiheadAttention`` and ``nn.Transformer`` name it); None without either."""
    method = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return method if callable(method) else None


def hf_init_weights(hf_model: Any, module: torch.nn.Module) -> None:
    """A Hugging Face model's initialization of one of its submodules (its ``_init_weights``)."""
    hf_model._init_weights(module)


def is_persistent_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its state dict (registered with ``persistent=True``)."""
    return name not in module._non_persistent_buffers_set


def submodule(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """``module``'s direct submodule ``name`` read from its registry, past any ``__getattr__`` of the module's class."""
    return module._modules[name]  # type: ignore[return-value]


def set_submodule(module: torch.nn.Module, name: str, child: torch.nn.Module) -> None:
    """Replace ``module``'s direct submodule ``name`` in its registry, past any ``__getattr__`` of the module's class
    (``add_module`` reads the attribute first)."""
    module._modules[name] = child
