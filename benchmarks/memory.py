"""Memory per rank of a GPT-2-medium-sized model: one device against 2 stages, 2 stages x 2 DDP replicas, 2 stages x
2 replicas sharded with FSDP2 (``data_parallel_mode="fsdp"``) and 2 stages x 2 tensor-parallel ranks, on CPU with gloo
(memory, not speed: CPU is fine for it).

Run ``python benchmarks/memory.py`` (``--layouts one pp2 pp2xddp2 pp2xfsdp2 pp2xtp2``, ``--layers 24 --width 1024``).
Each layout trains Hugging Face ``LlamaForCausalLM`` of GPT-2 medium's size (24 layers of width 1024, 16 heads, an MLP
of 2816, a vocabulary of 50257 tied to the head; 360M weights, random init; Llama rather than GPT-2 because GPT-2's
``Conv1D`` layers take no DTensor plan) with AdamW for 2 steps of batch 4 x 64 tokens (1F1B, 4 micro-batches), in one
process per rank with one CPU thread each. ``pp2xtp2`` splits each layer with the usual Megatron plan in
``configure_model`` (attention projections and the MLP's gate and up column-wise, the output and down projections
row-wise). The pipelined layouts build the model on the meta device (``trainer.init_module(empty_init=True)``); one
device builds it normally. Per rank it prints the parameters,
gradients and AdamW state it holds after a step (sharded tensors: the local shard), and the peak of its resident memory
over the run above what it held before building the model (everything: weights, gradients, optimizer state,
activations, gathered FSDP weights, transfer buffers, what the allocator keeps).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _workers import answer_as_worker, run_workers  # beside this script
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp import PipelineParallelStrategy

MIB = 2**20
LAYOUTS = {  # name -> (processes, strategy options; None: plain Lightning on one device)
    "one": (1, None),
    "pp2": (2, {}),
    "pp2xddp2": (4, {"pipeline_parallel_size": 2}),
    "pp2xfsdp2": (4, {"pipeline_parallel_size": 2, "data_parallel_mode": "fsdp"}),
    "pp2xtp2": (4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
}


class Llama(L.LightningModule):
    """Hugging Face Llama (head tied to the embedding), random init, AdamW; its layers split by tensor parallelism in
    ``configure_model`` where the strategy's mesh has a tensor-parallel dimension larger than one."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=50257, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
            num_attention_heads=width // 64, num_key_value_heads=width // 64, tie_word_embeddings=True))

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or mesh["tensor_parallel"].size() == 1:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {**{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in self.model.model.layers:
            parallelize_module(layer, mesh["tensor_parallel"], plan)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _resident_kib(field: str) -> int:  # VmRSS: now; VmHWM: the peak since the last reset (Linux)
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _resident_kib("VmRSS:") * 1024


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[tuple[int, int], torch.Tensor] = {}  # a tensor held twice (tied weights) counts once
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[(local.data_ptr(), local.numel())] = local
    return sum(t.numel() * t.element_size() for t in seen.values())


class Meter(L.Callback):
    """Gradient bytes before the optimizer step, optimizer state after it, and the peak of resident memory."""

    def __init__(self, before_build: int) -> None:
        self.before_build = before_build
        self.result: dict[str, float] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.result["grads_mib"] = _local_bytes(p.grad for p in pl_module.parameters() if p.grad is not None) / MIB

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           i: int) -> None:
        self.result["run_peak_mib"] = (_resident_kib("VmHWM:") * 1024 - self.before_build) / MIB
        optimizer = trainer.optimizers[0]
        self.result["params_mib"] = _local_bytes(pl_module.parameters()) / MIB
        self.result["optimizer_mib"] = _local_bytes(t for s in optimizer.state.values() for t in s.values()
                                                    if isinstance(t, torch.Tensor) and t.dim() > 0) / MIB


def worker(spec: dict[str, Any]) -> list[Any]:
    """Train the spec's layout on this process's rank; every rank's figures (global rank 0's are reported)."""
    torch.set_num_threads(1)
    processes, options = LAYOUTS[spec["layout"]]
    L.seed_everything(0, verbose=False)
    before_build = _reset_peak()
    meter = Meter(before_build)
    strategy: Any = "auto" if options is None else PipelineParallelStrategy(schedule="1f1b", microbatches=4,
                                                                            **options)
    trainer = L.Trainer(accelerator="cpu", devices=processes, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[meter], strategy=strategy)
    with trainer.init_module(empty_init=options is not None):
        module = Llama(spec["layers"], spec["width"])
    data = TensorDataset(torch.randint(50257, (16, 64)))  # 2 batches per replica (2 replicas at most)
    trainer.fit(module, DataLoader(data, batch_size=4))
    rows: list[Any] = [meter.result]
    if processes > 1:
        rows = [None] * processes
        torch.distributed.all_gather_object(rows, meter.result)
    return rows


def run(layout: str, layers: int, width: int) -> list[dict[str, float]]:
    spec = {"layout": layout, "layers": layers, "width": width}
    return run_workers(__file__, LAYOUTS[layout][0], spec)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        answer_as_worker(args.worker, worker)
        return
    print("| layout | rank | parameters MiB | gradients MiB | AdamW state MiB | peak over the run MiB |")
    print("|---|---|---|---|---|---|")
    for layout in args.layouts:
        for rank, row in enumerate(run(layout, args.layers, args.width)):
            print(f"| {layout} | {rank} | {row['params_mib']:.0f} | {row['grads_mib']:.0f} | "
                  f"{row['optimizer_mib']:.0f} | {row['run_peak_mib']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
