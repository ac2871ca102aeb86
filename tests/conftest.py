"""One compute thread in the test process too, like every rank: single-device references then sum in the same order."""

import torch

torch.set_num_threads(1)
