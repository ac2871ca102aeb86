"""Generate text through the pipeline: Hugging Face's ``generate`` (greedy, with its key/value cache) in
``predict_step``, on a GPT-2 split over 2 processes on CPU.

    python examples/generate.py                        # train 300 steps, then continue 8 prompts by 6 tokens
    python examples/generate.py --train-steps 0        # an untrained model: the same mechanics, arbitrary tokens

The model is ``GPT2LMHeadModel`` from a small config (random weights, nothing downloaded), first trained briefly,
pipelined, to continue arithmetic sequences (``start, start + stride, ...`` mod 64); ``trainer.predict`` then calls
``predict_step`` on batches of prompts, and it calls ``self.model.generate(...)`` as on one device.

How it runs: a step that passes through the blocks more than once (one pass per new token) runs eagerly on every rank
on the whole batch: when the model reaches a stage's blocks, that stage's rank runs them and broadcasts their output
over the pipeline, so every rank computes the head, picks the same token and stops at the same length, and every rank
returns the same tokens. A block held by another rank runs a weightless copy on the meta device, so the cache advances
as on one device. The passes do not overlap (no micro-batches): fine for sampling a few sequences, slower than one
device (the README's "Generation" section has the numbers and the limits).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_pp import PipelineParallelStrategy

VOCAB = 64


def sequences(samples: int, length: int, seed: int) -> torch.Tensor:
    """Rows ``start, start + stride, start + 2 stride, ...`` (mod VOCAB), stride 1-3: learnable after two tokens."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    stride = torch.randint(1, 4, (samples, 1), generator=generator)
    return (start + stride * torch.arange(length)) % VOCAB


class GPT2Generator(L.LightningModule):
    def __init__(self, layers: int = 4, hidden: int = 64, heads: int = 4, new_tokens: int = 6,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads,
                                                n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (prompts,) = batch
        generated = self.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                        max_new_tokens=self.hparams["new_tokens"], pad_token_id=0)
        return generated[:, prompts.shape[1]:]  # the new tokens

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=300, help="training steps before generating (0: none)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="processes, one stage each (default 2)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu or auto")
    parser.add_argument("--log-dir", default="lightning_logs")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per process
    L.seed_everything(0, verbose=False)
    model = GPT2Generator(args.layers, args.hidden, new_tokens=args.new_tokens)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices,
                        strategy=PipelineParallelStrategy(schedule="1f1b", microbatches=args.microbatches),
                        max_steps=args.train_steps, default_root_dir=args.log_dir, log_every_n_steps=10,
                        enable_checkpointing=False)
    if args.train_steps > 0:
        length = args.prompt_length + args.new_tokens
        trainer.fit(model, DataLoader(TensorDataset(sequences(4096, length, seed=0)), batch_size=16, shuffle=True))

    expected = sequences(args.prompts, args.prompt_length + args.new_tokens, seed=1)  # prompts not trained on
    prompts = expected[:, : args.prompt_length]
    batches = trainer.predict(model, DataLoader(TensorDataset(prompts), batch_size=4))
    assert batches is not None
    generated = torch.cat(batches)  # type: ignore[arg-type]
    if trainer.is_global_zero:  # every rank generated the same tokens; one prints them
        right = 0
        for prompt, new, want in zip(prompts, generated, expected[:, args.prompt_length:], strict=True):
            as_expected = torch.equal(new, want)
            right += as_expected
            print(f"prompt {prompt.tolist()} -> {new.tolist()} {'ok' if as_expected else f'expected {want.tolist()}'}")
        print(f"generated {len(generated)} continuations of {args.new_tokens} tokens, {right} as expected")


if __name__ == "__main__":
    main()
