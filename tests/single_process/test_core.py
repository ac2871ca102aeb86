"""Single-process tier: partitioning, micro-batch splitting, log combination and configuration errors."""

from __future__ import annotations

import re
import typing
from datetime import timedelta

import pytest
import torch

from lightning_pp import PipelineConfigError, PipelineLayout, PipelineParallelStrategy
from lightning_pp.runtime.microbatch import split_batch
from lightning_pp.schedule.partition import stage_layer_ranges, uniform_balance, validate_balance


def test_uniform_balance_and_ranges() -> None:
    assert uniform_balance(8, 2) == [4, 4]
    assert uniform_balance(10, 4) == [3, 3, 2, 2]
    assert stage_layer_ranges([3, 3, 2, 2]) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


def test_balance_errors_name_values_and_fix() -> None:
    with pytest.raises(PipelineConfigError, match=r"3 blocks but the pipeline has 4 stages"):
        uniform_balance(3, 4)
    with pytest.raises(PipelineConfigError, match=r"sums to 7 but the block container has 8 blocks.*balance=\[4, 4\]"):
        validate_balance([3, 4], 8, 2)
    with pytest.raises(PipelineConfigError, match="has 3 entries but the pipeline has 2 stages"):
        validate_balance([3, 3, 2], 8, 2)
    with pytest.raises(PipelineConfigError, match="below 1"):
        validate_balance([8, 0], 8, 2)


def test_too_few_blocks_for_several_stages_per_rank_says_so() -> None:
    """Issue 39, finding 8: interleaved with too few blocks suggested fewer devices; the stages per rank are the
    knob."""
    with pytest.raises(PipelineConfigError, match=r"8 blocks but stages_per_rank=5 on 2 ranks makes 10 stages \(5 x "
                                                  r"2\).*Use stages_per_rank=4 or fewer, or schedule='1f1b'") as info:
        uniform_balance(8, 10, stages_per_rank=5)
    assert "devices" not in str(info.value)
    with pytest.raises(PipelineConfigError, match=r"3 blocks but stages_per_rank=2 on 2 ranks.*Use schedule='1f1b'"):
        uniform_balance(3, 4, stages_per_rank=2)


def test_split_batch_nested_and_uneven() -> None:
    batch = {"x": torch.arange(10).reshape(5, 2), "pair": (torch.arange(5), "tag")}
    micro, sizes = split_batch(batch, 3)
    assert sizes == [2, 2, 1]
    assert torch.equal(micro[2]["x"], torch.tensor([[8, 9]]))
    assert micro[1]["pair"][1] == "tag"
    assert torch.equal(torch.cat([m["pair"][0] for m in micro]), torch.arange(5))


def test_split_batch_errors() -> None:
    with pytest.raises(PipelineConfigError, match="batch of 2 samples cannot be split into 4"):
        split_batch(torch.zeros(2, 3), 4)
    with pytest.raises(PipelineConfigError, match=r"first dimensions \[3, 4\]"):
        split_batch((torch.zeros(3), torch.zeros(4)), 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "interleaved"}, r"Unknown schedule 'interleaved'. Did you mean 'interleaved_1f1b'\? Valid "
                                      r"schedules: 1f1b, dualpipev, gpipe, interleaved_1f1b, naive, pipedream_2bw, "
                                      r"zb_h1, zbv, 'auto' \(chosen from measured costs\), torch's names \(GPipe, "
                                      r"1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV\), or the path of a "
                                      r"\.csv file"),
        ({"schedule": "ZBVZeroBuble"}, r"Did you mean 'zbv'\?"),
        ({"schedule": "1fb1"}, r"Did you mean '1f1b'"),
        ({"schedule": "missing.csv"}, r"Schedule file 'missing.csv' does not exist"),
        ({"schedule": "interleaved_1f1b", "stages_per_rank": 1}, r"runs at least 2 stage\(s\) per rank"),
        ({"schedule": "1f1b", "stages_per_rank": 2}, r"Several stages per rank need schedule='interleaved_1f1b'"),
        ({"stages_per_rank": 0}, r"stages_per_rank=0 \(int\): pass a positive integer"),
        ({"activation_checkpointing": 0}, r"activation_checkpointing=0 \(int\) must be True"),
        ({"activation_checkpointing": "yes"}, r"activation_checkpointing='yes' \(str\) must be True"),
        ({"microbatches": 0}, r"microbatches=0 \(int\): pass a positive integer"),
        ({"microbatches": True}, r"microbatches=True \(bool\): pass a positive integer"),
        ({"microbatches": 2.0}, r"microbatches=2.0 \(float\)"),
        ({"balance": [2, 0]}, r"balance=\[2, 0\] must be .* or a list of at least one block for every stage"),
        ({"balance": [1, True]}, r"balance=\[1, True\] must be"),
        ({"balance": "22"}, r"balance='22' must be 'uniform' \(an even split\), 'params'"),
        ({"balance": "speed"}, r"balance='speed' must be 'uniform' \(an even split\), 'params' \(even parameter "
                               r"counts\), 'time' \(measured forward and backward time\) or a list"),
        ({"timeout": 60}, r"timeout=60 \(int\) is the process group's timeout, as in Lightning's DDPStrategy: pass a "
                          r"positive datetime.timedelta.*transfer_timeout"),
        ({"timeout": timedelta(0)}, r"timeout=datetime.timedelta\(0\) \(timedelta\)"),
        ({"transfer_timeout": 0}, r"transfer_timeout=0 \(int\) must be a positive number of seconds"),
        ({"transfer_timeout": "20"}, r"transfer_timeout='20' \(str\) must be a positive number of seconds"),
        ({"data_parallel_mode": "zero3"}, r"data_parallel_mode='zero3'; use 'ddp'"),
        ({"reuse_cpu_memory": "no"}, r"reuse_cpu_memory='no' \(str\) must be True or False"),
        ({"process_group_backend": "mpi2"}, r"process_group_backend='mpi2'; use 'gloo' \(CPU\) or 'nccl'"),
        ({"state_dict_type": "zip"}, r"state_dict_type='zip'; use 'full'"),
        ({"blocks": 3}, r"blocks=3 \(int\): pass the dotted path"),
    ],
)
def test_strategy_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(PipelineConfigError, match=message):
        PipelineParallelStrategy(**kwargs)


def test_timeouts_are_separate() -> None:
    """``timeout`` is the process group's, as in Lightning's strategies; the transfers' is ``transfer_timeout``."""
    strategy = PipelineParallelStrategy(transfer_timeout=20)
    assert strategy.options.transfer_timeout == 20
    assert strategy.options.timeout == timedelta(minutes=30)  # Lightning's (torch's) default
    assert PipelineParallelStrategy(timeout=timedelta(hours=2)).options.timeout == timedelta(hours=2)


def test_torch_schedule_names_and_any_case_name_ours() -> None:
    """torch.distributed.pipelining's names (its ``get_schedule_class`` matches them case-insensitively) and ours in
    any case or spelling of underscores choose our schedule; a file path is left as given."""
    for name, ours in (("1F1B", "1f1b"), ("GPipe", "gpipe"), ("Interleaved1F1B", "interleaved_1f1b"),
                       ("ZBVZeroBubble", "zbv"), ("DualPipeV", "dualpipev"), ("ZB_H1", "zb_h1"), ("zbh1", "zb_h1"),
                       ("PipeDream-2BW", "pipedream_2bw"), ("AUTO", "auto")):
        assert PipelineParallelStrategy(schedule=name).options.schedule == ours, name


def test_balance_for_another_world_size_fails_before_launch() -> None:
    import lightning as L

    with pytest.raises(PipelineConfigError, match=r"balance=\[1, 1, 2\] describes 3 stages but each pipeline has 2"):
        L.Trainer(strategy=PipelineParallelStrategy(balance=[1, 1, 2]), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(PipelineConfigError, match=r"balance=\[1, 3\] describes 2 stages but each pipeline has 4 "
                                                  r"\(pipeline_parallel_size\)"):
        L.Trainer(strategy=PipelineParallelStrategy(balance=[1, 3], pipeline_parallel_size=4), accelerator="cpu",
                  devices=4, logger=False)


def test_pipeline_size_must_divide_the_world_before_launch() -> None:
    import lightning as L

    with pytest.raises(PipelineConfigError, match=r"pipeline_parallel_size=3 does not divide the world of 4 processes "
                                                  r"\(devices x num_nodes = 2 x 2\).*pipeline_parallel_size=2"):
        L.Trainer(strategy=PipelineParallelStrategy(pipeline_parallel_size=3), accelerator="cpu", devices=2,
                  num_nodes=2, logger=False)
    for bad in (0, 2.0, "2", True):
        with pytest.raises(PipelineConfigError, match="pipeline_parallel_size="):
            PipelineParallelStrategy(pipeline_parallel_size=bad)  # type: ignore[arg-type]


def test_tensor_parallel_size_is_checked_before_launch() -> None:
    import lightning as L

    with pytest.raises(PipelineConfigError, match=r"pipeline_parallel_size x tensor_parallel_size = 2 x 2 = 4 does not "
                                                  r"divide the world of 6 processes"):
        L.Trainer(strategy=PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2),
                  accelerator="cpu", devices=6, logger=False)
    for bad in (0, 2.0, "2", None):
        with pytest.raises(PipelineConfigError, match=re.escape(f"tensor_parallel_size={bad!r}")):
            PipelineParallelStrategy(tensor_parallel_size=bad)  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError, match="balance='time' measures the blocks on global rank 0 alone"):
        PipelineParallelStrategy(tensor_parallel_size=2, balance="time")


def test_layout_places_replicas_of_a_stage_on_neighbouring_ranks() -> None:
    layout = PipelineLayout(num_stages=3, num_replicas=2)
    assert layout.world_size == 6
    assert [layout.replica_ranks(2 * s) for s in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [layout.pipeline_ranks(r) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    for rank in range(6):
        assert layout.rank(layout.stage_of(rank), layout.replica_of(rank)) == rank
    assert str(layout).splitlines()[1:] == ["stage 0: ranks 0 1", "stage 1: ranks 2 3", "stage 2: ranks 4 5"]
    # pipeline x data-parallel x tensor-parallel, tensor-parallel innermost (as DeviceMesh (P, D, T) numbers ranks)
    layout = PipelineLayout(num_stages=2, num_replicas=2, tensor_parallel=2)
    assert (layout.world_size, layout.lanes) == (8, 4)
    assert [layout.pipeline_ranks(lane) for lane in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [(layout.stage_of(r), layout.replica_of(r), layout.tensor_parallel_rank_of(r)) for r in range(8)] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    assert layout.replica_ranks(5) == [5, 7] and layout.shard_ranks(1) == [1, 3, 5, 7]
    assert str(layout).splitlines()[1:] == ["stage 0: ranks 0 1 2 3", "stage 1: ranks 4 5 6 7"]
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    assert (strategy.num_stages, strategy.num_replicas, strategy.layout) == (2, 2, PipelineLayout(2, 2))
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0} and strategy.is_distributed
    assert PipelineParallelStrategy().is_distributed is False  # one pipeline: the user's loader is kept
    strategy = PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)
    strategy.parallel_devices = [torch.device("cpu")] * 8
    assert (strategy.num_stages, strategy.num_replicas, strategy.layout) == (2, 2, PipelineLayout(2, 2, 2))
    strategy = PipelineParallelStrategy(tensor_parallel_size=2)  # the pipeline spans the world over T
    strategy.parallel_devices = [torch.device("cpu")] * 4
    assert (strategy.num_stages, strategy.num_replicas) == (2, 1) and not strategy.is_distributed


def test_registry_alias() -> None:
    import lightning as L

    trainer = L.Trainer(strategy="pipeline", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, PipelineParallelStrategy)


def test_log_records_split_into_layout_and_numbers_and_back() -> None:
    """The result exchange sends a step's log records as numbers and, only when it changed, their layout."""
    from lightning_pp.model.logs import LogRecord, MetricRef, join_records, split_records

    records: list[LogRecord] = [("loss", 0.25, {"prog_bar": True}), ("acc", MetricRef("model.acc", 0.5), {}),
               ("auroc", MetricRef("model.auroc", None), {"on_epoch": True}), ("n", 3.0, {"reduce_fx": "sum"})]
    layout, numbers = split_records(records)
    assert numbers == [0.25, 0.5, 3.0]
    assert join_records(layout, numbers) == records
    assert split_records([("loss", 0.75, {"prog_bar": True})])[0] == layout[:1]  # new numbers, the same layout


def test_strategy_takes_every_option_and_describes_it() -> None:
    """The strategy's keyword arguments are PipelineOptions' fields plus Lightning's own, and its docstring (what
    LightningCLI's --help shows) describes each option from the field's docstring."""
    import dataclasses
    import inspect

    from lightning_pp.options import PipelineOptions

    options = [f.name for f in dataclasses.fields(PipelineOptions) if f.init]
    lightning = ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"]
    assert list(inspect.signature(PipelineParallelStrategy.__init__).parameters)[1:] == options + lightning
    doc = PipelineParallelStrategy.__doc__ or ""
    args = doc[doc.index("\n    Args:\n"):]
    for name in options:
        assert f"\n        {name}: " in args, name
    # every choice is a Literal, so LightningCLI lists and checks its values
    hints = typing.get_type_hints(PipelineParallelStrategy.__init__)
    for name, value in (("schedule", "zb_h1"), ("balance", "time"), ("state_dict_type", "sharded"),
                        ("data_parallel_mode", "fsdp"), ("outside_weights", "everywhere"),
                        ("process_group_backend", "nccl")):
        literals = [arg for arg in (hints[name], *typing.get_args(hints[name]))
                    if typing.get_origin(arg) is typing.Literal]
        assert literals and value in typing.get_args(literals[0]), (name, hints[name])


def test_declared_minimums_are_the_ones_checked() -> None:
    """pyproject.toml's ``torch>=`` and ``lightning>=`` are what ``_compat`` checks at import, and an older release
    is refused with both versions and the fix."""
    from pathlib import Path

    from lightning_pp import _compat

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    for package, minimum in (("torch", _compat.TORCH_MINIMUM), ("lightning", _compat.LIGHTNING_MINIMUM)):
        declared = next(re.fullmatch(rf"{package}>=(\d+)\.(\d+)(?:,<[\d.]+)?", d) for d in project["dependencies"]
                        if d.startswith(f"{package}>="))
        assert declared is not None
        assert (int(declared[1]), int(declared[2])) == minimum
    assert _compat.TORCH_VERSION >= _compat.TORCH_MINIMUM
    assert _compat._release("2.11.0+cu130") == (2, 11) and _compat._release("2.13.0a0+git1234") == (2, 13)
    with pytest.raises(PipelineConfigError, match=r"needs torch>=2\.7 .* torch 2\.6\.0 is installed.*pip install"):
        _compat.check_versions("2.6.0")
    with pytest.raises(PipelineConfigError, match=r"needs lightning>=2\.6 .* lightning 2\.5\.1 is installed"):
        _compat.check_versions("2.7.1", "2.5.1")
    _compat.check_versions("2.7.1", "2.6.0")


def test_fsdp_param_groups_of_a_state_before_and_after_torch_2_12() -> None:
    """torch 2.12 turned an FSDP2 state's one parameter group (``_fsdp_param_group``, None without parameters) into a
    list (``_fsdp_param_groups``, which 2.13 prefers, keeping the other as a property)."""
    from types import SimpleNamespace

    from lightning_pp import _compat

    assert _compat.fsdp_param_groups(SimpleNamespace(_fsdp_param_group="group")) == ["group"]
    assert _compat.fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    both = SimpleNamespace(_fsdp_param_groups=["a", "b"], _fsdp_param_group="a")
    assert _compat.fsdp_param_groups(both) == ["a", "b"]


def test_the_package_logs_through_its_logger_never_print(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``print`` in the package; every module logs through ``get_logger``, whose records below ERROR are made on
    global rank 0 only (also for an application's own handlers), a rank's own report on every rank, errors on every
    rank; the package's handler writes only where the application configured no logging."""
    import ast
    import logging
    from pathlib import Path

    from lightning_utilities.core.rank_zero import rank_zero_only

    import lightning_pp
    from lightning_pp._logging import EVERY_RANK, get_logger

    package = Path(lightning_pp.__file__).parent
    printed, unfiltered = [], []
    for path in package.rglob("*.py"):
        text = path.read_text()
        printed += [f"{path.relative_to(package)}:{node.lineno}" for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"]
        unfiltered += [str(path.relative_to(package))] if "logging.getLogger(__name__)" in text else []
    assert printed == [] and unfiltered == []
    assert logging.getLogger("lightning_pp").level == logging.INFO
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [Keep()])  # an application's own logging
    log = get_logger("lightning_pp.some_module")
    for rank in (0, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank, raising=False)
        log.info(f"info {rank}")
        log.warning(f"warning {rank}")
        log.info(f"own {rank}", extra=EVERY_RANK)
        log.error(f"error {rank}")
    assert seen == ["info 0", "warning 0", "own 0", "error 0", "own 1", "error 1"]
    [ours] = logging.getLogger("lightning_pp").handlers
    record = logging.LogRecord("lightning_pp.x", logging.INFO, __file__, 1, "m", None, None)
    written: list[logging.LogRecord] = []
    monkeypatch.setattr(logging.StreamHandler, "emit", lambda self, r: written.append(r))
    ours.handle(record)  # the application shows it: not written twice
    monkeypatch.setattr(root, "handlers", [])
    ours.handle(record)
    assert written == [record]
    assert lightning_pp.__version__ == __import__("importlib.metadata").metadata.version("lightning_pp")


def test_timeout_is_the_process_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """``timeout=timedelta(...)`` reaches the process group's start (Lightning's ``_init_dist_connection``), as in
    Lightning's own strategies."""
    import lightning as L
    from models import MLPClassifier, make_data

    from lightning_pp import _compat

    seen: list[timedelta] = []
    start = _compat._init_dist_connection

    def recording(*args: object, timeout: timedelta, **kwargs: object) -> None:
        seen.append(timeout)
        start(*args, timeout=timeout, **kwargs)

    monkeypatch.setattr(_compat, "_init_dist_connection", recording)
    strategy = PipelineParallelStrategy(timeout=timedelta(minutes=7))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLPClassifier(), make_data("mlp"))
    assert seen == [timedelta(minutes=7)]
