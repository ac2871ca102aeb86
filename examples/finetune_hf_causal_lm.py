"""Fine-tune a Hugging Face causal language model pipeline-parallel: its decoder layers split over 2 processes on CPU.

    python examples/finetune_hf_causal_lm.py                          # Llama from a small config, 200 steps
    python examples/finetune_hf_causal_lm.py --model gpt2 --schedule gpipe --save-dir /tmp/finetuned

The model is an unmodified ``LlamaForCausalLM`` (or ``GPT2LMHeadModel``) held as ``self.model`` by a LightningModule
written as for one device; the strategy finds its decoder layers (``model.model.layers``, ``model.transformer.h``) and
splits them over the processes. Here the model is built from a small config with random weights and nothing is
downloaded; to fine-tune a real checkpoint, build it with ``AutoModelForCausalLM.from_pretrained(name)`` instead (every
process loads it whole, then keeps its own stage; for a model larger than one process's memory see
``examples/meta_fsdp.py``).

The data is a synthetic instruction set, already tokenized: a prompt (the first terms of an arithmetic sequence) and
an answer (the next terms, then an end-of-sequence token). As in supervised fine-tuning, the labels are ``-100`` on the
prompt and on the padding, so the loss averages over the answers' tokens only, and a micro-batch holds fewer or more of
them than another. ``microbatch_weight`` tells the strategy how many count in each micro-batch, so the loss it combines
and the gradients are one device's for the whole batch, not a mean of per-micro-batch means.

With ``--save-dir``, the fine-tuned weights are gathered into one Lightning checkpoint (``finetuned.ckpt``, which plain
Lightning loads too) and written as a Hugging Face folder (``hf/``, for ``from_pretrained``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from lightning_pp import PipelineParallelStrategy

NUMBERS = 100  # tokens 0-99 are the numbers of the sequences
PAD, EOS = NUMBERS, NUMBERS + 1
VOCAB = 128
IGNORE = -100  # Hugging Face's label for positions the loss skips


def build_model(kind: str, layers: int, hidden: int, heads: int) -> PreTrainedModel:
    """A randomly initialized causal LM from a small config (no download)."""
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=64,
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64,
                                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS))


class SequenceTasks(Dataset):
    """Tokenized (prompt, answer) pairs: 3-8 terms of ``start + stride * i (mod 100)`` (stride 1-3), answered by the
    next 2-6 terms and ``EOS``. Built once from a seed, so every rank of a pipeline holds the same samples."""

    def __init__(self, size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.samples: list[tuple[list[int], list[int]]] = []
        for _ in range(size):
            start, stride, prompt, answer = (int(torch.randint(low, high, (), generator=generator))
                                             for low, high in ((0, NUMBERS), (1, 4), (3, 9), (2, 7)))
            terms = [(start + stride * i) % NUMBERS for i in range(prompt + answer)]
            self.samples.append((terms[:prompt], [*terms[prompt:], EOS]))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        return self.samples[index]


def pad_batch(samples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest sample; labels only on the answers (the model shifts them by one itself)."""
    length = max(len(prompt) + len(answer) for prompt, answer in samples)
    input_ids = torch.full((len(samples), length), PAD)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE)
    for row, (prompt, answer) in enumerate(samples):
        tokens = prompt + answer
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        labels[row, len(prompt) : len(tokens)] = torch.tensor(answer)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def answer_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A micro-batch's weight: the labels Hugging Face's loss averages over (after its shift by one position)."""
    return (batch["labels"][:, 1:] != IGNORE).sum()


class CausalLMFineTuning(L.LightningModule):
    def __init__(self, model: str = "llama", layers: int = 4, hidden: int = 64, heads: int = 4, lr: float = 3e-3,
                 weight_decay: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(model, layers, hidden, heads)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss  # the mean over the answers' tokens of this (micro-)batch
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        # the usual fine-tuning split: no weight decay on biases and norms. Each stage sees only its own parameters.
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams["weight_decay"]},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams["lr"])
        total = max(1, self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)  # linear decay
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def save_hugging_face(module: CausalLMFineTuning, checkpoint: Path, folder: Path) -> None:
    """Rebuild the whole model from the gathered checkpoint and write it as ``save_pretrained`` does."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    model = build_model(*(module.hparams[key] for key in ("model", "layers", "hidden", "heads")))
    model.load_state_dict({name.removeprefix("model."): value for name, value in state.items()})
    model.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=64, help="width (default 64)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2048, help="size of the synthetic data set")
    parser.add_argument("--schedule", default="1f1b", help="1f1b (default), gpipe, zb_h1, ... (see train_gpt.py)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="processes, one stage each (default 2)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default), gpu or auto")
    parser.add_argument("--log-dir", default="lightning_logs")
    parser.add_argument("--save-dir", type=Path, default=None,
                        help="write finetuned.ckpt and a Hugging Face folder hf/ here after training")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per process
    L.seed_everything(0, verbose=False)
    model = CausalLMFineTuning(args.model, args.layers, args.hidden, args.heads)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=PipelineParallelStrategy(schedule=args.schedule, microbatches=args.microbatches,
                                          microbatch_weight=answer_tokens),
        max_steps=args.max_steps,
        default_root_dir=args.log_dir,
        log_every_n_steps=10,
        enable_checkpointing=False,
    )
    data = DataLoader(SequenceTasks(args.samples), batch_size=args.batch_size, shuffle=True, collate_fn=pad_batch,
                      drop_last=True)
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
    if args.save_dir is not None:
        checkpoint = args.save_dir / "finetuned.ckpt"
        # every rank takes part: global rank 0 gathers the stages into one file (weights only: no optimizer state)
        trainer.save_checkpoint(checkpoint, weights_only=True)
        if trainer.is_global_zero:
            save_hugging_face(model, checkpoint, args.save_dir / "hf")
            print(f"saved {checkpoint} and {args.save_dir / 'hf'}")


if __name__ == "__main__":
    main()
