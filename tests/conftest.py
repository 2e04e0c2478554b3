"""Shared pytest fixtures."""

import pytest
import torch.distributed as dist
from data_helpers import byte_tokenizer

from acco.data import load_tokenizer, synthetic_corpus


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: an acco-bench run, a CLI scenario that launches whole training jobs (resumes, "
        "faults, torchrun, errors raised in the workers, a stalled worker named within its timeout) "
        "or a test that times the engine (overlap against C + M), the examples' sbatch jobs on a "
        "one-machine SLURM cluster: `make test` leaves them out, "
        "`make test-slow` runs them, serially",
    )


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that trains in this process (DecoupledTrainer with world size 1) creates the
    default process group; destroy it after the test, so that the next test starts clean."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- the data tests' corpus and tokenizers


@pytest.fixture(scope="module")
def corpus():
    return synthetic_corpus(400, seed=1)


@pytest.fixture(scope="module")
def bpe(corpus):
    return load_tokenizer("bpe", train_texts=corpus[:300], vocab_size=600)


@pytest.fixture(scope="module")
def byte_tok():
    """data_helpers.byte_tokenizer: byte b -> id b + 1, eos -> 0, pad -> 257."""
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bos_tok():
    """byte_tok's ids plus a bos (258) that the tokenizer puts in front of every text."""
    return byte_tokenizer(bos=True)
