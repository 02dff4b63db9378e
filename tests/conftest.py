import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Triton picks interpreter or compiler when it is first imported (the engine imports the
# kernels): on a machine without a GPU, the kernel tests run the kernels interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.checkpoint import write_random_checkpoint
from engine.config import preset

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_random_checkpoint(preset("tiny"), tmp_path_factory.mktemp("tiny"), progress=False)


@pytest.fixture(scope="session")
def tiny_v4_ckpt(tmp_path_factory):
    return write_random_checkpoint(preset("tiny-v4"), tmp_path_factory.mktemp("tiny-v4"), progress=False)
