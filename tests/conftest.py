"""Shared fixtures (the builders are in :mod:`tests.helpers`) and the offline environment every test runs in."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # interpret kernels only where none can compile; before any kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402  (after the environment above)

from tests.helpers import build_tiny_world, make_drafter, make_target  # noqa: E402


@pytest.fixture
def target():
    return make_target()


@pytest.fixture
def drafter(target):
    return make_drafter(target)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    return build_tiny_world(tmp_path_factory.mktemp("world"))
