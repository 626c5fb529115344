"""Shared by the kernel tests: `backend`, each test once with the C kernels and once with the torch fallback."""

from __future__ import annotations

import pytest

from hotcold.kernels import cpu


@pytest.fixture(params=["c", "torch"], scope="module")
def backend(request):
    mp = pytest.MonkeyPatch()
    if request.param == "torch":
        mp.setenv("HOTCOLD_NO_CEXT", "1")
    else:
        mp.delenv("HOTCOLD_NO_CEXT", raising=False)
    cpu._reset_for_tests()
    if cpu.backend() != request.param:
        mp.undo()
        pytest.skip("C kernels unavailable (no compiler)")
    yield request.param
    mp.undo()
    cpu._reset_for_tests()
