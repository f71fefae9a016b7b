"""A local Ray cluster and a real redis-server, one of each per test module (Ray takes seconds
to start), stopped when the module ends: tests skip with a message where Ray, redis or
redis-server is absent."""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time

import pytest

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """redis://127.0.0.1:PORT of a redis-server started here (no persistence), stopped after."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = pytest.importorskip("redis", reason="the redis package is not installed (pip install 'kvcheck[scale]')")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.skip(f"redis-server exited at start (code {proc.returncode})")
                time.sleep(0.1)
        else:
            pytest.skip("redis-server did not answer within 10 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def ray_cluster():
    """The GCS address of a 2-CPU local Ray cluster started in this process (drivers in
    subprocesses join it with --ray ADDRESS); shut down after the tests."""
    # Ray >= 2.59 turns token authentication on for local clusters; a driver joining by address
    # must turn it on too (docs/scale.md): the same setting here and in the subprocesses, set
    # before Ray is imported (it reads it then)
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvcheck[scale]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             logging_level=logging.WARNING, object_store_memory=100 * 2**20)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
