"""What the test modules share: the tolerances, the single-device references, assembling a pipelined run from its
stages, the comparisons, and the checks that more than one tier runs (the emulated NCCL tier repeats some of the gloo
tiers' checks). Test modules import from here and never from one another; ``conftest.py`` has pytest rewrite the
asserts here as it does a test module's.

Why what is compared is compared (weights only for SGD, gradients at the run's own weights): see
``test_equivalence.py``'s docstring.
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

import models
import pytest
import real_models
import torch
from _launch import RankResult, launch, run_script
from models import AppliedGradientRecorder, LoadWeightsEachStep, fit

from lightning_pp.schedule import Action, ActionType, Schedule, build_schedule
from lightning_pp.schedule.simulate import COMPUTE_CATEGORIES

# ------------------------------------------------------------------------------------------------ tolerances, names

# fp32 parameters after SGD: micro-batch gradient sums differ from full-batch ones in the last bits
RTOL, ATOL = 1e-5, 5e-6
GRAD_RTOL = 1e-5  # of each gradient tensor's largest magnitude (see `assert_grads_match` and `check_grads`)
LOSS_TOL = 1e-5  # logged training losses, absolute
METRIC_TOL = 1e-5  # logged metrics and ``callback_metrics``, absolute (`assert_same_metrics`)
METRIC_RTOL = 1e-5  # validation metrics and checkpoint scores of the real models, relative
RESUME_TOL = 1e-6  # parameters after resuming from a checkpoint, absolute (`assert_params_close`)
SCHEDULE_NAMES = ["naive", "gpipe", "1f1b"]
SGD_MODELS = ("mlp_sgd", "tied_sgd")  # weights compared element-wise after training


def prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message that keeps torch's mismatch report and says which tensor it is."""
    return lambda message: f"{prefix}: {message}"


def assert_same_metrics(got: dict[str, float], want: dict[str, float], label: str, of: str = "") -> None:
    """The same metric names, each value within ``METRIC_TOL``; ``of`` names the reference in the message."""
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=METRIC_TOL), f"{label}: {key} {got[key]} vs {of}{value}"


# ------------------------------------------------------------------------------------------------ models.py's models
# against one device (run in this process); a run's stages as `launch` returns them (a list of RankResult)


@cache
def reference(model: str, max_steps: int = 4, batch_size: int = 8, **trainer: Any) -> dict[str, Any]:
    """The single-device run; ``fit`` holds its arguments (see `single_device_grads_at`)."""
    recorder = AppliedGradientRecorder()
    module, logger = fit(model, max_steps=max_steps, batch_size=batch_size, callbacks=[recorder], **trainer)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "history": logger.history,
            "steps": len(recorder.grads),
            "fit": {"model_name": model, "max_steps": max_steps, "batch_size": batch_size, **trainer}}


def delayed_reference(model: str, **trainer: Any) -> dict[str, Any]:
    """One device applying each batch's gradient one step late (``models.DelayedGradients``): what
    ``schedule="pipedream_2bw"`` must give."""
    module, logger = fit(model, callbacks=[models.DelayedGradients()], **trainer)
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()}, "history": logger.history}


def single_device_grads_at(expected: dict[str, Any], weights: list[dict[str, torch.Tensor]]
                           ) -> list[dict[str, torch.Tensor]]:
    """The gradients the single-device run of ``expected`` hands its optimizer when every step starts from
    ``weights[step]`` (a pipelined run's): the same batch, clipping and accumulation, none of the drift."""
    recorder = AppliedGradientRecorder()
    fit(**expected["fit"], callbacks=[recorder, LoadWeightsEachStep(weights)])
    return recorder.grads


def pipelined(model: str, **kwargs: Any) -> dict[str, Any]:
    """A run that trains and records, at every optimizer step on every stage, the gradients and their weights."""
    return {"scenario": "train_recording_steps", "kwargs": {"model": model, **kwargs}}


def assemble(ranks: list, index: int) -> tuple[dict[str, torch.Tensor], list]:
    """The full model from every stage's parameters; replicated ones must agree across stages exactly."""
    full: dict[str, torch.Tensor] = {}
    for rank in ranks:
        assert index not in rank.errors, rank.errors[index]["traceback"]
        for name, value in rank.results[index]["state"].items():
            if name in full:
                assert torch.equal(full[name], value), f"replicated {name} differs between stages"
            else:
                full[name] = value
    return full, ranks[0].results[index]["history"]


def assemble_steps(ranks: list, index: int, key: str) -> list[dict[str, torch.Tensor]]:
    """Per optimizer step, every stage's recorded ``key`` ("grads" or "weights"); replicated weights' must agree
    across stages exactly."""
    per_rank = [rank.results[index][key] for rank in ranks]
    assert len({len(steps) for steps in per_rank}) == 1, f"optimizer steps per stage: {[len(s) for s in per_rank]}"
    merged: list[dict[str, torch.Tensor]] = []
    for per_stage in zip(*per_rank, strict=True):
        full: dict[str, torch.Tensor] = {}
        for tensors in per_stage:
            for name, tensor in tensors.items():
                if name in full:
                    assert torch.equal(full[name], tensor), f"replicated {name}: {key} differ between stages"
                full[name] = tensor
        merged.append(full)
    return merged


def assert_grads_match(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], label: str) -> None:
    """Every step's gradients, each element within ``GRAD_RTOL`` of its tensor's largest magnitude: a margin that
    summation order does not reach (measured: up to ~1e-6) and a pipelining mistake (a micro-batch missing or counted
    twice, a replicated weight's gradient not summed over stages, clipping by one stage's norm) exceeds many times."""
    assert len(got) == len(want), f"{label}: {len(got)} optimizer steps, single-device {len(want)}"
    worst = 0.0
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert sorted(got_step) == sorted(want_step), f"{label} step {step}: gradients of other parameters"
        for name, grad in want_step.items():
            scale = grad.abs().max().item()
            worst = max(worst, (got_step[name] - grad).abs().max().item() / (scale or 1.0))
            torch.testing.assert_close(got_step[name], grad, rtol=0, atol=GRAD_RTOL * scale + 1e-12,
                                       msg=prefixed(f"{label} step {step} {name}"))
    print(f"{label}: max |gradient difference| / scale {worst:.2e}")


def assert_logged_match(history: list, expected_history: list, label: str, keys: tuple[str, ...] | None = None) -> None:
    """The same steps logged, with the same loss and every other logged value (or those of ``keys``)."""
    logged = [(step, m["train_loss"]) for step, m in history if "train_loss" in m]
    wanted = [(step, m["train_loss"]) for step, m in expected_history if "train_loss" in m]
    assert [s for s, _ in logged] == [s for s, _ in wanted], label
    for (_, got), (_, want) in zip(logged, wanted, strict=True):
        assert abs(got - want) <= LOSS_TOL, f"{label}: logged loss {got} vs single-device {want}"
    compared = keys if keys is not None else {k for _, m in expected_history for k in m} - {"epoch"}
    for key in compared:
        got_values = [m[key] for _, m in history if key in m]
        want_values = [m[key] for _, m in expected_history if key in m]
        assert got_values == pytest.approx(want_values, abs=LOSS_TOL), f"{label}: {key}"


def assert_matches(full: dict[str, torch.Tensor], history: list, expected: dict[str, Any], label: str) -> None:
    """Weights element-wise (trained with SGD or alike: see ``test_equivalence.py``'s docstring) and everything
    logged."""
    assert sorted(full) == sorted(expected["state"]), label
    worst = max((full[n] - v).abs().max().item() for n, v in expected["state"].items())
    print(f"{label}: max |param difference| {worst:.2e}")
    for name, value in expected["state"].items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(f"{label} {name}"))
    assert_logged_match(history, expected["history"], label)


def assert_trains_like(ranks: list, index: int, run: dict[str, Any], expected: dict[str, Any], label: str,
                       logged: tuple[str, ...] | None = None) -> None:
    """A `pipelined` run against single-device training: every step's gradients at the run's own weights, everything
    logged (or the keys in ``logged``), and the weights after training where SGD trained."""
    full, history = assemble(ranks, index)
    assert sorted(full) == sorted(expected["state"]), label
    grads, weights = assemble_steps(ranks, index, "grads"), assemble_steps(ranks, index, "weights")
    assert len(grads) == expected["steps"], f"{label}: {len(grads)} optimizer steps, single-device {expected['steps']}"
    assert_grads_match(grads, single_device_grads_at(expected, weights), label)
    if run["kwargs"]["model"] in SGD_MODELS:
        assert_matches(full, history, expected, label)
    else:
        assert_logged_match(history, expected["history"], label, logged)


# ------------------------------------------------------------------------------------------------ lifecycle


@cache
def lifecycle_reference() -> dict[str, Any]:
    """``models.lifecycle`` on one device: fit, validate, test and predict."""
    return models.lifecycle(num_sanity_val_steps=2)


def check_lifecycle(world_size: int, schedules: list[tuple[str, int]], expected: dict[str, Any] | None = None) -> None:
    """Fit, validate, test and predict pipelined with each (schedule, micro-batches); compare with one device (or with
    ``expected``, what `models.lifecycle` returned)."""
    runs = [{"scenario": "lifecycle", "kwargs": {"schedule": s, "microbatches": m}} for s, m in schedules]
    ranks = launch(world_size, runs, timeout=300)
    expected = expected or lifecycle_reference()
    for index, run in enumerate(runs):
        label = f"{world_size} stages {run['kwargs']}"
        full, history = assemble(ranks, index)
        for name, value in expected["state"].items():
            torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL)
        assert [step for step, _ in history] == [step for step, _ in expected["history"]], label
        for (_, got), (_, want) in zip(history, expected["history"], strict=True):
            assert_same_metrics(got, want, label)
        for rank in ranks:  # every rank sees the same metrics, predictions and results
            result = rank.results[index]
            assert_same_metrics(result["callback_metrics"], expected["callback_metrics"], label)
            for got, want in zip(result["validate"] + result["test"], expected["validate"] + expected["test"],
                                 strict=True):
                assert_same_metrics(got, want, label)
            assert len(result["predict"]) == len(expected["predict"])
            for got, want in zip(result["predict"], expected["predict"], strict=True):
                torch.testing.assert_close(got["probs"], want["probs"], rtol=RTOL, atol=ATOL)
                assert torch.equal(got["label"], want["label"])


# ------------------------------------------------------------------------------------------------ checkpoints


def epochs_run(model: str = "mlp", **kwargs: Any) -> dict[str, Any]:
    """A pipelined `train` run bounded by ``max_epochs`` (no step limit)."""
    return {"scenario": "train", "kwargs": {"model": model, "max_steps": -1, **kwargs}}


def single_device_state(**kwargs: Any) -> dict[str, torch.Tensor]:
    """The MLP's parameters after training on one device, bounded by ``max_epochs`` (see `epochs_run`)."""
    module, _ = fit("mlp", max_steps=-1, **kwargs)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """The same parameters, each element within ``RESUME_TOL``."""
    assert sorted(got) == sorted(want), label
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=RESUME_TOL, msg=prefixed(f"{label} {name}"))


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


# ------------------------------------------------------------------------------------------------ real_models.py's
# models (the `train_real` scenario, see `job`); a run's stages as their results (see `stage_results`)

Result = dict[str, Any]


@cache
def real_model_reference(model: str) -> Result:
    """The single-device run (this process runs one compute thread, like every rank: see conftest.py)."""
    return real_models.run(model)


def job(model: str, **strategy: Any) -> dict[str, Any]:
    return {"scenario": "train_real", "kwargs": {"model": model, **strategy}}


def stage_results(ranks: list[RankResult], index: int) -> list[Result]:
    """Every stage's result of run ``index``, or an AssertionError with the ranks' errors."""
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
    """The full model from every stage's state dict; an entry present on several stages must be identical there."""
    full: dict[str, torch.Tensor] = {}
    for stage, result in enumerate(results):
        for name, value in result["state"].items():
            if name in full:
                assert torch.equal(full[name], value), f"replicated {name} differs on stage {stage}"
            else:
                full[name] = value
    return full


def merged_grads(results: list[Result]) -> list[dict[str, torch.Tensor]]:
    """Per optimizer step, every stage's applied gradients; a replicated weight's must be identical on its stages."""
    steps = {len(result["grads"]) for result in results}
    assert len(steps) == 1, f"stages made different numbers of optimizer steps: {[len(r['grads']) for r in results]}"
    merged: list[dict[str, torch.Tensor]] = []
    for step in range(steps.pop()):
        got: dict[str, torch.Tensor] = {}
        for stage, result in enumerate(results):
            for name, grad in result["grads"][step].items():
                if name in got:
                    assert torch.equal(got[name], grad), f"step {step}: gradient of replicated {name} differs on " \
                                                         f"stage {stage}"
                got[name] = grad
        merged.append(got)
    return merged


def check_grads(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], label: str) -> float:
    """Each element within GRAD_RTOL of its tensor's largest magnitude, plus 1e-9 of the step's largest gradient: a
    gradient that is zero in exact arithmetic (an attention key's bias, which softmax ignores) is fp32 noise whose
    size follows the summation order. Returns the worst relative difference."""
    assert len(got) == len(want), f"{len(got)} optimizer steps, single device made {len(want)}"
    worst = 0.0
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert sorted(got_step) == sorted(want_step), f"step {step}: gradients of {sorted(got_step)} applied, single " \
                                                      f"device applied {sorted(want_step)}"
        step_scale = max(grad.abs().max().item() for grad in want_step.values())
        for name, grad in want_step.items():
            scale = grad.abs().max().item()
            worst = max(worst, (got_step[name] - grad).abs().max().item() / (scale + 1e-30))
            torch.testing.assert_close(got_step[name], grad, rtol=0, atol=GRAD_RTOL * scale + 1e-9 * step_scale + 1e-12,
                                       msg=prefixed(f"{label} step {step} gradient of {name}"))
    return worst


def check_params(full: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> float:
    for name, value in want.items():
        torch.testing.assert_close(full[name], value, rtol=RTOL, atol=ATOL, msg=prefixed(f"{label} {name}"))
    return max(((full[n].float() - v.float()).abs().max().item() for n, v in want.items() if v.numel()), default=0.0)


def logged(history: list, key: str) -> list[tuple[int, float]]:
    return [(step, metrics[key]) for step, metrics in history if key in metrics]


def check_logged(history: list, want_history: list, key: str, abs_tol: float = 0.0, rel_tol: float = 0.0) -> float:
    got, want = logged(history, key), logged(want_history, key)
    assert [s for s, _ in got] == [s for s, _ in want], f"{key} logged at steps {[s for s, _ in got]}, single device " \
                                                        f"at {[s for s, _ in want]}"
    for (step, value), (_, wanted) in zip(got, want, strict=True):
        assert abs(value - wanted) <= abs_tol + rel_tol * abs(wanted), f"{key} at step {step}: {value} vs single " \
                                                                       f"device {wanted}"
    return max((abs(v - w) for (_, v), (_, w) in zip(got, want, strict=True)), default=0.0)


def compare(results: list[Result], want: Result, label: str, params: bool) -> None:
    """A `job`'s stage results against a single-device run: state-dict keys, logged losses, every step's applied
    gradients and (with ``params``) the parameters."""
    full = merged_state(results)
    assert sorted(full) == sorted(want["state"]), (
        f"state-dict keys over all stages differ from one device's: missing {sorted(set(want['state']) - set(full))}, "
        f"extra {sorted(set(full) - set(want['state']))}")
    loss_diff = check_logged(results[0]["history"], want["history"], "train_loss", abs_tol=LOSS_TOL)
    grad_diff = check_grads(merged_grads(results), want["grads"], label)
    param_diff = check_params(full, want["state"], label) if params else float("nan")
    print(f"{label}: max |loss difference| {loss_diff:.1e}, max relative gradient difference {grad_diff:.1e}, "
          f"max |parameter difference| {param_diff:.1e}")


def validated_and_predicted(model: str) -> Callable[[list[Result], str], None]:
    """Training, the validation metrics, the checkpoint decisions and (when the run predicts) every rank's
    predictions as on one device."""

    def check(results: list[Result], label: str) -> None:
        want = real_model_reference(model)
        compare(results, want, label, params=True)
        for key in ("val_loss", "val_ppl"):
            check_logged(results[0]["history"], want["history"], key, rel_tol=METRIC_RTOL)
        assert results[0]["best_path"] == want["best_path"], "best_model_path"
        for rank, result in enumerate(results):
            if "predictions" in want:
                torch.testing.assert_close(result["predictions"], want["predictions"], rtol=RTOL, atol=ATOL,
                                           msg=prefixed(f"{label}: rank {rank}'s predictions"))

    return check


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
