"""One Ray instance for the tests of this package that ask for it (starting Ray takes seconds)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def ray_instance():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvforge[ray]')")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
                 log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
