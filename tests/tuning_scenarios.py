"""What a rank of the closed-loop tests runs (``"tuning_scenarios:<name>"``): ``schedule="auto"`` trained for enough
steps that its closed loop decides, each rank recording the schedule of every step."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import lightning as L
import scenarios

import lightning_pp.tuning.closed_loop as closed_loop


class ScheduleRecorder(L.Callback):
    """The schedule (name, micro-batches) each training step ran on this rank."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        schedule = trainer.strategy.telemetry.last_schedule
        self.steps.append((schedule.name, schedule.num_microbatches))


class SlowLoop(L.Callback):
    """Time outside the schedule that the search cannot see: every step sleeps ``seconds`` after the batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def _forcing_a_switch(real: Any) -> Any:
    """``rechoose`` that reports a miss and switches to another schedule that keeps every block where it is (1F1B and
    GPipe trade places) with one micro-batch fewer: the switch, whatever the machine measured."""

    def rechoose(searched: Any, current: Any, measured: Any, keep_microbatches: bool) -> Any:
        decided = real(searched, current, measured, keep_microbatches)
        other = {"1f1b": "gpipe", "gpipe": "1f1b", "zb_h1": "1f1b"}[current.schedule]
        chosen = dataclasses.replace(current, schedule=other, microbatches=current.microbatches - 1)
        return dataclasses.replace(decided, missed=True, chosen=chosen, switch=True,
                                   message=f"{decided.message}\nforced: switching to {other} m={chosen.microbatches}")

    return rechoose


def auto_recording_schedules(model: str, slow_loop_s: float = 0.0, force_switch: bool = False,
                             **kwargs: Any) -> dict[str, Any]:
    """`scenarios.train` with ``schedule="auto"`` recording every optimizer step, also returning each step's schedule
    and auto's choice before and after its closed loop."""
    recorder = ScheduleRecorder()
    callbacks = [recorder] + ([SlowLoop(slow_loop_s)] if slow_loop_s else [])
    real = closed_loop.rechoose
    if force_switch:
        closed_loop.rechoose = _forcing_a_switch(real)
    try:
        result = scenarios.train(model, schedule="auto", trainer={"callbacks": callbacks}, record_steps=True, **kwargs)
    finally:
        closed_loop.rechoose = real
    return {**result, "schedules": recorder.steps}
