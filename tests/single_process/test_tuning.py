"""Single-process tier: ``schedule="auto"``'s search (:mod:`lightning_pp.tuning.search`) on costs given by hand.
The multi-process tests are in ``multi_process/test_tuning_multiprocess.py``."""

from __future__ import annotations

import pytest

from lightning_pp import PipelineConfigError, PipelineParallelStrategy
from lightning_pp.tuning.search import MeasuredCosts, search

BLOCKS = 8


def costs(per_row: float = 1e-4, slow_first: float = 8.0, saved_per_row: float = 1e6, latency: float = 0.0,
          framework: float = 0.0) -> MeasuredCosts:
    """F = I = W = ``per_row`` seconds per row for each block (the first ``slow_first`` times as long), measured at
    micro-batches of 2 and 16 rows; ``saved_per_row`` bytes kept for backward per block and row."""
    def per_block(rows: int, value: float) -> list[float]:
        return [value * rows * (slow_first if block == 0 else 1) for block in range(BLOCKS)]

    def both(value: float) -> tuple[list[float], list[float]]:
        return per_block(2, value), per_block(16, value)

    return MeasuredCosts(sizes=(2.0, 16.0), forward=both(per_row), input_backward=both(per_row),
                         weight_backward=both(per_row), saved_bytes=both(saved_per_row),
                         output_bytes=both(saved_per_row / 8), before=((0.0, 0.0), (0.0, 0.0)),
                         after=((0.0, 0.0), (0.0, 0.0)), outside_saved_bytes=((0.0, 0.0), (0.0, 0.0)),
                         latency_s=latency, seconds_per_byte=0.0,
                         framework_s=framework)


def test_costs_between_the_measured_sizes_follow_the_line_through_them() -> None:
    measured = costs()
    assert measured.at(9.0, measured.forward)[1] == pytest.approx(9e-4)
    assert measured.at(9.0, measured.forward)[0] == pytest.approx(8 * 9e-4)
    assert measured.at(0.0, ([1.0], [0.0]))[0] == pytest.approx(1.0 + 2 / 14)  # extrapolated
    assert measured.at(100.0, ([1.0], [0.0]))[0] == 0.0  # never below zero


def test_the_slow_first_block_gets_a_stage_of_its_own_and_a_zero_bubble_schedule() -> None:
    """The model of the issue: the hand default (1F1B, 4 micro-batches, an even split) is beaten by a split that
    gives the slow block a stage alone, and the simulator prefers a split backward for the bubble."""
    candidates = search(costs(), num_ranks=2, batch_size=32)
    best = candidates[0]
    default = next(c for c in search(costs(), num_ranks=2, batch_size=32, microbatches=4, balance=[4, 4])
                   if c.schedule == "1f1b" and not c.recompute)
    assert best.balance[0] == 1 if best.stages_per_rank == 1 else best.balance[0] <= 1
    assert best.schedule in ("zb_h1", "zbv", "dualpipev")
    assert best.step_s < 0.85 * default.step_s
    assert not best.recompute
    assert [c.step_s for c in candidates if not c.recompute] == sorted(c.step_s for c in candidates
                                                                       if not c.recompute)


def test_per_action_costs_favour_fewer_microbatches() -> None:
    """With a fixed cost per action and per message (tiny micro-batches), more micro-batches stop paying."""
    cheap = search(costs(per_row=1e-6, slow_first=1.0), num_ranks=2, batch_size=32)[0]
    costly = search(costs(per_row=1e-6, slow_first=1.0, latency=1e-3, framework=1e-3), num_ranks=2, batch_size=32)[0]
    assert costly.microbatches < cheap.microbatches


def test_memory_budget_limits_the_microbatches_in_flight_then_needs_recomputation() -> None:
    free = search(costs(), num_ranks=2, batch_size=32)[0]
    budget = 0.5 * free.peak_bytes
    bounded = search(costs(), num_ranks=2, batch_size=32, max_memory=budget)
    assert all(c.peak_bytes <= budget for c in bounded)
    # a budget below what any configuration without recomputation holds: only recomputation fits
    without = min(c.peak_bytes for c in search(costs(), num_ranks=2, batch_size=32, recompute=False))
    tight = search(costs(), num_ranks=2, batch_size=32, max_memory=0.9 * without)
    assert tight[0].recompute
    with pytest.raises(PipelineConfigError, match="found no configuration whose activations fit max_memory=1 bytes"):
        search(costs(), num_ranks=2, batch_size=32, max_memory=1)


def test_what_the_user_fixed_is_kept() -> None:
    fixed = search(costs(), num_ranks=2, batch_size=32, microbatches=8, stages_per_rank=1, balance=[2, 6],
                   recompute=False)
    assert {(c.microbatches, c.stages_per_rank, c.balance, c.recompute) for c in fixed} == {(8, 1, (2, 6), False)}
    assert {c.schedule for c in fixed} == {"gpipe", "1f1b", "zb_h1"}
    assert {c.schedule for c in search(costs(), num_ranks=2, batch_size=32, stages_per_rank=2)} == {
        "interleaved_1f1b", "zbv", "dualpipev"}


def test_auto_options_are_checked_before_any_collective() -> None:
    PipelineParallelStrategy(schedule="auto", max_memory=0.8, microbatches=8)
    with pytest.raises(PipelineConfigError, match=r"max_memory=\d+ only bounds what schedule='auto' chooses"):
        PipelineParallelStrategy(schedule="1f1b", max_memory=2**30)
    with pytest.raises(PipelineConfigError, match="max_memory='big'"):
        PipelineParallelStrategy(schedule="auto", max_memory="big")  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError, match="schedule='auto' measures the blocks on global rank 0 alone"):
        PipelineParallelStrategy(schedule="auto", tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(PipelineConfigError, match="balance='params' with schedule='auto', which splits the blocks"):
        PipelineParallelStrategy(schedule="auto", balance="params")


def test_nothing_to_search_is_our_error() -> None:
    with pytest.raises(PipelineConfigError, match="found no configuration to run 8 blocks on 16 ranks with a batch of "
                                                  "32 and nothing fixed"):
        search(costs(), num_ranks=16, batch_size=32)
    with pytest.raises(PipelineConfigError, match=r"and stages_per_rank=5: a schedule needs a block per stage"):
        search(costs(), num_ranks=2, batch_size=32, stages_per_rank=5)


def test_auto_in_one_process_chooses_then_keeps_its_choice(caplog: pytest.LogCaptureFixture) -> None:
    """One process holding every stage (several stages per rank are candidates): fit measures, prints and runs its
    choice, which the strategy keeps for a later run (its options are concrete from then on)."""
    import lightning as L
    from models import Lifecycle, make_data

    strategy = PipelineParallelStrategy(schedule="auto")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    module = Lifecycle()
    trainer.fit(module, make_data("lifecycle"))
    choice = strategy.telemetry.auto_choice
    assert choice is not None and "schedule='auto' chose" in caplog.text
    resolved = strategy.resolved_options
    assert (resolved.schedule, resolved.microbatches) == (choice.schedule, choice.microbatches)
    assert (strategy.options.schedule, strategy.options.microbatches) == ("auto", None)  # the user's, as given
    trainer.validate(module, make_data("lifecycle", seed=3), verbose=False)
    assert strategy.resolved_options.schedule == choice.schedule


def test_auto_outside_fit_runs_the_default_keeping_what_is_fixed(caplog: pytest.LogCaptureFixture) -> None:
    import lightning as L
    from models import Lifecycle, make_data

    strategy = PipelineParallelStrategy(schedule="auto", stages_per_rank=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.validate(Lifecycle(), make_data("lifecycle"), verbose=False)
    assert strategy.resolved_options.schedule == "interleaved_1f1b" and strategy.telemetry.auto_choice is None
    assert strategy.options.schedule == "auto"
    assert "schedule='auto' runs the default configuration (interleaved_1f1b): trainer.validate does not train" in (
        caplog.text)


def test_a_batch_that_does_not_divide_is_timed_at_its_micro_batches_sizes() -> None:
    """33 samples in 4 micro-batches are 9, 8, 8, 8 (the runtime's split), not 8.25 each: the 9-sample micro-batch
    crosses every stage, so the step costs more than a quarter of the way from 32 samples to 36."""
    def step(batch: int) -> float:
        return next(c for c in search(costs(slow_first=1.0), num_ranks=2, batch_size=batch, microbatches=4,
                                      balance=[4, 4], recompute=False) if c.schedule == "1f1b").step_s

    assert step(33) > step(32) + 0.25 * (step(36) - step(32)) + 1e-6


def test_an_activation_two_blocks_save_is_held_once_per_stage() -> None:
    """Blocks of Linear then ReLU: each saves its input (which the block before saved as its ReLU's output) and its
    own output. Measured on a real step, each such tensor counts once in a stage, and again in a stage that receives
    it: a stage of k blocks holds k + 1 activations, not 2k (auto's memory budget once rejected configurations that
    fit)."""
    import lightning as L
    import torch
    from torch import nn

    from lightning_pp.tuning.balance import measure_block_costs
    from lightning_pp.tuning.search import stage_costs

    class Blocks(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.blocks(batch).pow(2).mean()

    activation = 32 * 64 * 4  # one micro-batch's hidden state, fp32
    measured = measure_block_costs(Blocks(), "blocks", torch.randn(32, 64), device=torch.device("cpu"),
                                   detailed=True)
    assert measured.saved_bytes == [2 * activation] + [activation] * 3  # the first block's input is its own
    assert measured.shared_bytes == [0.0] + [activation] * 3
    per_block = (measured.saved_bytes, measured.saved_bytes)
    costs = MeasuredCosts(sizes=(32.0, 32.0), forward=per_block, input_backward=per_block, weight_backward=per_block,
                          saved_bytes=per_block, output_bytes=(measured.output_bytes, measured.output_bytes),
                          before=((0.0, 0.0), (0.0, 0.0)), after=((0.0, 0.0), (0.0, 0.0)),
                          outside_saved_bytes=((0.0, 0.0), (0.0, 0.0)), latency_s=0.0, seconds_per_byte=0.0,
                          framework_s=0.0, shared_bytes=(measured.shared_bytes, measured.shared_bytes))
    assert stage_costs(costs, 2, 32.0, recompute=False, balance=[2, 2]).held == [3 * activation, 3 * activation]
    assert stage_costs(costs, 2, 32.0, recompute=False, balance=[1, 3]).held == [2 * activation, 4 * activation]
