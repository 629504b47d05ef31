"""Test-wide settings: tiny models run fastest on one thread, and one thread keeps timings steady
when other processes share the two cores."""
import torch

torch.set_num_threads(1)
