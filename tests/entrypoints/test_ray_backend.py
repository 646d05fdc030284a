"""`llmserve serve --data-parallel-size 2 --data-parallel-backend ray` on a local Ray head (127.0.0.1,
2 CPUs): two engine cores as Ray actors, reached over TCP, serve a load; a killed one is reported."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.remote_server import RemoteServer, free_port
from tests.entrypoints.test_data_parallel_server import (
    DP_ARGS,
    check_a_killed_rank_is_reported,
    check_load_reaches_both_ranks,
    pids_titled,
)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A local Ray head on loopback with 2 CPUs, as a user starts one (`ray start --head`)."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray is not None, "Ray must be installed (pip install 'llmserve[ray]')"
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray-")
    start = [ray, "start", "--head", "--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--port", str(port)]
    options = ["--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp]
    subprocess.run([*start, *options], check=True, capture_output=True, timeout=120)
    yield f"127.0.0.1:{port}"
    subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=60)
    shutil.rmtree(temp, ignore_errors=True)


def test_two_ray_actors_serve_a_load_and_a_killed_one_is_reported(ray_head: str) -> None:
    server = RemoteServer([*DP_ARGS, "--data-parallel-backend", "ray"], env={"RAY_ADDRESS": ray_head})
    try:
        check_load_reaches_both_ranks(server)
        actors = pids_titled(b"ray::EngineCoreActor")  # Ray titles its workers by the actor's task
        assert len(actors) == 2
        check_a_killed_rank_is_reported(server, actors[0])
    finally:
        server.stop(timeout=30)
