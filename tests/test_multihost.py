"""A shard group over two "hosts": its ranks in separate network namespaces (tests/netns.py).

Rank 0 runs in namespace "a", rank 1 in namespace "b"; each has only its loopback and one veth into a bridge in
the root namespace, where the test process and a private Redis (bound to the bridge's address) live. So rank 0
reaches Redis, and the ranks reach each other, over the veth addresses only (checked with `ss`), as on real
hosts. The tests train across the two hosts; cut a host's link in the middle of a pipelined run (nothing hangs,
every request is answered: back within TINKERQ_ADOPT_TIMEOUT_S, the session goes on as if nothing happened;
kept down, its requests fail with an error that says why; the group re-forms by itself once the link is back);
and give ranks addresses nothing answers on. Needs root (network namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from tests import netns
from tests.conftest import WORKER_MICROBATCH_TOKENS
from tests.helpers import make_batch, max_weight_diff
from tinkerq import errors, types
from tinkerq.launcher.processes import port_problem, redis_binary, start_process, wait_for, worker_command

pytestmark = pytest.mark.timeout(420)
COLLECTIVE_TIMEOUT_S = 6
RENDEZVOUS_TIMEOUT_S = 60
ADOPT_TIMEOUT_S = 20  # how long rank 0 holds a failed group's sessions (worker/recovery/)
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
                 name: str, extra: tuple[str, ...] = ()) -> None:
        self.hosts, self.model_dir, self.redis_url, self.logs, self.name = hosts, model_dir, redis_url, logs, name
        self.extra = extra  # more flags for every rank
        self.rendezvous = f"tcp://{hosts.addresses['a']}:{_port('127.0.0.1')}"
        self.env = {
            "TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir),
            "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS),
            "TINKERQ_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
            "TINKERQ_RENDEZVOUS_TIMEOUT_S": str(RENDEZVOUS_TIMEOUT_S),
            "TINKERQ_HEARTBEAT_S": "1",
            "TINKERQ_ADOPT_TIMEOUT_S": str(ADOPT_TIMEOUT_S),
            "TINKERQ_AUTO_SNAPSHOT_STEPS": "4",
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
            "--name", self.name, "--shards", "2", "--rank", str(rank), "--rendezvous", self.rendezvous, *self.extra])
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
        for name in ("a", "b"):  # a test that failed with a link down: its ranks stop cleanly once it is back
            hosts.restore(name)
        group.stop()


def _steps(tc, batches) -> tuple[list[float], list[float]]:
    futures = [(tc.forward_backward(b), tc.optim_step(ADAM)) for b in batches]
    results = [(fb.result(timeout=120), st.result(timeout=120)) for fb, st in futures]
    return [r.metrics["loss:sum"] for r, _ in results], [s.metrics["grad_norm:mean"] for _, s in results]


def _same_weights(one, two, tag: str) -> float:
    from transformers import AutoModelForCausalLM

    path_one = one.save_weights_for_sampler(f"{tag}-one").result(timeout=120).path
    path_two = two.save_weights_for_sampler(f"{tag}-two").result(timeout=120).path
    return max_weight_diff(AutoModelForCausalLM.from_pretrained(path_one), path_two)


def _trains_as_one(one, two, batches, tag: str) -> None:
    """The same pipelined steps on ``one`` (an unsharded worker) and ``two`` (the group): losses, gradient norms and
    the weights after them agree."""
    losses_one, norms_one = _steps(one, batches)
    losses_two, norms_two = _steps(two, batches)
    assert losses_two == pytest.approx(losses_one, rel=1e-5, abs=1e-5)
    assert norms_two == pytest.approx(norms_one, rel=1e-5)
    assert _same_weights(one, two, tag) < 1e-5


def test_a_group_over_two_hosts_trains_as_one_worker(two_hosts, hosts, net_redis, net_service, service, model_dir):
    rng = np.random.default_rng(90)
    batches = [make_batch(rng, n) for n in (3, 5, 2)]
    one = service.create_training_client(str(model_dir))
    two = net_service.create_training_client(two_hosts.name)
    try:
        assert two.info.extra["shards"] == 2
        _trains_as_one(one, two, batches, "multihost")
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


def test_experts_split_over_two_hosts_train_as_one_worker(hosts, net_redis, net_service, checkpoint_dir, tmp_path):
    """``--expert-parallel`` across the two hosts: each holds 4 of a tiny Qwen3-MoE's 8 experts, and every MoE
    layer's rows cross the veth link both ways (all-to-all); it trains as one unsharded worker on the same model."""
    from tests.conftest import start_named_worker
    from tinkerq.recipes.families import build_family

    model = build_family("qwen3_moe", tmp_path / "qwen3-moe", seed=9)
    env = {"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir), "TINKERQ_MICROBATCH_TOKENS": str(WORKER_MICROBATCH_TOKENS)}
    one_proc = start_named_worker(model, net_redis, "moe-one-host", tmp_path / "one.log", env=env)
    group = TwoHostGroup(hosts, model, net_redis, checkpoint_dir, tmp_path, "moe-2hosts-ep",
                         extra=("--expert-parallel",))
    try:
        group.start(1)
        group.start(0)
        group.wait_serving(net_service.connection)
        one = net_service.create_training_client("moe-one-host")
        two = net_service.create_training_client(group.name)
        try:
            _trains_as_one(one, two, [make_batch(np.random.default_rng(91), n) for n in (3, 5, 2)], "multihost-ep")
        finally:
            one.close()
            two.close()
    finally:
        group.stop()
        one_proc.terminate()
        one_proc.wait(30)
    assert "expert parallel over 2 ranks" in group.log(0).read_text()


def _wait_answered(futures, bound: float) -> list[tuple[object, float]]:
    """Every future's result or error, with when it was answered (monotonic); fails the test past ``bound``."""
    deadline = time.monotonic() + bound
    answered: dict[int, float] = {}
    while len(answered) < len(futures) and time.monotonic() < deadline:
        for i, f in enumerate(futures):
            if i not in answered and f.done():
                answered[i] = time.monotonic()
        time.sleep(0.05)
    missing = [i for i in range(len(futures)) if i not in answered]
    assert not missing, f"requests {missing} of {len(futures)} got no answer within {bound:g} s (a hang)"
    return [(f.exception(timeout=0) or f.result(timeout=0), answered[i]) for i, f in enumerate(futures)]


def _pipelined_run(tc, batches, cut):
    """A warm-up pair, then ``batches`` as pipelined pairs; ``cut()`` runs once the first of them is answered, and
    two more pairs are queued after it. Returns the futures (in order) and when ``cut()`` ran."""
    tc.forward_backward(batches[0])
    tc.optim_step(ADAM).result(timeout=120)
    futures = []
    for b in batches[1:-2]:
        futures += [tc.forward_backward(b), tc.optim_step(ADAM)]
    cut_at = None
    if cut is not None:
        futures[0].result(timeout=120)
        cut()
        cut_at = time.monotonic()
    for b in batches[-2:]:  # queued after the cut
        futures += [tc.forward_backward(b), tc.optim_step(ADAM)]
    return futures, cut_at


def _kinds(outcomes) -> list[str]:
    return ["ok" if not isinstance(o, errors.TinkerqError) else type(o).__name__ for o, _ in outcomes]


def test_a_followers_link_cut_mid_run_and_back_within_the_adopt_timeout_loses_nothing(
        two_hosts, hosts, net_service, service, model_dir):
    """Rank 0 holds the session through the outage; once the link is back the group re-forms, rank 0 re-makes the
    session from its snapshot and journal and runs the waiting requests: every request is answered, once, and the
    weights end as on one worker that was never interrupted."""
    batches = [make_batch(np.random.default_rng(91), n) for n in (3, 4, 2, 5, 4, 3, 4, 2, 3, 1)]
    tc = net_service.create_training_client(two_hosts.name)
    ref = service.create_training_client(str(model_dir))
    try:
        futures, cut_at = _pipelined_run(tc, batches, lambda: hosts.cut("b"))
        wait_for(lambda: "the shard group of this model failed" in two_hosts.log(0).read_text(),
                 COLLECTIVE_TIMEOUT_S + SLACK_S, "rank 0 to notice the cut", two_hosts.procs[0], two_hosts.log(0))
        noticed = time.monotonic() - cut_at
        time.sleep(2)
        hosts.restore("b")
        restored_at = time.monotonic()
        outcomes = _wait_answered(futures, ADOPT_TIMEOUT_S + SLACK_S)
        print(f"\ncut b, back within the adopt timeout: rank 0 noticed {noticed:.1f} s after the cut; all answered "
              f"{max(t for _, t in outcomes) - restored_at:.1f} s after the link came back; {_kinds(outcomes)}")
        assert _kinds(outcomes) == ["ok"] * len(futures), [o for o, _ in outcomes]
        steps = [o.metrics["step:max"] for o, _ in outcomes[1::2]]
        assert steps == list(range(2, len(batches) + 1)), steps  # each optimizer step once, in order
        assert "re-made session" in two_hosts.log(0).read_text()
        assert two_hosts.procs[1].poll() is None  # the same follower process: nothing was restarted
        # The same requests, never interrupted, on one worker.
        ref_futures, _ = _pipelined_run(ref, batches, None)
        ref_losses = [f.result(timeout=120).metrics["loss:sum"] for f in ref_futures[0::2]]
        assert [o.metrics["loss:sum"] for o, _ in outcomes[0::2]] == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
        assert _same_weights(ref, tc, "cut-b-back") < 1e-5
    finally:
        tc.close()
        ref.close()


def test_redis_stalling_as_the_group_re_forms_does_not_break_it_again(
        two_hosts, hosts, net_redis, net_service, service, model_dir):
    """Right after an outage Redis can answer slowly for longer than TINKERQ_COLLECTIVE_TIMEOUT_S (a stalled
    connection, the replies the outage held back). Rank 0 reads what re-making its held session needs from Redis
    before any of the re-make runs on its compute loop, which stays idle and keeps pinging the follower meanwhile:
    Redis answering nothing (CLIENT PAUSE) as the group re-forms delays the session; it does not break the group
    again. (Before, the loop read the journal between two of the re-make's commands, the follower's wait for the
    next one timed out, and the group had to form a third time.)"""
    import redis

    batches = [make_batch(np.random.default_rng(94), n) for n in (3, 4, 2, 5, 4, 3, 4, 2, 3, 1)]
    tc = net_service.create_training_client(two_hosts.name)
    ref = service.create_training_client(str(model_dir))
    pause_s = 4 * COLLECTIVE_TIMEOUT_S  # the re-forming takes a few seconds of it; the rest outlasts the wait
    try:
        futures, _ = _pipelined_run(tc, batches, lambda: hosts.cut("b"))
        wait_for(lambda: "the shard group of this model failed" in two_hosts.log(0).read_text(),
                 COLLECTIVE_TIMEOUT_S + SLACK_S, "rank 0 to notice the cut", two_hosts.procs[0], two_hosts.log(0))
        with redis.Redis.from_url(net_redis) as client:  # (no client can unpause it early: it ends by itself)
            client.client_pause(pause_s * 1000, all=True)
        paused_until = time.monotonic() + pause_s
        hosts.restore("b")
        wait_for(lambda: two_hosts.log(0).read_text().count("shard group formed: rank 0") >= 2,
                 RENDEZVOUS_TIMEOUT_S + SLACK_S, "the group to re-form", two_hosts.procs[0], two_hosts.log(0))
        stalled_after_forming = paused_until - time.monotonic()
        outcomes = _wait_answered(futures, pause_s + ADOPT_TIMEOUT_S + SLACK_S)
        print(f"\nRedis paused {pause_s} s as the link came back; {stalled_after_forming:.1f} s of it after the group "
              f"re-formed; {_kinds(outcomes)}")
        # Else the pause ended before the follower's wait could run out, and this test shows nothing.
        assert stalled_after_forming > COLLECTIVE_TIMEOUT_S + 2, stalled_after_forming
        assert _kinds(outcomes) == ["ok"] * len(futures), [o for o, _ in outcomes]
        steps = [o.metrics["step:max"] for o, _ in outcomes[1::2]]
        assert steps == list(range(2, len(batches) + 1)), steps  # each optimizer step once, in order
        log0 = two_hosts.log(0).read_text()
        assert "re-made session" in log0
        # Formed at start-up and once after the cut: the stall did not break it again.
        assert log0.count("shard group formed: rank 0") == 2, log0[-3000:]
        assert "re-making session" not in log0, log0[-3000:]  # neither interrupted nor failed
        assert two_hosts.procs[1].poll() is None
        ref_futures, _ = _pipelined_run(ref, batches, None)
        ref_losses = [f.result(timeout=120).metrics["loss:sum"] for f in ref_futures[0::2]]
        assert [o.metrics["loss:sum"] for o, _ in outcomes[0::2]] == pytest.approx(ref_losses, rel=1e-5, abs=1e-5)
    finally:
        tc.close()
        ref.close()


def test_a_followers_link_cut_for_longer_than_the_adopt_timeout_fails_the_session_clearly(
        two_hosts, hosts, net_service, service, model_dir):
    """No other worker serves the model: past TINKERQ_ADOPT_TIMEOUT_S rank 0 answers every held request with a
    ShardGroupError that says what happened. Once the link is back the group re-forms by itself."""
    rng = np.random.default_rng(93)
    batches = [make_batch(rng, n) for n in (3, 4, 2, 5, 4, 3, 4, 2, 3, 1)]
    tc = net_service.create_training_client(two_hosts.name)
    futures, cut_at = _pipelined_run(tc, batches, lambda: hosts.cut("b"))
    outcomes = _wait_answered(futures, COLLECTIVE_TIMEOUT_S + ADOPT_TIMEOUT_S + SLACK_S)
    kinds = _kinds(outcomes)
    first_error = next(i for i, k in enumerate(kinds) if k != "ok")
    print(f"\ncut b, kept down: first error {outcomes[first_error][1] - cut_at:.1f} s after the cut, all answered "
          f"{max(t for _, t in outcomes) - cut_at:.1f} s; {kinds}")
    # Served in order until the cut, then every request of the session fails: none is served after an error.
    assert all(k == "ok" for k in kinds[:first_error]) and first_error >= 1, kinds
    assert all(k == "ShardGroupError" for k in kinds[first_error:]), kinds
    err = outcomes[first_error][0]
    assert (f"did not answer within {COLLECTIVE_TIMEOUT_S:g} s (TINKERQ_COLLECTIVE_TIMEOUT_S): it hangs, is far "
            f"behind, or its host cannot be reached over the network") in err.message, err.message
    assert f"did not re-form within {ADOPT_TIMEOUT_S:g} s (TINKERQ_ADOPT_TIMEOUT_S)" in err.message, err.message
    # While host b is away the model has no worker: a new session is refused at once instead of waiting.
    assert not net_service.connection.workers_serving(two_hosts.name)
    with pytest.raises(errors.UnknownModelError, match="no worker serves"):
        net_service.create_training_client(two_hosts.name)
    hosts.restore("b")
    restored_at = time.monotonic()
    two_hosts.wait_serving(net_service.connection, timeout=RENDEZVOUS_TIMEOUT_S + SLACK_S)
    print(f"link back -> serving again {time.monotonic() - restored_at:.1f} s")
    assert two_hosts.procs[1].poll() is None  # the same follower process: nothing was restarted
    _a_new_session_trains_as_one_worker(net_service, service, two_hosts.name, model_dir, rng)


def _a_new_session_trains_as_one_worker(net_service, service, name: str, model_dir, rng) -> None:
    batches = [make_batch(rng, n) for n in (3, 4)]
    one = service.create_training_client(str(model_dir))
    two = net_service.create_training_client(name)
    try:
        losses_one, norms_one = _steps(one, batches)
        losses_two, norms_two = _steps(two, batches)
    finally:
        one.close()
        two.close()
    assert losses_two == pytest.approx(losses_one, rel=1e-5, abs=1e-5)
    assert norms_two == pytest.approx(norms_one, rel=1e-5)


def _run_alone(hosts, host: str, model_dir, redis_url: str, extra: list[str], log: Path, env: dict[str, str],
               bound: float) -> tuple[int, str, float]:
    """A worker in namespace ``host`` that must exit by itself within ``bound``: (status, its output, seconds)."""
    cmd = worker_command(str(model_dir), redis_url, threads=1, extra=extra)
    started = time.monotonic()
    proc = start_process(hosts.command(host, cmd), log, {"GLOO_SOCKET_IFNAME": netns.IFNAME, **env})
    try:
        rc = proc.wait(bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"still running after {bound:g} s (a hang):\n{log.read_text()[-2000:]}")
    return rc, log.read_text(), time.monotonic() - started


def test_a_follower_that_cannot_reach_rank_0_names_the_address(hosts, model_dir, net_redis, tmp_path):
    nobody = f"tcp://{hosts.subnet}.99:29500"  # on host b's subnet, but no host has that address
    rc, out, took = _run_alone(hosts, "b", model_dir, net_redis,
                               ["--shards", "2", "--rank", "1", "--rendezvous", nobody], tmp_path / "follower.log",
                               {"TINKERQ_RENDEZVOUS_TIMEOUT_S": "5"}, 5 + 2 * SLACK_S)  # + imports, model load
    print(f"\nfollower exited {rc} after {took:.1f} s")
    assert rc == 2, out
    assert f"rank 1 could not reach rank 0 at {nobody} within 5 s (TINKERQ_RENDEZVOUS_TIMEOUT_S)" in out, out


def test_a_rank_0_that_cannot_reach_redis_names_the_address(hosts, model_dir, tmp_path):
    unreachable = f"redis://{hosts.subnet}.99:6379/0"
    rc, out, took = _run_alone(hosts, "a", model_dir, unreachable,
                               ["--shards", "2", "--rank", "0", "--rendezvous", f"tcp://{hosts.addresses['a']}:29500"],
                               tmp_path / "rank0.log", {"TINKERQ_CONNECT_TIMEOUT_S": "5"}, 5 + SLACK_S)
    print(f"\nrank 0 exited {rc} after {took:.1f} s")
    assert rc != 0, out
    assert f"cannot reach Redis at {unreachable}" in out, out


def test_cutting_rank_0s_link_mid_run_answers_every_request_and_the_group_comes_back(
        two_hosts, hosts, net_service, service, model_dir):
    """Host a holds rank 0, the Celery side: the cut takes it from Redis and from rank 1 at once. Its heartbeats
    stop; the producer waits TINKERQ_ADOPT_TIMEOUT_S for another worker of the model to adopt the session (there is
    none here), then fails its requests with WorkerLostError. Once the link is back, rank 0 reconnects to Redis,
    the group re-forms and registers again, and a new session trains."""
    rng = np.random.default_rng(92)
    batches = [make_batch(rng, n) for n in (3, 4, 2, 5, 4, 3, 4, 2, 3, 1)]
    tc = net_service.create_training_client(two_hosts.name)
    futures, cut_at = _pipelined_run(tc, batches, lambda: hosts.cut("a"))
    adopt_s = net_service.connection.settings.adopt_timeout_s  # the producer's wait for an adopter
    outcomes = _wait_answered(futures, adopt_s + SLACK_S)
    kinds = _kinds(outcomes)
    first_error = next(i for i, k in enumerate(kinds) if k != "ok")
    print(f"\ncut a: first error {outcomes[first_error][1] - cut_at:.1f} s after the cut, all answered "
          f"{max(t for _, t in outcomes) - cut_at:.1f} s; {kinds}")
    assert all(k == "ok" for k in kinds[:first_error]) and first_error >= 1, kinds
    assert all(k == "WorkerLostError" for k in kinds[first_error:]), kinds
    err = outcomes[first_error][0]
    assert "stopped" in err.message and "may or may not have been applied" in err.message, err
    # Rank 1 loses rank 0 too (its collective times out) and waits for the next generation; so does rank 0.
    wait_for(lambda: "waiting for the group to re-form" in two_hosts.log(1).read_text(), COLLECTIVE_TIMEOUT_S + SLACK_S,
             "rank 1 to notice the cut", two_hosts.procs[1], two_hosts.log(1))
    wait_for(lambda: "the shard group of this model failed" in two_hosts.log(0).read_text(),
             COLLECTIVE_TIMEOUT_S + SLACK_S, "rank 0 to notice the cut", two_hosts.procs[0], two_hosts.log(0))
    hosts.restore("a")
    restored_at = time.monotonic()
    # Rank 0's own account that its group formed again, then its registration. (Registration alone is not
    # enough: a heartbeat that was stuck retrying Redis through the cut can re-announce the model for up to three
    # heartbeats before the group has re-formed; a session opened then fails at once with ShardGroupError.)
    wait_for(lambda: two_hosts.log(0).read_text().count("shard group formed: rank 0") >= 2,
             RENDEZVOUS_TIMEOUT_S + SLACK_S, "the group to re-form", two_hosts.procs[0], two_hosts.log(0))
    two_hosts.wait_serving(net_service.connection, timeout=RENDEZVOUS_TIMEOUT_S + SLACK_S)
    print(f"link back -> re-formed and serving again {time.monotonic() - restored_at:.1f} s")
    assert two_hosts.procs[0].poll() is None and two_hosts.procs[1].poll() is None  # nothing was restarted
    _a_new_session_trains_as_one_worker(net_service, service, two_hosts.name, model_dir, rng)
