import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp import PipelineParallelStrategy


class Model(L.LightningModule):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        # the repeated blocks: the strategy finds this container and splits it into stages
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):  # runs once per micro-batch, on every stage
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.blocks(self.embed(x))), y)
        self.log("train_loss", loss)  # one value per batch, as on one device
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":  # Lightning starts the second process by running this file again
    L.seed_everything(0)  # the same data in every process: each stage loads the batch itself
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=8, logger=False, enable_checkpointing=False,
                        strategy=PipelineParallelStrategy(schedule="1f1b", microbatches=4))
    trainer.fit(Model(), DataLoader(data, batch_size=16))
