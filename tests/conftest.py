"""One compute thread in the test process too, like every rank: single-device references then sum in the same order."""

from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Lightning's launcher sets the thread count of a process that fits in-process (``_set_num_threads_if_needed``):
    put it back, so a later test's single-device reference sums as the ranks do."""
    yield
    torch.set_num_threads(1)
