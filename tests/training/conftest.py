"""Fixtures of the training tests: one intra-op thread in each (runs cut in a forked child repeat the reference bit
for bit), and the checkpoint tests' uninterrupted reference run."""
import pytest
import torch
from checkpoint_runs import config

from barter.training import train


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as in a forked child."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted reference run."""
    torch.set_num_threads(1)
    return train(config(tmp_path_factory.mktemp("whole"), "whole")).run_dir
