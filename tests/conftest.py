import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the Hub

# The test models are tiny: one thread is faster than two and immune to a busy machine.
torch.set_num_threads(1)
