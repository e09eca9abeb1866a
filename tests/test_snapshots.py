"""Published sampling snapshots (worker/sampling/snapshots.py): through Redis-sized records and through files, tied
weights, withdrawal of old ones, and refusals. In-process, with the store the embedded fleet uses."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import build_tiny_llama, load_reference
from tinkerq import errors, keys
from tinkerq.settings import Settings
from tinkerq.store import MemoryStore
from tinkerq.wire import messages
from tinkerq.worker.sampling.snapshots import Snapshots

pytestmark = pytest.mark.timeout(120)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return out


@contextlib.contextmanager
def publisher(store: MemoryStore, owner: Snapshots) -> Iterator[list[str]]:
    """The owner worker's publisher thread (worker/transport/sample_intake.py): answers publish requests; yields the
    ids."""
    asked: list[str] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            item = store.pop(keys.publish_queue(owner.worker_id), timeout_s=0.1)
            if item is not None:
                asked.append(messages.read_intake_item(item, max_bytes=1 << 20))
                owner.publish(asked[-1])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield asked
    finally:
        stop.set()
        thread.join(5)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("inline", [True, False])
def test_a_snapshot_published_by_one_worker_loads_identically_on_another(tmp_path: Path, tied: bool, inline: bool):
    base = load_reference(build_tiny_llama(tmp_path / "model", tied=tied))
    settings = Settings(checkpoint_dir=str(tmp_path / "ckpt"), max_samplers=2,
                        snapshot_inline_max_bytes=(64 << 20) if inline else 1)
    store = MemoryStore()
    maker = Snapshots(store, settings, "m", base, worker_id="w1")
    other = Snapshots(store, settings, "m", copy.deepcopy(base), worker_id="w2")  # another worker of the model
    trained = _perturbed(base, seed=1)
    sid = maker.add(trained, session_id="a" * 32)
    assert maker.resolve({"snapshot": sid})[1] is trained  # its maker samples it as it is
    with publisher(store, maker) as asked:
        key, loaded, _ = other.resolve({"snapshot": sid})  # asks the maker to publish it, then loads it
    assert asked == [sid]
    files = list((tmp_path / "ckpt" / "snapshots").glob("*.safetensors"))
    assert len(files) == (0 if inline else 1)
    assert key == ("snapshot", sid) and loaded is not other.base
    assert _same_weights(loaded, trained)
    if tied:  # still one tensor, as in the model that made it
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert other.resolve({"snapshot": sid})[1] is loaded  # kept (LRU), not loaded again

    # A session keeps its max_samplers newest published: the oldest is withdrawn everywhere but in caches.
    newer = [maker.add(_perturbed(base, seed=s), session_id="a" * 32) for s in (2, 3)]
    assert store.get(keys.snapshot(sid)) is None and all(store.get(keys.snapshot(n)) for n in newer)
    if not inline:
        assert not files[0].exists()
    fresh = Snapshots(store, settings, "m", copy.deepcopy(base))
    with pytest.raises(errors.ValidationError, match="save_weights_and_get_sampling_client"):
        fresh.resolve({"snapshot": sid})


def test_snapshots_of_another_model_and_unknown_ids_are_refused(tmp_path: Path):
    base = load_reference(build_tiny_llama(tmp_path / "model"))
    settings = Settings(checkpoint_dir=str(tmp_path / "ckpt"))
    store = MemoryStore()
    sid = Snapshots(store, settings, "model-a", base, worker_id="w1").add(_perturbed(base, 1), session_id="b" * 32)
    with pytest.raises(errors.UnknownModelError, match="model-a"):
        Snapshots(store, settings, "model-b", base).resolve({"snapshot": sid})
    with pytest.raises(errors.ValidationError, match="not available"):
        Snapshots(store, settings, "model-a", base).resolve({"snapshot": "f" * 32})
    with pytest.raises(errors.MalformedMessageError, match="snapshot id"):
        Snapshots(store, settings, "model-a", base).resolve({"snapshot": "../x"})
    assert Snapshots(store, settings, "model-a", base).resolve({"base": True})[1] is base


def test_the_cache_is_bounded(tmp_path: Path):
    base = load_reference(build_tiny_llama(tmp_path / "model"))
    settings = Settings(checkpoint_dir=str(tmp_path / "ckpt"), sampler_cache_size=2, max_samplers=10)
    store = MemoryStore()
    maker = Snapshots(store, settings, "m", base, worker_id="w1")
    other = Snapshots(store, settings, "m", copy.deepcopy(base), worker_id="w2")
    ids = [maker.add(_perturbed(base, s), session_id="c" * 32) for s in range(4)]
    with publisher(store, maker):
        for sid in ids:
            other.resolve({"snapshot": sid})
        assert len(other) == 2  # the two most recent loads stay; the others are loaded again when asked for
        model = other.resolve({"snapshot": ids[0]})[1]
    assert _same_weights(model, _perturbed(base, 0)) and len(other) == 2


def test_two_workers_waiting_on_each_others_snapshots_do_not_deadlock(tmp_path: Path):
    """Each worker's intake blocks while it fetches the other's snapshot; publishing runs apart from it."""
    base = load_reference(build_tiny_llama(tmp_path / "model"))
    settings = Settings(checkpoint_dir=str(tmp_path / "ckpt"))
    store = MemoryStore()
    a = Snapshots(store, settings, "m", base, worker_id="a")
    b = Snapshots(store, settings, "m", copy.deepcopy(base), worker_id="b")
    sa, sb = a.add(_perturbed(base, 1), "d" * 32), b.add(_perturbed(base, 2), "e" * 32)
    got: dict[str, torch.nn.Module] = {}
    with publisher(store, a), publisher(store, b):
        threads = [threading.Thread(target=lambda: got.update(a=a.resolve({"snapshot": sb})[1])),
                   threading.Thread(target=lambda: got.update(b=b.resolve({"snapshot": sa})[1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert _same_weights(got["a"], _perturbed(base, 2)) and _same_weights(got["b"], _perturbed(base, 1))


def test_a_shard_groups_snapshot_is_serialised_where_its_owner_says(tmp_path: Path):
    """On a shard group the worker passes ``serialise=run_control``: the publisher thread hands the serialisation
    to the compute loop (never beside the group's collectives). Here a stand-in loop thread runs it."""
    base = load_reference(build_tiny_llama(tmp_path / "model"))
    settings = Settings(checkpoint_dir=str(tmp_path / "ckpt"))
    store = MemoryStore()
    ran_on: list[str] = []

    def on_loop(fn):
        def run():
            ran_on.append(threading.current_thread().name)
            fn()
        thread = threading.Thread(target=run, name="stand-in-compute-loop")
        thread.start()
        thread.join(30)

    maker = Snapshots(store, settings, "m", base, worker_id="w1", serialise=on_loop)
    other = Snapshots(store, settings, "m", copy.deepcopy(base), worker_id="w2")
    trained = _perturbed(base, seed=4)
    sid = maker.add(trained, session_id="c" * 32)
    with publisher(store, maker):
        _, loaded, _ = other.resolve({"snapshot": sid})
    assert ran_on == ["stand-in-compute-loop"] and _same_weights(loaded, trained)
