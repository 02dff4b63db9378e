import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from engine.checkpoint import write_random_checkpoint
from engine.config import preset

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_random_checkpoint(preset("tiny"), tmp_path_factory.mktemp("tiny"), progress=False)


@pytest.fixture(scope="session")
def tiny_v4_ckpt(tmp_path_factory):
    return write_random_checkpoint(preset("tiny-v4"), tmp_path_factory.mktemp("tiny-v4"), progress=False)
