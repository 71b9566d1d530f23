"""The C++ kernels, for the tests that call them directly."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from tandem.model import kernels
from tandem.model.kernels import build


def _built(load):
    """What `load` builds; skipped only where it cannot exist (kernels turned off, or no x86
    C++ toolchain); a build failure elsewhere fails the test."""
    if not build.enabled():
        pytest.skip("TANDEM_NO_CPP_KERNELS is set")
    built = load()
    compiler = os.environ.get("CXX", "c++")  # the one torch's builder runs
    if built is None and (platform.machine() != "x86_64" or shutil.which(compiler) is None):
        pytest.skip("no C++ toolchain on this platform")
    assert built is not None, "the kernel failed to build; run with log level DEBUG for why"
    return built


@pytest.fixture(scope="module")
def kernel():
    """The paged decode-attention kernel."""
    return _built(kernels.paged_decode_attention)


@pytest.fixture(scope="module")
def fused():
    """The fused layer kernels (kernels/fused.cpp)."""
    return _built(kernels.fused)
