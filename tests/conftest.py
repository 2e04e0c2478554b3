"""Shared pytest fixtures."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that trains in this process (DecoupledTrainer with world size 1) creates the
    default process group; destroy it after the test, so that the next test starts clean."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
