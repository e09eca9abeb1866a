"""A shard group over two "hosts": its ranks in separate network namespaces (tests/netns.py).

Rank 0 runs in namespace "a", rank 1 in namespace "b"; each has only its loopback and one veth into a bridge in
the root namespace, where the test process and a private Redis (bound to the bridge's address) live. So rank 0
reaches Redis, and the ranks reach each other, over the veth addresses only (checked with `ss`), as on real
hosts. The tests train across the two hosts, cut a host's link in the middle of a pipelined run (nothing hangs,
every request is answered, the group re-forms by itself once the link is back), and give ranks addresses
nothing answers on.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from tests import netns
from tests.conftest import WORKER_MICROBATCH_TOKENS
from tests.helpers import make_batch, max_weight_diff
from tinkerq import types
from tinkerq.launcher.processes import port_problem, redis_binary, start_process, wait_for, worker_command

pytestmark = pytest.mark.timeout(420)
COLLECTIVE_TIMEOUT_S = 6
RENDEZVOUS_TIMEOUT_S = 60
# Hang detection, not a performance claim: two cores shared with other tests.
SLACK_S = 60
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)


def _port(host: str) -> int:
    import random

    for _ in range(100):
        port = random.randint(20000, 60000)
        if port_problem(port, host) is None:
            return port
    raise RuntimeError(f"no free port on {host}")


@pytest.fixture(scope="module")
def hosts() -> Iterator[netns.Hosts]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    h = netns.Hosts(["a", "b"]).up()
    yield h
    h.down()


@pytest.fixture(scope="module")
def net_redis(hosts, tmp_path_factory) -> Iterator[str]:
    """A private redis-server listening only on the bridge's address (reachable from the namespaces)."""
    import redis

    workdir = tmp_path_factory.mktemp("net-redis")
    port = _port(hosts.gateway)
    proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", hosts.gateway, "--protected-mode", "no",
                             "--dir", str(workdir), "--logfile", str(workdir / "redis.log"), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    client = redis.Redis(host=hosts.gateway, port=port)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_for(up, 20, "redis-server on the bridge", proc, workdir / "redis.log")
        yield f"redis://{hosts.gateway}:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def net_service(net_redis) -> Iterator:
    from tinkerq.producer import ServiceClient

    sc = ServiceClient(broker_url=net_redis)
    yield sc
    sc.close()


class TwoHostGroup:
    """A model in two shards: rank 0 (the Celery worker, the rendezvous) on host a, rank 1 on host b."""

    def __init__(self, hosts: netns.Hosts, model_dir: Path, redis_url: str, checkpoint_dir: Path, logs: Path,
                 name: str) -> None:
        self.hosts, self.model_dir, self.redis_url, self.logs, self.name = hosts, model_dir, redis_url, logs, name
        self.rendezvous = f"tcp://{hosts.addresses['a']}:{_port('127.0.0.1')}"
        self.env = {
            "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir),
            "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS),
            "TINKERQ_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
            "TINKERQ_RENDEZVOUS_TIMEOUT_S": str(RENDEZVOUS_TIMEOUT_S),
            "TINKERQ_HEARTBEAT_S": "1",
            # gloo binds to the address of this interface; by default it would resolve the hostname (127.0.0.1
            # here, as in many /etc/hosts) and give its peer an address it cannot reach.
            "GLOO_SOCKET_IFNAME": netns.IFNAME,
        }
        self.procs: dict[int, subprocess.Popen] = {}

    def host(self, rank: int) -> str:
        return "a" if rank == 0 else "b"

    def log(self, rank: int) -> Path:
        return self.logs / f"{self.name}-rank{rank}.log"

    def start(self, rank: int) -> subprocess.Popen:
        cmd = worker_command(str(self.model_dir), self.redis_url, threads=1, extra=[
            "--name", self.name, "--shards", "2", "--rank", str(rank), "--rendezvous", self.rendezvous])
        self.procs[rank] = start_process(self.hosts.command(self.host(rank), cmd), self.log(rank), self.env)
        return self.procs[rank]

    def wait_serving(self, connection, timeout: float = 120) -> None:
        wait_for(lambda: bool(connection.workers_serving(self.name)), timeout, f"shard group {self.name}",
                 self.procs[0], self.log(0))

    def stop(self) -> None:
        for rank in sorted(self.procs):
            proc = self.procs[rank]
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def two_hosts(hosts, model_dir, net_redis, checkpoint_dir, tmp_path_factory, net_service, request) -> Iterator:
    group = TwoHostGroup(hosts, model_dir, net_redis, checkpoint_dir, tmp_path_factory.mktemp("multihost-logs"),
                         f"tiny-2hosts-{request.node.name[5:25]}")
    try:
        group.start(1)
        group.start(0)
        group.wait_serving(net_service.connection)
        yield group
    finally:
        group.stop()
        for name in ("a", "b"):
            hosts.restore(name)


def _steps(tc, batches) -> tuple[list[float], list[float]]:
    futures = [(tc.forward_backward(b), tc.optim_step(ADAM)) for b in batches]
    results = [(fb.result(timeout=120), st.result(timeout=120)) for fb, st in futures]
    return [r.metrics["loss:sum"] for r, _ in results], [s.metrics["grad_norm:mean"] for _, s in results]


def _same_weights(one, two, tag: str) -> float:
    from transformers import AutoModelForCausalLM

    path_one = one.save_weights_for_sampler(f"{tag}-one").result(timeout=120).path
    path_two = two.save_weights_for_sampler(f"{tag}-two").result(timeout=120).path
    return max_weight_diff(AutoModelForCausalLM.from_pretrained(path_one), path_two)


def test_a_group_over_two_hosts_trains_as_one_worker(two_hosts, hosts, net_redis, net_service, service, model_dir):
    rng = np.random.default_rng(90)
    batches = [make_batch(rng, n) for n in (3, 5, 2)]
    one = service.create_training_client(str(model_dir))
    two = net_service.create_training_client(two_hosts.name)
    try:
        assert two.info.extra["shards"] == 2
        losses_one, norms_one = _steps(one, batches)
        losses_two, norms_two = _steps(two, batches)
        assert losses_two == pytest.approx(losses_one, rel=1e-5, abs=1e-5)
        assert norms_two == pytest.approx(norms_one, rel=1e-5)
        assert _same_weights(one, two, "multihost") < 1e-5
    finally:
        one.close()
        two.close()
    # The ranks' traffic is on the veth addresses: rank 1 is connected to rank 0's address (the rendezvous
    # store and gloo), and rank 0 to Redis on the bridge. Nothing of theirs uses a loopback address.
    a, b = hosts.addresses["a"], hosts.addresses["b"]
    seen_b = hosts.sockets("b")
    assert f"{b}:" in seen_b and f"{a}:" in seen_b, seen_b
    seen_a = hosts.sockets("a")
    assert f"{hosts.gateway}:{urlparse(net_redis).port}" in seen_a, seen_a
    assert "127.0.0.1" not in seen_a + seen_b, seen_a + seen_b
