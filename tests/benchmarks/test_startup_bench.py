"""benchmarks/startup.py: a fresh process reports each start-up phase of the default model."""
from __future__ import annotations

import math
import os

import pytest

from benchmarks import startup


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_worker_reports_every_phase_of_a_fresh_process(default_model_path):
    result = startup.run_worker(default_model_path, checkout=None, cache=None)
    assert set(result) == {*startup.PHASES, "total"}
    assert all(result[k] > 0 and math.isfinite(result[k]) for k in startup.PHASES)
    assert result["total"] == pytest.approx(sum(result[k] for k in startup.PHASES), abs=1e-6)
    assert result["total"] < 600
