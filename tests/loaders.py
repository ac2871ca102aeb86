"""The seeded data the suite's models train on (nothing downloaded): each loader the same for a given seed in every
process, unshuffled, so one device and every rank of a pipeline load the same batches. ``models.MODELS`` names which
one feeds which model (``models.make_data``); the modules of ``real_models.py`` call theirs in their own loaders."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

BATCH_SIZE = 8
VOCAB = 64  # the real-shaped language models' vocabulary and sequence length
SEQ_LEN = 12


def features(batch_size: int = BATCH_SIZE, batches: int = 4, seed: int = 1234, width: int = 10,
             classes: int = 5) -> DataLoader:
    """``width`` normal features and one of ``classes`` classes per sample."""
    generator = torch.Generator().manual_seed(seed)
    n = batch_size * batches
    x, y = torch.randn(n, width, generator=generator), torch.randint(0, classes, (n,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def random_tokens(batch_size: int = BATCH_SIZE, batches: int = 4, seed: int = 1234, vocab: int = 13,
                  length: int = 6) -> DataLoader:
    """Uniformly random tokens (the small language models of ``models.py``: nothing to learn, gradients to compare)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size * batches, length), generator=generator)
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, shuffle=False)


def token_batches(batches: int = 4, seed: int = 0, noisy_rows: int = 0) -> DataLoader:
    """Sequences ``start, start + stride, start + 2 stride, ...`` (mod VOCAB): learnable after two tokens.

    ``noisy_rows`` rows at the end of every batch are uniform random tokens instead, so losses differ a lot between the
    halves of a batch (a mean of per-half ``exp(loss)`` then differs visibly from ``exp`` of the mean).
    """
    generator = torch.Generator().manual_seed(seed)
    n = batches * BATCH_SIZE
    pool = max(batches, 4) * BATCH_SIZE  # the first batches of a seed are the same whatever ``batches`` is
    start = torch.randint(0, VOCAB, (pool, 1), generator=generator)[:n]
    stride = torch.randint(1, 4, (pool, 1), generator=generator)[:n]
    tokens = (start + stride * torch.arange(SEQ_LEN)) % VOCAB
    if noisy_rows:
        noisy = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=generator)
        rows = (torch.arange(n) % BATCH_SIZE) >= BATCH_SIZE - noisy_rows
        tokens = torch.where(rows[:, None], noisy, tokens)
    return DataLoader(TensorDataset(tokens), batch_size=BATCH_SIZE, shuffle=False)


def padded_batches(batches: int = 4, seed: int = 0) -> DataLoader:
    """`token_batches` sequences padded with token 0 after a random length (4 to SEQ_LEN), and a class per row."""
    (tokens,) = token_batches(batches, seed).dataset.tensors  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(4, SEQ_LEN + 1, (len(tokens), 1), generator=generator)
    tokens = torch.where(torch.arange(SEQ_LEN) < lengths, tokens.clamp(min=1), 0)
    return DataLoader(TensorDataset(tokens, tokens[:, 1] % 5), batch_size=BATCH_SIZE, shuffle=False)


def image_batches(batches: int = 4, seed: int = 0, classes: int = 5, size: int = 8,
                  labelled: bool = True) -> DataLoader:
    """3-channel ``size`` x ``size`` normal images, with a class each (``labelled``) or alone."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batches * BATCH_SIZE, 3, size, size, generator=generator)
    if not labelled:
        return DataLoader(TensorDataset(images), batch_size=BATCH_SIZE)
    labels = torch.randint(0, classes, (batches * BATCH_SIZE,), generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=BATCH_SIZE)
