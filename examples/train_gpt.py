"""Train a small GPT-style character model pipeline-parallel on CPU with 2 processes (a minute or two on 2 busy cores).

    python examples/train_gpt.py

The transformer blocks live in an ``nn.ModuleList`` that ``forward`` loops over, passing each block the causal mask it
builds (the nanoGPT / Hugging Face way); the strategy finds that list and splits it over the two processes. The token
embedding, the position embedding and the head (tied to the token embedding) sit outside it and are held by both. The
module is written as for single-device Lightning: only the Trainer's strategy names the pipeline; every 50 steps it
prints a greedy sample, generated in a hook one character per pass through the model. TensorBoard logs go to
``lightning_logs/gpt_pipeline`` (loss, perplexity and the PipelineMonitor's ``pipeline/*`` timings and timeline
image): ``tensorboard --logdir lightning_logs``. Perfetto traces land in ``lightning_logs/pipeline_traces``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_pp import PipelineMonitor, PipelineParallelStrategy

# the default learning rate of each optimizer (cosine decay to 0 over the run): the one whose synchronous run reached
# the lowest loss in 400 steps among 3e-3, 5e-3, 1e-2 and 2e-2 (Muon) and 1e-3, 3e-3 (AdamW)
LEARNING_RATES = {"adamw": 3e-3, "muon": 1e-2}
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
         "a", "pipeline", "keeps", "every", "device", "busy"]


def make_corpus(length: int = 60_000, seed: int = 0) -> str:
    """Sentences of 4 to 9 words drawn from a fixed vocabulary: learnable structure, no download."""
    generator = torch.Generator().manual_seed(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < length:
        count = int(torch.randint(4, 10, (), generator=generator))
        sentence = [WORDS[int(i)] for i in torch.randint(len(WORDS), (count,), generator=generator)]
        words += [*sentence[:-1], sentence[-1] + "."]
    return " ".join(words)[:length]


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        self.data = torch.tensor([self.chars.index(c) for c in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index : index + self.block_size + 1]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``: momentum orthogonalized by Newton-Schulz iterations) for the given weight matrices,
    AdamW for the other parameters, as one optimizer (Lightning's automatic optimization takes one). Muon's update is
    scaled to AdamW's size (``adjust_lr_fn="match_rms_adamw"``), so both parts share the learning rate, which a
    scheduler sets on the shared parameter groups; the state is shared too, so checkpoints hold both parts."""

    def __init__(self, matrices: list[nn.Parameter], others: list[nn.Parameter], lr: float,
                 weight_decay: float) -> None:
        self.parts: list[torch.optim.Optimizer] = []
        if matrices:  # a pipeline stage holds only its own blocks
            self.parts.append(torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay,
                                               adjust_lr_fn="match_rms_adamw"))
        if others:
            self.parts.append(torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay))
        super().__init__([*matrices, *others], {"lr": lr})
        self._share()

    def _share(self) -> None:
        self.param_groups = [part.param_groups[0] for part in self.parts]
        for part in self.parts:
            part.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "parts") and self.param_groups:  # Optimizer.__init__ adds the first group itself
            raise ValueError("MuonWithAdamW takes its parameters when it is built (no part would step a group added "
                             "later, as BaseFinetuning's unfreeze_and_add_param_group adds); build it anew instead.")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: hand them to the parts
        for part, group in zip(self.parts, self.param_groups, strict=True):
            part.param_groups = [group]
        self._share()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss


class GPT(L.LightningModule):
    def __init__(self, vocab_size: int, block_size: int = 32, dim: int = 64, layers: int = 4, heads: int = 4,
                 optimizer: str = "adamw", lr: float | None = None, chars: list[str] | None = None,
                 sample_every: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: stage 0 and the last stage share this weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()  # True: may attend
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        self.log("perplexity", torch.exp(loss))
        return loss

    @torch.no_grad()
    def sample(self, prompt: str, length: int) -> str:
        """Greedy continuation of ``prompt``: one pass through the model per character."""
        chars: list[str] = self.hparams["chars"]
        tokens = torch.tensor([[chars.index(c) for c in prompt]], device=self.device)
        for _ in range(length):
            logits = self(tokens[:, -self.hparams["block_size"]:])
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return "".join(chars[int(i)] for i in tokens[0])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # every rank samples (each runs its own stage's blocks, pipelined); rank 0 prints
        every = self.hparams["sample_every"]
        due = self.global_step % every == 0 or self.global_step == self.trainer.max_steps if every else False
        if due and self.hparams["chars"]:
            text = self.sample("the ", 28)
            if self.trainer.is_global_zero:
                print(f"step {self.global_step:4d} sample: {text!r}")

    def configure_optimizers(self) -> Any:
        lr = self.hparams["lr"] or LEARNING_RATES[self.hparams["optimizer"]]
        optimizer: torch.optim.Optimizer
        if self.hparams["optimizer"] == "muon":
            matrices = [p for p in self.blocks.parameters() if p.ndim == 2]
            kept = {id(p) for p in matrices}
            optimizer = MuonWithAdamW(matrices, [p for p in self.parameters() if id(p) not in kept], lr, 0.01)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01)
        total = self.trainer.max_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--schedule", default="1f1b",
                        help="naive, gpipe, 1f1b (default), interleaved_1f1b (2 stages per rank), zb_h1, zbv, "
                             "dualpipev, pipedream_2bw (asynchronous: one step's delay), auto (chosen from measured "
                             "costs; --microbatches still fixes the count), or the path of a .csv schedule")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--optimizer", choices=sorted(LEARNING_RATES), default="adamw",
                        help="adamw (default) or muon (Muon for the blocks' weight matrices, AdamW for the rest: "
                             "robust to pipedream_2bw's one-step delay, where AdamW is not)")
    parser.add_argument("--devices", type=int, default=2, help="processes per node (default 2)")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (torchrun or SLURM starts the processes)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=None,
                        help="stages per pipeline; the rest of the world is data-parallel replicas (default: all)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu or auto")
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--sample-every", type=int, default=50,
                        help="print a greedy sample every N steps (0: never); every rank runs its blocks for it")
    args = parser.parse_args()
    if args.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        parser.error(f"--optimizer muon needs torch.optim.Muon (torch 2.9 or later); this is torch {torch.__version__}")

    torch.set_num_threads(1)  # one core per process: the two stages run side by side on a 2-core machine
    L.seed_everything(0, verbose=False)
    dataset = CharDataset(make_corpus(), block_size=32)
    model = GPT(vocab_size=len(dataset.chars), optimizer=args.optimizer, chars=dataset.chars,
                sample_every=args.sample_every)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=PipelineParallelStrategy(schedule=args.schedule, microbatches=args.microbatches,
                                          pipeline_parallel_size=args.pipeline_parallel_size),
        max_steps=args.max_steps,
        logger=TensorBoardLogger(args.log_dir, name="gpt_pipeline"),
        log_every_n_steps=10,
        enable_checkpointing=False,
        # measured compute / communication / bubble per stage every 10 steps; timeline picture and Perfetto trace
        # every 50 steps (also written to <log-dir>/pipeline_traces)
        callbacks=[PipelineMonitor(logging_interval=10, timeline_every_n_steps=50,
                                   trace_dir=f"{args.log_dir}/pipeline_traces")],
    )
    trainer.fit(model, DataLoader(dataset, batch_size=16, shuffle=True))
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()
