"""Balancing the stages: the exact min-max split against brute force, parameter counts, and balance="time" measured
in one process (2 or 3 stages on one rank, interleaved 1F1B) and on 2 ranks. No timing is asserted: the models that
must be split by time sleep in their blocks, so the split they get does not depend on the machine's load.
The multi-process tests are in ``multi_process/test_balance_multiprocess.py``."""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from models import fit, make_data
from support import assert_like, logged, reference
from torch import nn
from torch.utils.data import DataLoader

from lightning_pp import PipelineConfigError, PipelineParallelStrategy
from lightning_pp.schedule.partition import min_max_partition, stage_costs, uniform_balance
from lightning_pp.tuning.balance import parameter_balance

# ------------------------------------------------------------------------------------------------ the exact split


def brute_force(costs: list[float], stages: int, first: float, last: float) -> tuple[float, list[int]]:
    """The least possible slowest stage over every contiguous split, and the split the tie rule picks among those
    reaching it: the lexicographically largest block counts (earlier stages take as many blocks as they can)."""
    n = len(costs)
    found: list[tuple[float, list[int]]] = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        totals = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        totals[0] += first
        totals[-1] += last
        found.append((max(totals), [b - a for a, b in itertools.pairwise(bounds)]))
    best = min(worst for worst, _ in found)
    return best, max(counts for worst, counts in found if worst == best)


def test_min_max_partition_equals_brute_force_with_ties() -> None:
    """Integer costs (exact sums, so ties are real ties): the same split as brute force, tie rule included."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [float(rng.randint(0, 6)) for _ in range(n)]
        first, last = float(rng.choice([0, 0, 3, 10])), float(rng.choice([0, 0, 2, 7]))
        best, counts = brute_force(costs, stages, first, last)
        split = min_max_partition(costs, stages, first_extra=first, last_extra=last)
        assert split == counts, (costs, stages, first, last)
        assert max(stage_costs(costs, split, first, last)) == best


def test_min_max_partition_reaches_the_optimum_on_float_costs() -> None:
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 10)
        stages = rng.randint(1, min(n, 5))
        costs = [rng.expovariate(1.0) for _ in range(n)]
        first, last = rng.uniform(0, 2), rng.uniform(0, 2)
        best, _ = brute_force(costs, stages, first, last)
        split = min_max_partition(costs, stages, first_extra=first, last_extra=last)
        assert len(split) == stages and min(split) >= 1 and sum(split) == n
        assert max(stage_costs(costs, split, first, last)) == pytest.approx(best, rel=1e-12)


def test_min_max_partition_examples_and_errors() -> None:
    assert min_max_partition([8.0] + [1.0] * 7, 2) == [1, 7]  # the slow block alone
    assert min_max_partition([1.0] * 8, 3) == uniform_balance(8, 3) == [3, 3, 2]  # equal costs: the even split
    assert min_max_partition([1.0] * 8, 2, first_extra=2.0) == [3, 5]  # embeddings on the first stage
    assert min_max_partition([1.0] * 8, 2, last_extra=4.0) == [6, 2]  # a large head on the last
    assert min_max_partition([5.0], 1, 1.0, 1.0) == [1]
    assert min_max_partition([0.0, 0.0, 0.0], 3) == [1, 1, 1]
    with pytest.raises(PipelineConfigError, match="3 blocks but the pipeline has 4 stages"):
        min_max_partition([1.0, 1.0, 1.0], 4)
    with pytest.raises(PipelineConfigError, match="finite and non-negative"):
        min_max_partition([1.0, -1.0], 2)
    with pytest.raises(PipelineConfigError, match="finite and non-negative"):
        min_max_partition([1.0, float("nan")], 1)


def test_parameter_balance_on_uneven_blocks() -> None:
    widths = [1, 1, 6, 1, 1, 2]  # block i holds widths[i] parameters
    container = nn.Sequential(*[nn.Linear(w, 1, bias=False) for w in widths])
    # the largest block alone is the least possible largest stage; stage 0 takes as many blocks as that allows
    assert parameter_balance(container, 3) == [2, 1, 3]
    assert parameter_balance(container, 2) == [3, 3]
    assert uniform_balance(6, 3) == [2, 2, 2]  # stage costs 2, 7, 3


# ------------------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("balance", ["speed", "Time", "", 3, 2.5, [], [2, 0], [1, "2"]])
def test_bad_balance_names_the_allowed_values(balance: Any) -> None:
    with pytest.raises(PipelineConfigError, match=r"must be 'uniform' \(an even split\), 'params' \(even parameter "
                                                  r"counts\), 'time' \(measured forward and backward time\) or a list"):
        PipelineParallelStrategy(balance=balance)


@pytest.mark.parametrize("balance", ["uniform", "params", "time", None, [3, 5], (4, 4)])
def test_good_balance_is_accepted(balance: Any) -> None:
    """Accepted, and the split follows it: 8 blocks of one weight each, the first 100x slower (it sleeps), on 2 stages
    (`trainer_for`). ``None`` (the default) and ``"uniform"`` split evenly, as ``"params"`` does on equal parameter
    counts; ``"time"`` isolates the slow block; a list or a tuple of block counts is the split."""
    from models import SlowFirst

    if balance == "time":
        expected = [1, 7]
    elif isinstance(balance, (list, tuple)):
        expected = list(balance)
    else:
        expected = [4, 4]
    trainer = trainer_for(balance)
    trainer.fit(SlowFirst())
    assert [len(blocks) for blocks in ranges_of(trainer)] == expected


# ------------------------------------------------------------------------------------------------ in one process


class Probed(L.LightningModule):
    """Uneven blocks with BatchNorm inside, a step drawing from torch's, numpy's and Python's generators, a counter
    and a logged value: what the probe must leave as it found it. Snapshots are taken in ``setup`` (before the
    strategy's setup, where the probe runs) and in ``on_fit_start`` (after it, before training)."""

    def __init__(self, widths: tuple[int, ...] = (1, 1, 6, 1, 1, 2)) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 8)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8 * w), nn.BatchNorm1d(8 * w), nn.Tanh(),
                                                    nn.Linear(8 * w, 8)) for w in widths])
        self.head = nn.Linear(8, 5)
        self.steps_seen = 0
        self.snapshots: list[dict[str, Any]] = []

    def _snapshot(self) -> dict[str, Any]:
        return {"state": {k: v.detach().clone() for k, v in self.state_dict().items()}, "steps": self.steps_seen,
                "torch": torch.get_rng_state(), "numpy": np.random.get_state(legacy=False)["state"],
                "python": random.getstate(), "metrics": dict(self.trainer.callback_metrics)}

    def setup(self, stage: str) -> None:
        self.snapshots.append(self._snapshot())

    def on_fit_start(self) -> None:
        self.snapshots.append(self._snapshot())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_seen += 1
        x, y = batch
        x = x + 0.01 * torch.randn_like(x) + 0.01 * float(np.random.rand()) + 0.01 * random.random()
        loss = nn.functional.cross_entropy(self.head(self.blocks(torch.relu(self.inp(x)))), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.blocks(torch.relu(self.inp(x)))), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data("mlp").dataset, batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return make_data("mlp")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_for(balance: Any, stages: int = 2, **kwargs: Any) -> L.Trainer:
    """One process holding ``stages`` stages (interleaved 1F1B on one rank): the probe runs in this process."""
    strategy = PipelineParallelStrategy(schedule="interleaved_1f1b", stages_per_rank=stages, microbatches=2,
                                        balance=balance)
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                     **{"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                        "num_sanity_val_steps": 0, "limit_val_batches": 0, **kwargs})


def ranges_of(trainer: L.Trainer) -> list[range]:
    return trainer.strategy.telemetry.view.ranges  # type: ignore[attr-defined, no-any-return]


def test_time_probe_leaves_the_module_and_random_generators_as_they_were(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = Probed()
    trainer = trainer_for("time")
    trainer.fit(model)
    assert "balance='time' split" in caplog.text  # the probe ran
    at_setup, after_probe = model.snapshots
    assert after_probe["steps"] == at_setup["steps"] == 0
    assert after_probe["metrics"] == at_setup["metrics"] == {}
    for key, value in at_setup["state"].items():  # BatchNorm statistics included
        assert torch.equal(after_probe["state"][key], value), key
    assert torch.equal(after_probe["torch"], at_setup["torch"])
    assert np.array_equal(after_probe["numpy"]["key"], at_setup["numpy"]["key"])
    assert after_probe["numpy"]["pos"] == at_setup["numpy"]["pos"]
    assert after_probe["python"] == at_setup["python"]
    assert model.steps_seen == 2 * 2 * 2  # steps x micro-batches x stages: the probe's runs counted on its copy


def test_time_balance_isolates_the_slow_block_and_trains_like_one_device(caplog: pytest.LogCaptureFixture) -> None:
    """8 blocks, the first 100x slower (sleeps; see `SlowFirst`): split [1, 7] however busy the machine; the shuffling
    loader draws the same batches as one device's, so losses agree."""
    strategy = PipelineParallelStrategy(schedule="interleaved_1f1b", microbatches=2, balance="time")
    got = fit("slow_first8", strategy, record_steps=True).result
    assert strategy.telemetry.view is not None and strategy.telemetry.view.ranges == [range(0, 1), range(1, 8)]
    assert "balance='time' split [1, 7]" in caplog.text
    assert len(logged(got["history"], "train_loss")) == 4
    assert_like([got], reference("slow_first8"), "balance='time' on one rank")


def test_a_second_fit_keeps_the_measured_split(caplog: pytest.LogCaptureFixture) -> None:
    from models import SlowFirst

    model = SlowFirst()
    trainer_for("time").fit(model)
    assert "balance='time' split [1, 7]" in caplog.text
    caplog.clear()
    trainer = trainer_for("time")
    trainer.fit(model)  # the module is split already: nothing is measured, the split is kept
    assert "balance='time'" not in caplog.text
    assert ranges_of(trainer) == [range(0, 1), range(1, 8)]


def test_time_outside_fit_falls_back_to_params(caplog: pytest.LogCaptureFixture) -> None:
    """trainer.validate on a fresh module has no training step to time: the split is by parameters, said in a log
    line. Parameters per block: 160, 160, 920, 160, 160, 312 on 3 stages."""
    caplog.set_level(logging.INFO, logger="lightning_pp.tuning.balance")
    trainer = trainer_for("time", stages=3, limit_val_batches=2)
    trainer.validate(Probed(), verbose=False)
    assert ranges_of(trainer) == [range(0, 2), range(2, 3), range(3, 6)]
    assert "balance='time' falls back to balance='params' (trainer.validate does not train): split [2, 1, 3]" in (
        caplog.text)


def test_params_balance_in_fit() -> None:
    trainer = trainer_for("params", stages=3)
    trainer.fit(Probed())
    assert ranges_of(trainer) == [range(0, 2), range(2, 3), range(3, 6)]


def test_a_failing_probe_is_a_config_error() -> None:
    from models import Uncopyable

    with pytest.raises(PipelineConfigError, match=r"balance='time': measuring the blocks of `layers` on global rank 0 "
                                                  r"failed \(TypeError: cannot pickle '_thread.lock' object\)\. Pass "
                                                  r"balance='params' or a list"):
        trainer_for("time").fit(Uncopyable(), make_data("mlp"))


def test_a_block_that_cannot_be_replayed_alone_gets_the_steps_timings() -> None:
    """Hugging Face's GPT-2 hands each block a key/value cache object it appends to, so a block cannot run again on
    the arguments recorded in the step: its costs come from the step itself (forward by the clock around each block,
    backward by gradient hooks between the blocks' outputs), with what each block saves and outputs."""
    from real_models import HFGPT2, token_batches

    from lightning_pp.tuning.balance import measure_block_costs

    module = HFGPT2()
    (tokens,) = next(iter(token_batches()))
    costs = measure_block_costs(module, "model.transformer.h", [tokens[:2]], device=torch.device("cpu"),
                                detailed=True)
    assert len(costs.forward) == len(costs.backward) == len(costs.input_backward) == 4
    assert all(f > 0 for f in costs.forward) and all(b > 0 for b in costs.backward)
    assert all(0 < i <= b for i, b in zip(costs.input_backward, costs.backward, strict=True))
    assert all(saved > out > 0 for saved, out in zip(costs.saved_bytes, costs.output_bytes, strict=True))
    assert costs.output_bytes[0] == 2 * tokens.shape[1] * 32 * 4  # 2 sequences x their tokens x width 32, fp32


# ------------------------------------------------------------------------------------------------ on two ranks


