"""Every example in examples/ but the main one (test_example_multiprocess.py) runs as it stands, shrunk by its own flags
to a few steps of a tiny model: each in a subprocess, checked by its exit code and what it prints or writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _launch import run_script

REPO = Path(__file__).parents[2]
EXAMPLES = REPO / "examples"
PYTHON = sys.executable
BIN = Path(PYTHON).parent  # the environment's scripts: torchrun
LAUNCH_TIMEOUT_S = 240  # one example on a busy 2-core machine takes 20-70 s; pytest's own timeout is the mark's
# what pytest's environment or an earlier test may hold that the launchers would take for a job of theirs, and the
# multinode scripts' settings
_JOB_ENV = re.compile(r"(RANK|LOCAL_RANK|WORLD_SIZE|NODE_RANK|GROUP_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                      r"TORCHELASTIC_.*|SLURM_.*|NNODES|NPROC_PER_NODE|PIPELINE_PARALLEL_SIZE|ACCELERATOR|PYTHON)")


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not _JOB_ENV.fullmatch(key)}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = run_script([str(arg) for arg in args], timeout=LAUNCH_TIMEOUT_S, env=env or _env(), cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-10000:]
    return result


def _final_loss(stdout: str) -> float:
    final = [line for line in stdout.splitlines() if line.startswith("final train_loss")]
    assert len(final) == 1, stdout[-3000:]  # printed by global rank 0 only
    return float(final[0].split()[-1])


@pytest.mark.timeout(300)
def test_finetune_hf_causal_lm_trains_and_saves_a_hugging_face_folder(tmp_path: Path) -> None:
    result = _run([PYTHON, EXAMPLES / "finetune_hf_causal_lm.py", "--max-steps", "3", "--layers", "2", "--hidden", "32",
                   "--samples", "64", "--batch-size", "8", "--log-dir", tmp_path, "--save-dir", tmp_path / "out"],
                  tmp_path)
    assert 0 < _final_loss(result.stdout) < 6  # ln(128) = 4.85 at the start
    assert json.loads((tmp_path / "out/hf/config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "out/hf/model.safetensors").stat().st_size > 0
    state = torch.load(tmp_path / "out/finetuned.ckpt", weights_only=True)["state_dict"]
    assert {"model.model.layers.0.mlp.up_proj.weight", "model.model.layers.1.mlp.up_proj.weight",
            "model.lm_head.weight"} <= set(state)  # gathered from both stages


@pytest.mark.timeout(300)
def test_lightning_cli_takes_the_strategy_from_the_yaml(tmp_path: Path) -> None:
    result = _run([PYTHON, EXAMPLES / "cli/train.py", "fit", "--config", EXAMPLES / "cli/config.yaml",
                   "--trainer.max_steps=3", "--model.layers=2", "--model.dim=32", "--data.corpus_length=5000"],
                  tmp_path)
    assert "step    3 sample: 'the " in result.stdout  # the model's hook, on global rank 0
    run = tmp_path / "lightning_logs/gpt_cli/version_0"
    saved = (run / "config.yaml").read_text()  # LightningCLI's copy of the resolved configuration
    assert "class_path: lightning_pp.PipelineParallelStrategy" in saved and "schedule: 1F1B" in saved
    assert list(run.glob("events.out.tfevents.*"))
    (checkpoint,) = run.glob("checkpoints/*.ckpt")
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert {"blocks.0.qkv.weight", "blocks.1.qkv.weight"} <= set(state)  # gathered from both stages


@pytest.mark.timeout(300)
def test_torchrun_script_runs_standalone_on_one_machine(tmp_path: Path) -> None:
    env = _env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", NPROC_PER_NODE="2", ACCELERATOR="cpu")
    result = _run(["bash", EXAMPLES / "multinode/torchrun.sh", "--max-steps", "3", "--sample-every", "0",
                   "--log-dir", tmp_path], tmp_path, env)
    assert _final_loss(result.stdout) > 0
    assert list(tmp_path.glob("gpt_pipeline/version_0/events.out.tfevents.*"))


# stands in for srun: records the command it was given (one argument a line)
_FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$SRUN_LOG"
"""


@pytest.mark.timeout(120)
def test_slurm_script_runs_train_gpt_with_srun() -> None:
    """The batch script parses, asks for one task per GPU, and runs the main example through ``srun`` with the job's
    tasks per node and nodes (what torchrun.sh runs under torchrun); arguments given to ``sbatch`` reach the example.
    A real launch under Lightning's SLURM environment needs SLURM's per-task variables, which only srun sets."""
    script = EXAMPLES / "multinode/slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.MULTILINE))
    assert directives["ntasks-per-node"] == directives["gpus-per-node"] == "4" and directives["nodes"] == "2"
    with tempfile.TemporaryDirectory() as tmp:
        srun, log = Path(tmp) / "srun", Path(tmp) / "srun.log"
        srun.write_text(_FAKE_SRUN)
        srun.chmod(0o755)
        env = _env(PATH=f"{tmp}{os.pathsep}{os.environ['PATH']}", SRUN_LOG=str(log), SLURM_SUBMIT_DIR=str(REPO),
                   SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="4", PYTHON=PYTHON)
        subprocess.run(["bash", str(script), "--max-steps", "3"], check=True, env=env, cwd=tmp, timeout=60)
        assert log.read_text().splitlines() == [
            PYTHON, "examples/train_gpt.py", "--accelerator", "gpu", "--devices", "4", "--num-nodes", "2",
            "--pipeline-parallel-size", "2", "--max-steps", "3"]
    assert (REPO / "examples/train_gpt.py").exists()  # srun runs it from the submit directory (the repository)


@pytest.mark.timeout(300)
def test_meta_build_with_fsdp_in_each_stage_holds_a_quarter_per_rank(tmp_path: Path) -> None:
    result = _run([PYTHON, EXAMPLES / "meta_fsdp.py", "--max-steps", "2", "--layers", "4", "--hidden", "32",
                   "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--log-dir", tmp_path,
                   "--save-dir", tmp_path / "out"], tmp_path)
    assert _final_loss(result.stdout) > 0
    held = {int(rank): (int(stage), int(replica), int(part.replace(",", "")), int(whole.replace(",", "")))
            for rank, stage, replica, part, whole in re.findall(
                r"rank (\d) \(stage (\d), replica (\d)\): holds ([\d,]+) of the model's ([\d,]+) parameters",
                result.stdout)}
    assert sorted(held) == [0, 1, 2, 3], result.stdout[-3000:]
    for rank, (stage, replica, part, whole) in held.items():
        assert (stage, replica) == divmod(rank, 2)  # rank = stage x replicas + replica
        assert 0.2 * whole < part < 0.3 * whole  # half a stage: its layers and its end's embedding or head, sharded
    assert len(list((tmp_path / "out/model.ckpt").glob("*.distcp"))) == 4  # every rank wrote its own shards


@pytest.mark.timeout(300)
def test_generate_in_predict_step_through_the_pipeline(tmp_path: Path) -> None:
    result = _run([PYTHON, EXAMPLES / "generate.py", "--train-steps", "2", "--prompts", "4", "--new-tokens", "3",
                   "--layers", "2", "--hidden", "32", "--log-dir", tmp_path], tmp_path)
    lines = re.findall(r"^prompt \[([\d, ]+)\] -> \[([\d, ]+)\]", result.stdout, re.MULTILINE)
    assert len(lines) == 4, result.stdout[-3000:]  # rank 0 prints; every rank generated the same
    assert all(len(prompt.split(",")) == 4 and len(new.split(",")) == 3 for prompt, new in lines)
    assert "generated 4 continuations of 3 tokens" in result.stdout
