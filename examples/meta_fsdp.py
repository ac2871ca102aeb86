"""Train a model no process ever holds whole: built on the meta device, split into 2 pipeline stages, each stage's
weights sharded with FSDP2 over its 2 data-parallel replicas (4 processes on CPU).

    python examples/meta_fsdp.py                                   # Llama, 8 layers of width 128, 40 steps
    python examples/meta_fsdp.py --layers 16 --hidden 256 --save-dir /tmp/meta_fsdp     # a sharded checkpoint

Under ``trainer.init_module(empty_init=True)`` the module is built on the meta device, which costs no memory. In
``fit``, after the split, each rank gives storage only to what it holds (its stage's layers, the embedding or the head
its stage uses) and initializes it with the model's own code (Hugging Face's ``_init_weights``); with
``data_parallel_mode="fsdp"`` each layer then becomes an FSDP2 unit over the stage's replicas, so that between steps
a replica keeps half of its stage's weights, gradients and AdamW state. Ranks are laid out as ``rank = stage x 2 +
replica``: ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1. At the end rank 0 prints what each rank holds.

A meta-built model starts from values drawn per module from the job's seed, not from a checkpoint: to fine-tune
pretrained weights this way, save them once as a Lightning checkpoint and pass it to ``fit(ckpt_path=...)`` (weights
loaded into the meta module by hand are lost). With ``--save-dir`` the trained model is saved in the format
``--state-dict-type`` names: ``full`` (one file gathered on rank 0, which plain Lightning loads) or ``sharded`` (a
folder where every rank writes its own shards, nothing gathered: the one for models larger than a process).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_pp import PipelineParallelStrategy

VOCAB = 256


class Llama(L.LightningModule):
    """``LlamaForCausalLM`` from a small config; its decoder layers (``model.model.layers``) are the blocks."""

    def __init__(self, layers: int = 8, hidden: int = 128, heads: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=128,
            tie_word_embeddings=False))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)


def token_data(samples: int, length: int, seed: int = 0) -> TensorDataset:
    """Sequences ``start, start + stride, ...`` (mod the vocabulary): learnable once two tokens are seen."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    stride = torch.randint(1, 8, (samples, 1), generator=generator)
    return TensorDataset((start + stride * torch.arange(length)) % VOCAB)


def held_elements(module: torch.nn.Module) -> int:
    """The parameter elements this rank stores (of a DTensor, FSDP2's shard: its local part)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="per replica")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--devices", type=int, default=4, help="processes (default 4: 2 stages x 2 replicas)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu or auto")
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--state-dict-type", choices=["full", "sharded"], default="sharded",
                        help="format of --save-dir's checkpoint (default sharded)")
    parser.add_argument("--save-dir", type=Path, default=None, help="save the trained model here (model.ckpt)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per process
    L.seed_everything(0, verbose=False)  # the same on every rank: the meta build draws each module's values from it
    strategy = PipelineParallelStrategy(schedule=args.schedule, microbatches=args.microbatches,
                                        pipeline_parallel_size=args.pipeline_parallel_size,
                                        data_parallel_mode="fsdp", state_dict_type=args.state_dict_type)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        max_steps=args.max_steps, default_root_dir=args.log_dir, log_every_n_steps=10,
                        enable_checkpointing=False)
    with trainer.init_module(empty_init=True):
        model = Llama(args.layers, args.hidden, args.heads)  # on the meta device: no memory yet
    whole = sum(p.numel() for p in model.parameters())  # meta tensors know their shapes
    # Lightning's DistributedSampler shards the data over the replicas only: both stages of a pipeline load the same
    trainer.fit(model, DataLoader(token_data(2048, args.seq_len), batch_size=args.batch_size, shuffle=True))

    holdings: list[Any] = [None] * trainer.world_size  # (rank, stage, replica, elements) of every rank, on every rank
    torch.distributed.all_gather_object(holdings, (trainer.global_rank, strategy.stage, strategy.replica,
                                                   held_elements(model)))
    if trainer.is_global_zero:
        for rank, stage, replica, held in holdings:
            print(f"rank {rank} (stage {stage}, replica {replica}): holds {held:,} of the model's {whole:,} "
                  f"parameters ({held / whole:.0%})")
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
    if args.save_dir is not None:
        path = args.save_dir / "model.ckpt"
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; with the optimizer: resumable
        if trainer.is_global_zero:
            print(f"saved {path} ({args.state_dict_type})")


if __name__ == "__main__":
    main()
