"""Three replicas of the real `agent-server` (tiny random Turbo engine) on loopback, sharing a real
redis-server, behind a real HAProxy running deploy/haproxy/haproxy.cfg: the fixture of test_cluster.py and
the fleet of scripts/bench_balancer.py."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from tests.services import (
    Backend,
    HAProxy,
    Loopback,
    RedisServer,
    free_port,
    haproxy,
    stop_process,
)

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180.0  # three replicas import torch and chatterbox at once on two cores
TOKEN_SECRET = "cluster-test-secret-0123456789abcdef"


@dataclass
class Replica(Loopback):
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    agent_port: int
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_replica(name: str, directory: Path, env: Mapping[str, str], args: Sequence[str] = ()) -> Replica:
    port, agent_port = free_port(), free_port()
    directory.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "AGENT_SERVER_DATA_DIR": str(directory),
        "AGENT_SERVER_TOKEN_SECRET": TOKEN_SECRET,
        **env,
    }
    log_path = directory / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1", "--port", str(port),
             "--agent-check-port", str(agent_port), *args],
            env=full_env, stdout=subprocess.DEVNULL, stderr=log_file,
        )
    return Replica(name, proc, port, agent_port, log_path)


def wait_ready(replicas: Sequence[Replica], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if not replica.alive:
                raise RuntimeError(f"replica {replica.name} exited {replica.proc.returncode}:\n{replica.log()[-4000:]}")
            try:
                if httpx.get(replica.http_url + "/readyz", timeout=1.0).status_code == 200:
                    pending.remove(replica)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"not ready: {[r.name for r in pending]}")
        time.sleep(0.1)


@dataclass
class Cluster:
    redis: RedisServer
    replicas: list[Replica]
    balancer_or_none: HAProxy | None

    @property
    def balancer(self) -> HAProxy:
        if self.balancer_or_none is None:
            raise RuntimeError("this cluster runs without HAProxy")
        return self.balancer_or_none


def latency_summary_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p90, p99, max in milliseconds (the benchmarks' one summary)."""
    if not values_s:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"n": len(ms), **{f"p{q}": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)},
            "max": round(float(ms.max()), 3)}


def write_summary(out: Path, name: str, summary: dict[str, object]) -> None:
    """A benchmark's result: printed, and written to out/<name>-<stamp>.json."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"written: {path}")


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()}


@contextmanager
def cluster(directory: Path, *, replicas: int = 3, env: Mapping[str, str] | None = None,
            args: Sequence[str] = (), balancer: bool = True) -> Iterator[Cluster]:
    with ExitStack() as stack:
        redis = RedisServer(directory / "redis")
        redis.start()
        stack.callback(redis.stop)
        shared_env = {
            "AGENT_SERVER_VARIANT": "turbo",
            "AGENT_SERVER_WEIGHTS": "random-tiny",
            "AGENT_SERVER_DEVICE": "cpu",
            "AGENT_SERVER_REDIS_URL": redis.url,
            **(env or {}),
        }
        started = [start_replica(f"r{i + 1}", directory / f"r{i + 1}", shared_env, args) for i in range(replicas)]
        for replica in started:
            stack.callback(_stop_quietly, replica)
        wait_ready(started)
        backends = [Backend(r.name, r.port, r.agent_port) for r in started]
        proxy = stack.enter_context(haproxy(directory / "haproxy", backends)) if balancer else None
        yield Cluster(redis, started, proxy)


def _stop_quietly(replica: Replica) -> None:
    stop_process(replica.proc, signal.SIGINT, timeout_s=15.0)
