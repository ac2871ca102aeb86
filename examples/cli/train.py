"""Train the main example's GPT with ``LightningCLI``: the Trainer, the pipeline strategy and its options, the model
and the data all come from a YAML file (``config.yaml`` beside this script), each overridable on the command line.

    python examples/cli/train.py fit --config examples/cli/config.yaml
    python examples/cli/train.py fit --config examples/cli/config.yaml --trainer.max_steps=20 \\
        --trainer.strategy.init_args.schedule=GPipe --trainer.strategy.init_args.microbatches=8
    python examples/cli/train.py fit --config examples/cli/config.yaml --print_config   # the whole resolved config
    python examples/cli/train.py fit --help                                              # every option, documented

The model (``GPT``) and the corpus come from ``examples/train_gpt.py``; this file adds a LightningDataModule and tells
LightningCLI that the model's vocabulary and context length are the data's. Needs ``jsonargparse[signatures]``
(``pip install -e ".[cli]"``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: the main example's model and data
from train_gpt import GPT, CharDataset, make_corpus


class CharData(L.LightningDataModule):
    """The main example's character corpus (made on construction, so that its vocabulary is known to the model).

    Args:
        block_size: characters per training sequence (the model's context).
        batch_size: sequences per batch, split into the strategy's micro-batches.
        corpus_length: characters in the synthetic corpus.
    """

    def __init__(self, block_size: int = 32, batch_size: int = 16, corpus_length: int = 60_000) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.dataset = CharDataset(make_corpus(corpus_length), block_size)

    @property
    def chars(self) -> list[str]:
        return self.dataset.chars

    @property
    def vocab_size(self) -> int:
        return len(self.dataset.chars)

    def train_dataloader(self) -> DataLoader:
        # every rank of a pipeline must load the same batches: Lightning's sampler shuffles with rank 0's seed
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.chars", "model.chars", apply_on="instantiate")


def main() -> None:
    torch.set_num_threads(1)  # one core per process
    GPTCLI(GPT, CharData)


if __name__ == "__main__":
    main()
