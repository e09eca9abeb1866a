"""LoRA on a shard group after a shard dies: the re-formed group makes a new sharded base.

A module of its own: rank 0 runs in this process, and a process holds one default process group at a time, so
this group is made after tests/test_sharded_lora.py's module-scoped ones are gone.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import build_tiny_llama
from tests.test_sharded_lora import (
    ADAM,
    CONFIGS,
    MICROBATCH_TOKENS,
    TOLERANCE,
    Group,
    _assert_close,
    _assert_same_grads,
    _batches,
    _max_diff,
    _open,
)
from tinkerq.launcher.processes import start_process, worker_command

pytestmark = pytest.mark.timeout(600)


def test_after_a_shard_dies_the_re_formed_group_makes_a_new_sharded_base(tmp_path_factory):
    """A killed follower breaks the group (the LoRA session fails with ShardGroupError); once the follower is back
    and the group re-forms, a new LoRA session trains on a new sharded base, equal to one process."""
    import threading

    from tinkerq.errors import ShardGroupError

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("reform-model"), seed=4)
    logs = tmp_path_factory.mktemp("reform-logs")
    g = Group(model_dir, 2, logs)
    formed = threading.Event()
    g.host.on_formed = formed.set
    try:
        s = g.host.open_lora("before", CONFIGS[0], base_model="tiny")
        s.run_loss(_batches(1, 1)[0], "cross_entropy", None, backward=True)
        os.killpg(g.procs[0].pid, signal.SIGKILL)
        g.procs[0].wait(30)
        with pytest.raises(ShardGroupError):
            s.run_loss(_batches(2, 1)[0], "cross_entropy", None, backward=True)
        address = f"tcp://{g.host.group.spec.host}:{g.host.group.spec.port}"
        env = {"TINKERQ_MICROBATCH_TOKENS": str(MICROBATCH_TOKENS), "TINKERQ_LOSS_BACKEND": "torch",
               "TINKERQ_COLLECTIVE_TIMEOUT_S": "120", "TINKERQ_RENDEZVOUS_TIMEOUT_S": "120"}
        g.procs[0] = start_process(worker_command(str(model_dir), threads=1, extra=[
            "--shards", "2", "--rank", "1", "--rendezvous", address]), logs / "rank1-again.log", env)
        assert formed.wait(120), "the group did not re-form"
        sharded, alone = _open(g, "after")
        for batch in _batches(3, 2):
            _assert_close(sharded[0].run_loss(batch, "cross_entropy", None, backward=True),
                          alone[0].run_loss(batch, "cross_entropy", None, backward=True))
            _assert_same_grads(sharded[0], alone[0])
            sharded[0].optim_step(ADAM)
            alone[0].optim_step(ADAM)
        assert _max_diff(sharded[0], alone[0]) <= TOLERANCE
    finally:
        g.stop()
