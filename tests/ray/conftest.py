"""One local Ray cluster (two CPUs, no dashboard) for the tests of `wsi_loader.ray`, started
when the first of them needs it and shut down after the last."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="package")
def cluster() -> Iterator[str]:
    """The cluster's address (its GCS), this process connected to it as the driver."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=200 * 2**20,
        # Ray starts its workers at nice 15 so that the driver stays responsive; beside
        # other busy processes (a loaded CI machine) such workers get almost no CPU and an
        # actor took over 5 minutes to start. The tests' workers compete on equal terms.
        _system_config={"worker_niceness": 0},
    )
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()
