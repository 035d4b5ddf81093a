"""Shared test setup: offline hub, fixed seeds, an unfrozen garbage collector, and Triton's interpreter on
machines without CUDA (the kernels are then run on CPU tensors and compared with the reference functions)."""

import gc
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _gc_unfrozen():
    """The trainers freeze the garbage collector while they train: no test starts or leaves it frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.fixture
def lib_caplog(caplog):
    """caplog that also sees modelopt_lite's logger (which does not propagate by default)."""
    logger = logging.getLogger("modelopt_lite")
    logger.propagate = True
    try:
        yield caplog
    finally:
        logger.propagate = False
