"""Single-process tier: what keeps host and accelerator tensors apart on the GPU path, checked without a GPU.

A CPU run cannot mix devices, so a helper that builds a tensor on the host and combines it with one computed on the
GPU passes every CPU test and fails on the first GPU step (the desk-check found `self.log` values combined with host
weights). The audit below makes every tensor the package creates name its device, so each such choice is deliberate
and visible in review; the rest checks the GPU-only decisions that can be reached from a CPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

import lightning_pp
from lightning_pp import PipelineConfigError, PipelineParallelStrategy
from lightning_pp.model.logs import LogRecorder, stacked, weighted_mean

PACKAGE = Path(lightning_pp.__file__).parent
# torch functions that create a tensor on the default device unless told otherwise (the `*_like` ones follow their
# input, `frombuffer` is always on the host)
FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "linspace", "eye", "rand", "randn",
             "randint", "randperm"}


def created_without_device(source: str) -> list[tuple[int, str]]:
    """(line, call) of each ``torch.<factory>(...)`` call in ``source`` that passes no ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(keyword.arg == "device" for keyword in node.keywords)):
            found.append((node.lineno, f"torch.{node.func.attr}"))
    return found


def test_audit_finds_a_tensor_created_without_its_device() -> None:
    """What the desk-check found in `_logs` (the micro-batch weights of a logged mean) is what the audit flags."""
    assert created_without_device("weight = torch.tensor(weights, dtype=torch.float64)") == [(1, "torch.tensor")]
    assert created_without_device("w = torch.tensor(ws, device=values.device); z = torch.zeros_like(w)") == []


def test_every_tensor_the_package_creates_names_its_device() -> None:
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
                 for path in sorted(PACKAGE.rglob("*.py")) for line, call in created_without_device(path.read_text())]
    assert not offenders, ("these calls create a tensor on the default device (the host); pass device= (the stage's "
                           "device, or 'cpu' where the host is meant):\n" + "\n".join(offenders))


def test_logged_values_combine_on_the_device_they_were_logged_on() -> None:
    """Finding 2: the micro-batches' weights were made on the host and multiplied with values on the accelerator.
    The meta device stands in for one here: it holds no values, but it refuses to meet a host tensor, as CUDA does."""
    on_device = stacked([torch.tensor(1.5, device="meta"), torch.tensor(2.5, device="meta")])
    assert on_device.device.type == "meta" and on_device.dtype == torch.float64
    assert weighted_mean(on_device, [4.0, 4.0]).device.type == "meta"


def test_a_number_and_tensors_logged_under_one_name_combine() -> None:
    import lightning.pytorch as pl

    module, recorder = pl.LightningModule(), LogRecorder()
    values: list[torch.Tensor | float] = [torch.tensor(1.0), 3.0]
    for microbatch, value in enumerate(values):
        with recorder.recording(module, microbatch):
            module.log("train_loss", value)
    [(name, combined, _)] = recorder.combine([1.0, 3.0])
    assert name == "train_loss" and combined == pytest.approx(2.5)


def test_gloo_with_cuda_devices_is_refused_before_any_collective() -> None:
    strategy = PipelineParallelStrategy(process_group_backend="gloo", parallel_devices=[torch.device("cuda", 0)],
                                        cluster_environment=LightningEnvironment())
    with pytest.raises(PipelineConfigError, match=r"process_group_backend='gloo' cannot carry the pipeline's transfers "
                                                  r"between CUDA devices \(cuda:0\).*process_group_backend='nccl'"):
        strategy.setup_environment()
