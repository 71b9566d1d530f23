"""The C++ decode kernel, for the tests that call it directly."""

from __future__ import annotations

import platform
import shutil

import pytest

from tandem.model import kernels
from tandem.model.kernels import build


@pytest.fixture(scope="module")
def kernel():
    """The built kernel; skipped only where it cannot exist (kernels turned off, or no x86
    C++ toolchain); a build failure elsewhere fails the test."""
    if not build.enabled():
        pytest.skip("TANDEM_NO_CPP_KERNELS is set")
    fn = kernels.paged_decode_attention()
    if fn is None and (platform.machine() != "x86_64" or shutil.which("c++") is None):
        pytest.skip("no C++ toolchain on this platform")
    assert fn is not None, "the kernel failed to build; run with log level DEBUG for why"
    return fn
