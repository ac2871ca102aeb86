"""What the test modules share: the tolerances; the references (one device training a model of ``models.py`` with
`models.fit`, the same function every rank runs); the pipelined runs and their stages' results; one family of
comparisons of a run with its reference (one device, Lightning's DDP or ModelParallelStrategy): the parameters, the
gradients handed to the optimizer, everything logged, and against one device what every rank sees (callback metrics,
validate/test/predict results, samples, checkpoint decisions); and the checks more than one tier runs (the emulated
NCCL tier repeats some of the gloo tiers' checks). Test modules import from here and never from one another;
``conftest.py`` has pytest rewrite the asserts here as it does a test module's.

Why what is compared is compared (weights only where no adaptive optimizer trained them, gradients at the run's own
weights): see ``test_equivalence.py``'s docstring.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from _launch import RankResult, launch, run_script
from models import DelayedGradients, LoadWeightsEachStep, fit

from lightning_pp.schedule import Action, ActionType, Schedule, build_schedule
from lightning_pp.schedule.simulate import COMPUTE_CATEGORIES

# ------------------------------------------------------------------------------------------------ tolerances, names

# parameters after training, element-wise (fp32; SGD or alike: micro-batch gradient sums differ from full-batch ones in
# the last bits)
RTOL, ATOL = 1e-5, 5e-6
# gradients handed to the optimizer: each element within GRAD_RTOL of its tensor's largest magnitude, or of GRAD_NOISE
# times the step's largest gradient where that is more (a gradient zero in exact arithmetic is fp32 noise: see
# `assert_grads_match`)
GRAD_RTOL, GRAD_NOISE = 1e-5, 1e-4
# everything logged, callback metrics, validate/test results, checkpoint scores: within LOGGED_TOL, times the value
# where its magnitude is below 1; a perplexity (the exponential of a loss, whose error it multiplies by itself) within
# LOGGED_TOL of itself (see `within`)
LOGGED_TOL = 1e-5
PERPLEXITIES = ("val_ppl",)
RESUME_TOL = 1e-6  # parameters after resuming from a checkpoint, absolute (`assert_params_close`)
ADAPTIVE = ("Adam", "AdamW")  # optimizers whose weights are not compared (see test_equivalence.py)
SCHEDULE_NAMES = ["naive", "gpipe", "1f1b"]

Result = dict[str, Any]  # what `models.fit` returns as its result, on one device or on each rank


def prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message that keeps torch's mismatch report and says which tensor it is."""
    return lambda message: f"{prefix}: {message}"


def logged(history: list, key: str) -> list[tuple[int, float]]:
    """Every (step, value) of ``key`` in a logger's history."""
    return [(step, metrics[key]) for step, metrics in history if key in metrics]


# ------------------------------------------------------------------------------------------------ references


@cache
def reference(model: str, **options: Any) -> Result:
    """One device training ``model``: `models.fit` with ``options`` (hashable: a tuple for ``replay``), recording what
    every optimizer step applied. This process runs one compute thread, like every rank (see conftest.py)."""
    return {**fit(model, record_steps=True, **options).result, "recipe": {"model": model, **options}}


def delayed_reference(model: str, **options: Any) -> Result:
    """One device applying each batch's gradient one step late (``models.DelayedGradients``): what
    ``schedule="pipedream_2bw"`` must give."""
    return fit(model, callbacks=[DelayedGradients()], **options).result


def single_device_grads_at(want: Result, weights: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The gradients the single-device run of `reference` ``want`` hands its optimizer when every step starts from
    ``weights[step]`` (a pipelined run's): the same batch, clipping and accumulation, none of the drift."""
    again = {**want["recipe"], "record_steps": True, "after_fit": (), "callbacks": [LoadWeightsEachStep(weights)]}
    return fit(**again).result["grads"]


def single_device_state(**options: Any) -> dict[str, torch.Tensor]:
    """The MLP's parameters after training on one device, bounded by ``max_epochs`` (see `epochs_run`)."""
    return fit("mlp", max_steps=-1, **options).result["state"]


# ------------------------------------------------------------------------------------------------ pipelined runs


def pipelined(model: str, **kwargs: Any) -> dict[str, Any]:
    """A `train` run (``kwargs``: its options, the strategy's and ``trainer``'s) recording every optimizer step: what
    `assert_like` compares with a reference."""
    return {"scenario": "train", "kwargs": {"model": model, "record_steps": True, **kwargs}}


def epochs_run(model: str = "mlp", **kwargs: Any) -> dict[str, Any]:
    """A pipelined `train` run bounded by ``max_epochs`` (no step limit)."""
    return {"scenario": "train", "kwargs": {"model": model, "max_steps": -1, **kwargs}}


def stage_results(ranks: list[RankResult], index: int) -> list[Result]:
    """Every rank's result of run ``index`` (global rank order), or an AssertionError with the ranks' errors."""
    errors = {rank: result.errors[index] for rank, result in enumerate(ranks) if index in result.errors}
    if errors:
        summary = "; ".join(f"rank {rank}: {error['type']}: {error['message'][:300]}" for rank, error in errors.items())
        first = next(iter(errors.values()))
        raise AssertionError(f"{summary}\n{first['traceback']}")
    missing = [rank for rank, result in enumerate(ranks) if result.results[index] is None]
    if missing:
        tails = "\n".join(f"--- rank {rank} (exit code {ranks[rank].returncode}) ---\n{ranks[rank].output[-1500:]}"
                          for rank in missing)
        raise AssertionError(f"not run on ranks {missing} (an earlier run stopped them):\n{tails}")
    return [result.results[index] for result in ranks]


def check_all(world_size: int, runs: list[dict[str, Any]], checks: list[Callable[[list[Result], str], None]],
              timeout: float) -> None:
    """Launch ``runs`` and apply ``checks[i]`` to run ``i``'s stage results; report every failing run at once."""
    assert len(runs) == len(checks)
    ranks = launch(world_size, runs, timeout=timeout)
    failures = []
    for index, (run, check) in enumerate(zip(runs, checks, strict=True)):
        label = f"{world_size} stages {run['kwargs']}"
        try:
            check(stage_results(ranks, index), label)
        except AssertionError as error:
            failures.append(f"{label}: {error}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


def merged_state(results: list[Result]) -> dict[str, torch.Tensor]:
    """The full model from every stage's state dict; an entry present on several stages (replicas, a shared weight)
    must be identical there."""
    full: dict[str, torch.Tensor] = {}
    for stage, result in enumerate(results):
        for name, value in result["state"].items():
            if name in full:
                assert torch.equal(full[name], value), f"replicated {name} differs on rank {stage}"
            else:
                full[name] = value
    return full


def merged_steps(results: list[Result], key: str) -> list[dict[str, torch.Tensor]]:
    """Per optimizer step, every stage's recorded ``key`` ("grads" or "weights"); a replicated weight's must be
    identical on its stages."""
    steps = {len(result[key]) for result in results}
    assert len(steps) == 1, f"stages made different numbers of optimizer steps: {[len(r[key]) for r in results]}"
    merged: list[dict[str, torch.Tensor]] = []
    for step in range(steps.pop()):
        got: dict[str, torch.Tensor] = {}
        for stage, result in enumerate(results):
            for name, tensor in result[key][step].items():
                if name in got:
                    assert torch.equal(got[name], tensor), f"step {step}: {key} of replicated {name} differ on " \
                                                           f"rank {stage}"
                got[name] = tensor
        merged.append(got)
    return merged


def assemble(ranks: list[RankResult], index: int) -> tuple[dict[str, torch.Tensor], list]:
    """Run ``index``'s full model (`merged_state`) and what global rank 0 logged."""
    results = stage_results(ranks, index)
    return merged_state(results), results[0]["history"]


# ------------------------------------------------------------------------------------------------ comparisons


def within(got: float, want: float, key: str) -> bool:
    """Logged value ``key`` as the reference's: within LOGGED_TOL, times the value where its magnitude is below 1 or
    where it is a perplexity."""
    return abs(got - want) <= LOGGED_TOL * (abs(want) if key in PERPLEXITIES else min(1.0, abs(want)))


def assert_same_metrics(got: dict[str, float], want: dict[str, float], label: str, of: str = "") -> None:
    """The same metric names, each value `within` the reference's; ``of`` names the reference in the message."""
    assert sorted(got) == sorted(want), f"{label}: {sorted(got)} vs {of}{sorted(want)}"
    for key, value in want.items():
        assert within(got[key], value, key), f"{label}: {key} {got[key]} vs {of}{value}"


def assert_logged_match(history: list, want_history: list, label: str, keys: tuple[str, ...] | None = None) -> float:
    """The same logging calls (their steps, and the names at each) and every value (of those in ``keys``) `within`
    the reference's. Returns the largest difference."""
    assert [s for s, _ in history] == [s for s, _ in want_history], (
        f"{label}: logged at steps {[s for s, _ in history]}, the reference at {[s for s, _ in want_history]}")
    worst = 0.0
    for (step, got), (_, want) in zip(history, want_history, strict=True):
        assert sorted(got) == sorted(want), f"{label} step {step}: logged {sorted(got)}, the reference {sorted(want)}"
        for key in want if keys is None else [key for key in keys if key in want]:
            assert within(got[key], want[key], key), (f"{label} step {step}: {key} {got[key]} vs the reference's "
                                                      f"{want[key]}")
            worst = max(worst, abs(got[key] - want[key]))
    return worst


def assert_grads_match(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], label: str) -> float:
    """Every step's gradients, each element within GRAD_RTOL of its tensor's largest magnitude: a margin that
    summation order does not reach (measured: up to ~1e-6) and a pipelining mistake (a micro-batch missing or counted
    twice, a replicated weight's gradient not summed over stages, clipping by one stage's norm) exceeds many times. A
    tensor whose gradient is below GRAD_NOISE of the step's largest is measured against that: a gradient zero in exact
    arithmetic (an attention key's bias, which softmax ignores) is fp32 noise whose size follows the summation order.
    Returns the worst difference relative to its tensor's magnitude."""
    assert len(got) == len(want), f"{label}: {len(got)} optimizer steps, the reference made {len(want)}"
    worst = 0.0
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert sorted(got_step) == sorted(want_step), (f"{label} step {step}: gradients of {sorted(got_step)} applied, "
                                                       f"the reference applied {sorted(want_step)}")
        step_scale = max((grad.abs().max().item() for grad in want_step.values() if grad.numel()), default=0.0)
        for name, grad in want_step.items():
            scale = grad.abs().max().item() if grad.numel() else 0.0
            worst = max(worst, (got_step[name] - grad).abs().max().item() / (scale or 1.0) if grad.numel() else 0.0)
            torch.testing.assert_close(got_step[name], grad, rtol=0,
                                       atol=GRAD_RTOL * max(scale, GRAD_NOISE * step_scale) + 1e-12,
                                       msg=prefixed(f"{label} step {step} gradient of {name}"))
    return worst


def assert_same_entries(full: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert sorted(full) == sorted(want), (
        f"{label}: state-dict entries differ from the reference's: missing {sorted(set(want) - set(full))}, extra "
        f"{sorted(set(full) - set(want))}")


def assert_params_match(full: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str,
                        rtol: float = RTOL, atol: float = ATOL) -> float:
    """The same entries, each element within ``rtol``/``atol`` (RTOL, ATOL: the weights after training). Returns the
    largest difference."""
    assert_same_entries(full, want, label)
    for name, value in want.items():
        torch.testing.assert_close(full[name], value, rtol=rtol, atol=atol, msg=prefixed(f"{label} {name}"))
    return max(((full[n].float() - v.float()).abs().max().item() for n, v in want.items() if v.numel()), default=0.0)


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """The same parameters, each element within RESUME_TOL (a resumed run against the uninterrupted one)."""
    assert_params_match(got, want, label, rtol=0, atol=RESUME_TOL)


def assert_matches(full: dict[str, torch.Tensor], history: list, expected: Result, label: str) -> None:
    """Weights element-wise (trained with SGD or alike: see ``test_equivalence.py``'s docstring) and everything
    logged."""
    print(f"{label}: max |param difference| {assert_params_match(full, expected['state'], label):.2e}")
    assert_logged_match(history, expected["history"], label)


def assert_like(results: list[Result], want: Result, label: str, logged: tuple[str, ...] | None = None,
                params: bool | None = None) -> None:
    """A run's results on every rank (see `stage_results`) against a reference's: the state-dict entries over all
    stages (replicated ones identical); every optimizer step's gradients, at the run's own weights where the
    reference is a `reference` (one device run again from them), else the reference's own; everything rank 0 logged
    (the values of ``logged`` only, if given); the parameters where no ADAPTIVE optimizer trained them (or as ``params``
    says). Against one device, also what every rank sees: callback metrics, validate and test results, predictions,
    samples, batch-end outputs and the checkpoint decisions."""
    full = merged_state(results)
    assert_same_entries(full, want["state"], label)
    grad_diff = float("nan")
    if "grads" in want:
        grads = merged_steps(results, "grads")
        assert len(grads) == len(want["grads"]), f"{label}: {len(grads)} optimizer steps, the reference made " \
                                                 f"{len(want['grads'])}"
        expected = single_device_grads_at(want, merged_steps(results, "weights")) if "recipe" in want else want["grads"]
        grad_diff = assert_grads_match(grads, expected, label)
    loss_diff = assert_logged_match(results[0]["history"], want["history"], label, logged)
    if params is None:
        params = not any(name in ADAPTIVE for name in want.get("optimizers", ()))
    param_diff = assert_params_match(full, want["state"], label) if params else float("nan")
    if want["world_size"] == 1:
        for rank, result in enumerate(results):
            assert_seen_alike(result, want, f"{label} rank {rank}", logged)
    print(f"{label}: max |logged difference| {loss_diff:.1e}, max relative gradient difference {grad_diff:.1e}, "
          f"max |parameter difference| {param_diff:.1e}")


def assert_seen_alike(result: Result, want: Result, label: str, logged: tuple[str, ...] | None = None) -> None:
    """What one rank sees after fit as one device sees it: callback metrics (of ``logged`` only, if given), validate
    and test results, predictions, samples, batch-end outputs, and what ModelCheckpoint and EarlyStopping decided."""
    def kept(metrics: dict[str, float]) -> dict[str, float]:
        return metrics if logged is None else {k: v for k, v in metrics.items() if k in logged}

    assert_same_metrics(kept(result["callback_metrics"]), kept(want["callback_metrics"]), f"{label} callback metrics")
    for loop in ("validate", "test"):
        if loop in want:
            assert len(result[loop]) == len(want[loop]), label
            for got, expected in zip(result[loop], want[loop], strict=True):
                assert_same_metrics(got, expected, f"{label} {loop}")
    for key in ("predict", "samples"):
        if want.get(key):
            assert len(result[key]) == len(want[key]), f"{label}: {len(result[key])} {key}, one device {len(want[key])}"
            torch.testing.assert_close(result[key], want[key], rtol=RTOL, atol=ATOL, msg=prefixed(f"{label}: {key}"))
    if want["batch_end_outputs"] is not None:  # (batch index, the step output's keys, its predictions)
        assert len(result["batch_end_outputs"]) == len(want["batch_end_outputs"]), label
        for got, expected in zip(result["batch_end_outputs"], want["batch_end_outputs"], strict=True):
            assert got[:2] == expected[:2] and torch.equal(got[2], expected[2]), (label, got, expected)
    if "best_path" in want:
        assert result["best_path"] == want["best_path"], f"{label}: best_model_path"
        monitor = want["monitor"]
        assert within(result["best_score"], want["best_score"], monitor), f"{label}: best_model_score"
        assert [name for name, _ in result["top_k"]] == [name for name, _ in want["top_k"]], f"{label}: best_k_models"
        assert all(within(got, expected, monitor) for (_, got), (_, expected) in zip(result["top_k"], want["top_k"],
                                                                                      strict=True)), label
        assert result["files"] == want["files"], f"{label}: checkpoint files"
    if "stopped_epoch" in want:
        assert (result["stopped_epoch"], result["epochs"]) == (want["stopped_epoch"], want["epochs"]), label


def assert_trains_like(ranks: list[RankResult], index: int, run: dict[str, Any], expected: Result, label: str,
                       logged: tuple[str, ...] | None = None) -> None:
    """`assert_like` for run ``index`` of a launch (a `pipelined` ``run`` of the model ``expected`` trained)."""
    assert run["kwargs"]["model"] == expected["model"], f"{label}: compared with {expected['model']}'s reference"
    assert_like(stage_results(ranks, index), expected, label, logged)


def like(model: str, **options: Any) -> Callable[[list[Result], str], None]:
    """The `check_all` check of a run that must train as one device trains ``model`` (`reference` ``options``)."""
    def check(results: list[Result], label: str) -> None:
        assert_like(results, reference(model, **options), label)

    return check


def assert_same_outputs(got: Any, want: Any) -> None:
    """``got`` is ``want``: the same containers, plain values and tensors (values, dtypes, shapes)."""
    import numpy as np

    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        if want.is_sparse:
            want, got = want.to_dense(), got.to_dense()
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    elif isinstance(want, np.ndarray):
        assert np.array_equal(got, want)
    elif isinstance(want, dict):  # also Hugging Face's ModelOutput
        assert list(got) == list(want)
        for key in want:
            assert_same_outputs(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same_outputs(a, b)
    else:
        assert got == want


# ------------------------------------------------------------------------------------------------ lifecycle


def check_lifecycle(world_size: int, schedules: list[tuple[str, int]], expected: Result | None = None) -> None:
    """`models.Lifecycle` fit (2 epochs, validated; 2 sanity steps), then validated, tested and predicted, pipelined
    with each (schedule, micro-batches): as one device (or as ``expected``), its parameters compared whatever the
    optimizer, what every rank sees too."""
    runs = [pipelined("lifecycle", schedule=s, microbatches=m, trainer={"num_sanity_val_steps": 2})
            for s, m in schedules]
    want = expected or reference("lifecycle", num_sanity_val_steps=2)

    def check(results: list[Result], label: str) -> None:
        assert_like(results, want, label, params=True)

    check_all(world_size, runs, [check] * len(runs), timeout=300)


# ------------------------------------------------------------------------------------------------ failures


def check_user_error_reaches_the_other_stage() -> None:
    """The first stage's step fails; the last stage, waiting for its activation, fails naming the action and peer."""
    ranks = launch(2, [{"scenario": "train", "kwargs": {"model": "fails_on_rank_zero", "timeout": 20}}], timeout=120)
    assert ranks[0].errors[0]["type"] == "RuntimeError"
    error = ranks[1].errors[0]
    assert error["type"] in ("PipelineTimeoutError", "PipelineCommError"), error
    assert "Pipeline stage 1 (rank 1) failed in action 1RECV_F0" in error["message"]
    assert "peer stage 0 (rank 0)" in error["message"]


def check_dead_peer_raises_timeout_on_the_other_rank() -> None:
    """Rank 1 is killed at step 2; rank 0 fails naming its action and the peer it lost, well before the launch's
    timeout."""
    start = time.monotonic()
    ranks = launch(2, [{"scenario": "die_at_step", "kwargs": {"model": "mlp", "rank_to_kill": 1, "step": 2,
                                                               "timeout": 5}}], timeout=120)
    assert time.monotonic() - start < 100
    assert ranks[1].returncode == -9
    error = ranks[0].errors[0]
    assert error["type"] in ("PipelineTimeoutError", "PipelineCommError"), error
    assert "Pipeline stage 0 (rank 0) failed in action 0" in error["message"]
    assert "peer stage 1 (rank 1)" in error["message"]


# ------------------------------------------------------------------------------------------------ the benchmark

COMPARE_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "compare.py"


def run_compare(out: Path, *args: str) -> dict:
    """benchmarks/compare.py in a tiny configuration, writing to ``out``; its JSON report."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    result = run_script(
        [sys.executable, str(COMPARE_SCRIPT), "--hidden", "32", "--no-gpt", "--steps", "3", "--warmup", "1",
         "--monitor-steps", "2", "--out", str(out), *args],
        timeout=280, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "failed" not in result.stdout, result.stdout + result.stderr[-3000:]
    return json.loads((out / "compare.json").read_text())


# ------------------------------------------------------------------------------------------------ processes


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not terminated (a zombie waiting to be reaped counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state follows the parenthesised name


def job_pids(pid_dir: Path) -> list[int]:
    """The pids the ranks of an ``ignore_sigterm_forever`` job wrote to ``pid_dir`` (each its own and its child's)."""
    return [int(pid) for path in sorted(pid_dir.glob("*.pids")) for pid in path.read_text().split()]


def assert_all_ended(pids: list[int]) -> None:
    """SIGKILL is delivered at once but a process takes a moment to go: allow a few seconds."""
    deadline = time.monotonic() + 10
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    still = [pid for pid in pids if process_alive(pid)]
    assert not still, f"still running: {still}"


def summarized(fit: Callable[..., Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """What Lightning's model summary callback was given to print while ``fit(callbacks=...)`` ran (on global rank 0:
    each layer's row, the totals, the size), and what lightning_pp logged."""
    import logging

    from lightning.pytorch.callbacks import ModelSummary

    summaries: list[dict[str, Any]] = []

    class Recorded(ModelSummary):
        @staticmethod
        def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                      model_size: float, total_training_modes: dict[str, int], total_flops: int,
                      **summarize_kwargs: Any) -> None:
            summaries.append({"rows": dict(summary_data), "total": total_parameters,
                              "trainable": trainable_parameters, "size": model_size})

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("lightning_pp"), Keep(level=logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        fit(callbacks=[Recorded()])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return summaries, messages


# ------------------------------------------------------------------------------------------------ the monitor's trace


def assert_runs_as_scheduled(trace: dict[str, Any], schedule: Schedule) -> None:
    """The measured timeline (a Chrome trace of one step) holds each rank's compute actions in ``schedule``'s order,
    and each waited for its inputs from the other ranks: a stage's forward of a micro-batch starts after the previous
    stage's forward of it ended, its backward (or input gradient) after the next stage's. The ranks' clocks are one
    (one host), so this holds however busy the machine; a timeline gathered with wrong offsets, or with events
    attributed to the wrong rank, step or action, breaks it."""
    events = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in COMPUTE_CATEGORIES),
                    key=lambda e: e["ts"])
    for rank in range(schedule.num_ranks):
        got = [e["args"]["action"] for e in events if e["tid"] == rank]
        assert got == [str(a) for a in schedule.actions[rank] if a.is_compute], (schedule.name, rank)
    spans = {e["args"]["action"]: (e["ts"], e["ts"] + e["dur"]) for e in events}
    slack_us = 1.0  # the trace's microseconds are rounded floats
    last = schedule.num_stages - 1
    for name, (start, _) in spans.items():
        action = Action.parse(name)
        if action.type == ActionType.FORWARD and action.stage > 0:
            before = [str(Action(action.stage - 1, ActionType.FORWARD, action.microbatch))]
        elif action.type in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT) and action.stage < last:
            before = [str(Action(action.stage + 1, kind, action.microbatch))
                      for kind in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT)]
        else:
            continue
        (ended,) = [spans[b][1] for b in before if b in spans]
        assert start >= ended - slack_us, (schedule.name, name, start, ended)


def schedule_for(name: str, ranks: int, microbatches: int) -> Schedule:
    """The schedule ``name`` as the strategy builds it by default (2 stages per rank where it takes several)."""
    return build_schedule(name, ranks, microbatches,
                          stages_per_rank=2 if name in ("interleaved_1f1b", "dualpipev") else None)
