"""The producer library is the official SDK's API: `from tinkerq.producer import ServiceClient` stands in for
`tinker.ServiceClient`. The public surfaces are compared with the installed `tinker==0.38.0`; behaviour that
the SDK defines (futures usable as clients, weights-only `load_state`, prompt logprobs) is checked on a fleet.

What is compared, for every public method of the SDK's ServiceClient, TrainingClient, SamplingClient and
APIFuture (and `__init__` where the SDK class defines one):

* that ours exists, as the same kind of attribute (method, staticmethod, classmethod), sync or `async` alike;
* its parameters: names, kinds (positional, keyword-only, ...) and defaults, in order;
* its return annotation, with module prefixes dropped and the SDK's names for the same kinds of object mapped
  to ours (RETURN_ALIASES): this catches a call that returns a client where the SDK returns a future, or a
  list where it returns a response object.

Parameter annotations are not compared: both libraries annotate with their own types under the same names
(the SDK's pydantic `types.Datum`, `RetryConfig`, `types.LossFnType` literal; tinkerq's dataclasses), so the
text says nothing about whether a call binds, and what is accepted at run time is tested below instead.

Every difference must be listed in ALLOWED with its reason; an entry that no longer differs fails too.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import Any

import numpy as np
import pytest

from tests.helpers import make_batch
from tinkerq import errors, producer, types

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(240)

CLASSES = {
    "ServiceClient": (tinker.ServiceClient, producer.ServiceClient),
    "TrainingClient": (tinker.TrainingClient, producer.TrainingClient),
    "SamplingClient": (tinker.SamplingClient, producer.SamplingClient),
    "APIFuture": (tinker.APIFuture, producer.APIFuture),
}

# The SDK's class names for what ours call otherwise (same role, same use).
RETURN_ALIASES = {
    "BackcompatTrainingClientFuture": "TrainingClientFuture",
    "BackcompatSamplingClientFuture": "SamplingClientFuture",
    "AwaitableConcurrentFuture": "APIFuture",  # the SDK's concrete APIFuture
    "List": "list",
}

NO_TELEMETRY = "tinkerq reports no telemetry to anyone: there is no Telemetry object to return"
NO_CONSOLE = ("the producer library makes no console links: the console is the gateway's (GET /console, for the "
              "official SDK's users: docs/gateway.md, Console); operators have Flower")
LOSS_FN_DEFAULT = ("tinkerq superset: loss_fn defaults to 'cross_entropy' (tinkerq's callers relied on it); "
                   "every SDK call binds unchanged")
SAMPLE_DEFAULTS = ("tinkerq superset: num_samples defaults to 1 and sampling_params to SamplingParams() "
                   "(tinkerq's callers relied on them); every SDK call binds unchanged")
MERGED = ("tinkerq extension: keyword-only merged=True also writes the base with a LoRA adapter merged in; "
          "every SDK call binds unchanged")
BUILT_BY_LIBRARY = ("made by the library (ServiceClient / TrainingClient calls), never by users; the SDK's takes "
                    "its HTTP client holder")

ALLOWED: dict[str, str] = {
    "ServiceClient.__init__": "tinkerq connects to a fleet's Redis: ServiceClient(broker_url=None, *, settings=None) "
                              "(TINKERQ_BROKER_URL), not an HTTP base_url with an API key and session metadata",
    "ServiceClient.close": "status is optional (close() was tinkerq's spelling and `with ServiceClient()` uses it); "
                           "tinkerq has no server-side session to mark finished, so status/detail are only logged",
    "ServiceClient.copy_weights": "no per-account checkpoint store to copy between: checkpoints are directories "
                                  "under the fleet's TINKERQ_CHECKPOINT_DIR, readable by every client",
    "ServiceClient.create_custom_loss": "no server-side custom losses (traced torch code run by the workers); "
                                        "forward_backward_custom with a callable runs the loss client-side",
    "ServiceClient.create_rest_client": "no REST API of training runs and checkpoints (Tinker's RestClient)",
    "ServiceClient.get_console_url": NO_CONSOLE,
    "ServiceClient.get_telemetry": NO_TELEMETRY,
    "TrainingClient.__init__": BUILT_BY_LIBRARY,
    "TrainingClient.forward": LOSS_FN_DEFAULT,
    "TrainingClient.forward_async": LOSS_FN_DEFAULT,
    "TrainingClient.forward_backward": LOSS_FN_DEFAULT,
    "TrainingClient.forward_backward_async": LOSS_FN_DEFAULT,
    "TrainingClient.get_console_url": NO_CONSOLE,
    "TrainingClient.get_telemetry": NO_TELEMETRY,
    "TrainingClient.save_weights_external": "no external destination (Tinker's encrypted export): "
                                            "save_weights_for_sampler writes a plain HF / PEFT directory",
    "TrainingClient.save_weights_external_async": "see TrainingClient.save_weights_external",
    "TrainingClient.save_weights_for_sampler": MERGED,
    "TrainingClient.save_weights_for_sampler_async": MERGED,
    "SamplingClient.__init__": BUILT_BY_LIBRARY,
    "SamplingClient.create": "the SDK's internal constructor from its HTTP client holder; use "
                             "ServiceClient.create_sampling_client",
    "SamplingClient.get_telemetry": NO_TELEMETRY,
    "SamplingClient.on_queue_state_change": "the SDK's callback for its server's queue-state reports (rate limits, "
                                            "capacity); tinkerq's queues report nothing of the kind",
    "SamplingClient.sample": SAMPLE_DEFAULTS,
    "SamplingClient.sample_async": SAMPLE_DEFAULTS,
    "APIFuture.future": "a tinkerq future decodes its answer (maybe a claim-checked blob in Redis) in the thread "
                        "that asks for it, so there is no concurrent.futures.Future holding the decoded answer",
}


# Public methods of ours that the SDK's class does not have, each with its reason: tinkerq's own API (documented in
# its docstring), kept to what some caller needs.
SEQ = ("ordered submission with explicit sequence ids, for callers that number requests themselves (the gateway "
       "passes the SDK's seq_id through; gateway/ uses no private producer attribute: tests/test_layering.py)")
EXTENSIONS: dict[str, str] = {
    "ServiceClient.create_training_client": "a full-parameter session (Tinker trains LoRA adapters only)",
    "ServiceClient.create_training_client_async": "see ServiceClient.create_training_client",
    "ServiceClient.open_training_client": "open a session and wait for it in the calling thread (LoRA or full); "
                                          "the gateway runs it in its own thread pool. " + SEQ,
    "ServiceClient.attach_training_client": "a client for a session opened earlier, e.g. by a gateway before its "
                                            "restart, from its ModelInfo. " + SEQ,
    "TrainingClient.submit": SEQ,
    "TrainingClient.skip": "fill a position whose request was refused before it was sent. " + SEQ,
    "TrainingClient.check_loss_request": "the checks forward/forward_backward make, for a request sent with submit",
    "TrainingClient.next_seq_id": "the client's own sequence counter (tests that reorder requests take ids from it)",
    "TrainingClient.echo": "a round trip through the fleet, untouched (latency probes, benchmarks)",
    "TrainingClient.close": "frees the session's memory on its worker now (the SDK's sessions end with the process)",
    "APIFuture.__init__": "made by the library; the SDK's APIFuture is abstract",
    "APIFuture.done": "concurrent.futures' spelling, as before the SDK's API was adopted",
    "APIFuture.exception": "concurrent.futures' spelling: the error, or None",
    "APIFuture.add_done_callback": "concurrent.futures' spelling: a callback once the answer arrives",
    "APIFuture.completed": "a future that already holds a value (calls with nothing to wait for)",
    "APIFuture.failed": "a future that already holds an error (a request refused before it was sent)",
}


def _public(cls: type) -> dict[str, Any]:
    """Public methods (and __init__ if the class, not object, defines it), as raw class attributes."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    if any("__init__" in vars(c) for c in cls.__mro__ if c is not object):
        names.add("__init__")
    out = {}
    for name in names:
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            out[name] = raw
    return out


def _kind(raw: Any) -> str:
    return type(raw).__name__ if isinstance(raw, (staticmethod, classmethod)) else "method"


def _function(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def _returns(signature: inspect.Signature) -> str:
    if signature.return_annotation is inspect.Signature.empty:
        return "(none)"
    text = re.sub(r"\s+", "", str(signature.return_annotation)).strip("'\"")
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", text)  # types.SampleResponse -> SampleResponse
    for sdk_name, ours in RETURN_ALIASES.items():
        text = re.sub(rf"\b{sdk_name}\b", ours, text)
    return text


def _params(signature: inspect.Signature) -> list[tuple[str, str, Any]]:
    return [(p.name, p.kind.name, p.default) for p in signature.parameters.values()]


def differences(sdk_cls: type, our_cls: type, name: str) -> list[str]:
    """How our ``name`` differs from the SDK's (empty: identical as far as a caller can tell)."""
    sdk_raw = _public(sdk_cls)[name]
    ours_raw = _public(our_cls).get(name)
    if ours_raw is None:
        return ["missing"]
    found = []
    if _kind(sdk_raw) != _kind(ours_raw):
        found.append(f"kind: SDK {_kind(sdk_raw)}, ours {_kind(ours_raw)}")
    sdk_fn, our_fn = _function(sdk_raw), _function(ours_raw)
    sdk_async = inspect.iscoroutinefunction(inspect.unwrap(sdk_fn))  # the SDK's decorators hide it
    our_async = inspect.iscoroutinefunction(inspect.unwrap(our_fn))
    if sdk_async != our_async:
        found.append(f"async: SDK {sdk_async}, ours {our_async}")
    sdk_sig, our_sig = inspect.signature(sdk_fn), inspect.signature(our_fn)
    if _params(sdk_sig) != _params(our_sig):
        found.append(f"parameters: SDK {sdk_sig}, ours {our_sig}")
    if name != "__init__" and _returns(sdk_sig) != _returns(our_sig):
        found.append(f"returns: SDK {_returns(sdk_sig)}, ours {_returns(our_sig)}")
    return found


def test_the_installed_sdk_is_the_one_compared():
    assert tinker.__version__ == "0.38.0", "ALLOWED was written against tinker 0.38.0: review it for this version"


@pytest.mark.parametrize("class_name", sorted(CLASSES))
def test_public_surface_matches_the_sdk(class_name):
    sdk_cls, our_cls = CLASSES[class_name]
    unexplained = {}
    for name in sorted(_public(sdk_cls)):
        found = differences(sdk_cls, our_cls, name)
        if found and f"{class_name}.{name}" not in ALLOWED:
            unexplained[f"{class_name}.{name}"] = found
    assert not unexplained, "differences from tinker's API not listed in ALLOWED:\n" + "\n".join(
        f"  {k}: {'; '.join(v)}" for k, v in unexplained.items())


def test_every_allowed_difference_still_exists():
    stale = []
    for key in sorted(ALLOWED):
        class_name, name = key.split(".", 1)
        sdk_cls, our_cls = CLASSES[class_name]
        if name not in _public(sdk_cls) or not differences(sdk_cls, our_cls, name):
            stale.append(key)
    assert not stale, f"ALLOWED entries that no longer differ from the SDK (remove them): {stale}"


def test_every_public_method_beyond_the_sdk_is_listed():
    found = {f"{name}.{method}" for name, (sdk_cls, our_cls) in CLASSES.items()
             for method in set(_public(our_cls)) - set(_public(sdk_cls))}
    assert found == set(EXTENSIONS), (f"not listed in EXTENSIONS: {sorted(found - set(EXTENSIONS))}; "
                                      f"listed but not there (remove them): {sorted(set(EXTENSIONS) - found)}")
    for key in EXTENSIONS:  # documented where a caller reads it (an async form: on its sync form)
        class_name, method = key.split(".", 1)
        method = method.removesuffix("_async")
        assert method == "__init__" or inspect.getdoc(getattr(CLASSES[class_name][1], method)), key


def test_the_comparison_notices_differences():
    """The checker itself: a renamed parameter, a changed default, sync-for-async and a client-for-future
    return each count."""

    class Sdk:
        def f(self, a: int, b: int = 1) -> APIFuture[int]: ...  # noqa: F821
        async def g(self) -> None: ...
        def h(self) -> BackcompatTrainingClientFuture: ...  # noqa: F821

    class Ours:
        def f(self, a: int, c: int = 2) -> APIFuture[int]: ...  # noqa: F821
        def g(self) -> None: ...
        def h(self) -> TrainingClient: ...  # noqa: F821

    assert [d.split(":")[0] for d in differences(Sdk, Ours, "f")] == ["parameters"]
    assert [d.split(":")[0] for d in differences(Sdk, Ours, "g")] == ["async"]
    assert [d.split(":")[0] for d in differences(Sdk, Ours, "h")] == ["returns"]


# -- behaviour on a fleet -----------------------------------------------------------------------------------------

ADAM = types.AdamParams(learning_rate=5e-3)


def test_create_calls_return_futures_usable_as_clients(service, model_dir):
    from tinkerq.producer import SamplingClient, SamplingClientFuture, TrainingClient, TrainingClientFuture

    future = service.create_lora_training_client(str(model_dir), rank=4, seed=0)
    assert isinstance(future, TrainingClientFuture)
    try:
        # Used directly as the client (tinkerq's code before futures): attribute access waits for it.
        out = future.forward(make_batch(np.random.default_rng(1), 2)).result(timeout=60)
        assert np.isfinite(out.metrics["loss:sum"])
        tc = future.result(timeout=60)
        assert isinstance(tc, TrainingClient) and future.model_id == tc.model_id
        info = tc.get_info()
        assert info.model_data.model_name == str(model_dir) and info.is_lora and info.lora_rank == 4
        sampler_future = tc.save_weights_and_get_sampling_client()
        assert isinstance(sampler_future, SamplingClientFuture)
        assert isinstance(sampler_future.result(timeout=60), SamplingClient)
        assert sampler_future.sample(types.ModelInput.from_ints([1, 2, 3]), 1,
                                     types.SamplingParams(max_tokens=2)).result(timeout=60).sequences
    finally:
        future.close()
    with pytest.raises(errors.UnknownModelError):  # raised at the call, as before
        service.create_training_client("/nobody/serves/this")
    with pytest.raises(errors.UserError, match="'lion' is not served"):
        service.create_lora_training_client(str(model_dir), optimizer={"type": "lion"})
    caps = service.get_server_capabilities()
    assert isinstance(caps, types.GetServerCapabilitiesResponse)
    (model,) = [m for m in caps.supported_models if m.model_name == str(model_dir)]
    assert model.trainable and model.sampleable and model.max_context_length


def test_async_forms_give_clients_and_responses(service, model_dir):
    from tinkerq.producer import SamplingClient, TrainingClient

    async def main() -> None:
        tc = await service.create_lora_training_client_async(str(model_dir), rank=4)
        other = await service.create_training_client(str(model_dir))  # awaiting the future
        try:
            assert isinstance(tc, TrainingClient) and isinstance(other, TrainingClient)
            fb = await tc.forward_backward_async(make_batch(np.random.default_rng(2), 2))
            step = await tc.optim_step_async(ADAM)
            assert np.isfinite((await fb).metrics["loss:sum"]) and (await step.result_async(timeout=60)) is not None
            sampler = await tc.save_weights_and_get_sampling_client_async()
            assert isinstance(sampler, SamplingClient)
            assert isinstance(await tc.save_weights_and_get_sampling_client(), SamplingClient)
            response = await sampler.sample_async(types.ModelInput.from_ints([1, 5, 6]), 2,
                                                  types.SamplingParams(max_tokens=4, seed=1))
            assert isinstance(response, types.SampleResponse) and len(response.sequences) == 2
            base = await service.create_sampling_client_async(base_model=str(model_dir))
            assert isinstance(base, SamplingClient) and await base.get_base_model_async() == str(model_dir)
        finally:
            await asyncio.to_thread(tc.close)
            await asyncio.to_thread(other.close)

    asyncio.run(main())


def _losses(tc, batches) -> list[float]:
    futures = [(tc.forward_backward(b), tc.optim_step(ADAM)) for b in batches]
    return [fb.result(timeout=60).metrics["loss:sum"] for fb, _ in futures]


def test_load_state_takes_weights_and_load_state_with_optimizer_takes_adam_too(service, model_dir):
    """Tinker's semantics: load_state / create_training_client_from_state restore the weights and start a fresh
    optimizer; the _with_optimizer forms continue the saved run exactly."""
    rng = np.random.default_rng(3)
    batches = [make_batch(rng, 3) for _ in range(6)]
    a = service.create_training_client(str(model_dir)).result(timeout=60)
    try:
        _losses(a, batches[:3])
        saved = a.save_state("surface-mid", ttl_seconds=3600).result(timeout=60).path
        uninterrupted = _losses(a, batches[3:])
    finally:
        a.close()
    fresh_start = service.create_training_client(str(model_dir)).result(timeout=60)
    resumed_fresh = service.create_training_client(str(model_dir)).result(timeout=60)
    clients = [fresh_start, resumed_fresh]
    try:
        exact = service.create_training_client_from_state_with_optimizer(saved).result(timeout=60)
        clients.append(exact)
        weights_only = service.create_training_client_from_state(saved).result(timeout=60)
        clients.append(weights_only)
        loaded = fresh_start.load_state(saved).result(timeout=60)
        assert isinstance(loaded, types.LoadWeightsResponse) and loaded.path
        assert isinstance(resumed_fresh.load_state_with_optimizer(saved).result(timeout=60), types.LoadWeightsResponse)

        assert _losses(exact, batches[3:]) == pytest.approx(uninterrupted, rel=1e-6, abs=1e-7)
        assert _losses(resumed_fresh, batches[3:]) == pytest.approx(uninterrupted, rel=1e-6, abs=1e-7)
        fresh_optimizer = _losses(weights_only, batches[3:])
        # Same weights: the first loss (before any step) is the saved run's; a fresh AdamW then steps differently.
        assert fresh_optimizer[0] == pytest.approx(uninterrupted[0], rel=1e-6, abs=1e-7)
        assert abs(fresh_optimizer[1] - uninterrupted[1]) > 1e-4 * abs(uninterrupted[1])
        # load_state on an open session is the same as opening one from the state.
        assert _losses(fresh_start, batches[3:]) == pytest.approx(fresh_optimizer, rel=1e-6, abs=1e-7)
    finally:
        for tc in clients:
            tc.close()


def test_checkpoint_options_are_accepted_or_refused_clearly(training_client):
    tc = training_client
    assert tc.save_state("surface-ttl", ttl_seconds=7200).result(timeout=60).path
    assert tc.save_state("surface-ttl", overwrite=True).result(timeout=60).path
    saved = tc.save_weights_for_sampler("surface-ttl-weights", ttl_seconds=7200).result(timeout=60)
    assert isinstance(saved, types.SaveWeightsResponse) and saved.path
    for bad in (0, -5, 1.5, True, 10 * 365 * 24 * 3600 + 1):
        err = tc.save_state("surface-bad", ttl_seconds=bad).exception(timeout=5)
        assert isinstance(err, errors.UserError) and "ttl_seconds" in err.message, bad
    err = tc.optim_step(ADAM, adam_params=ADAM).exception(timeout=5)
    assert isinstance(err, errors.UserError)
    with pytest.raises(errors.UserError, match="inflight"):
        tc.save_weights_and_get_sampling_client(kind="inflight")
    with pytest.raises(errors.UserError, match="record_stability_info"):
        tc.save_weights_and_get_sampling_client(record_stability_info=True)


def test_ordered_submission_with_explicit_sequence_ids(service, model_dir, redis_url):
    """TrainingClient.submit (the gateway's seam): requests numbered by the caller run in seq_id order whatever
    order they are sent in; a resend is answered without being applied again; a refusal fills its position; a
    client attached from the session's ModelInfo (another ServiceClient, as a restarted gateway) continues the
    session; close() comes after every submitted id. The numbers are those of the SDK-shaped calls."""
    from tinkerq.producer import ServiceClient
    from tinkerq.wire import messages

    rng = np.random.default_rng(6)
    batch, probe = make_batch(rng, 3), make_batch(rng, 2)
    loss_body = messages.encode_loss_request(batch, "cross_entropy", None)
    probe_body = messages.encode_loss_request(probe, "cross_entropy", None)
    decode_fb = messages.decode_forward_backward_output
    reference = service.create_training_client(str(model_dir)).result(timeout=60)
    tc = service.open_training_client(str(model_dir), timeout=60)
    other = ServiceClient(broker_url=redis_url)
    closed = False
    try:
        want_fb = reference.forward_backward(batch)
        reference.optim_step(ADAM)
        want = reference.forward(probe).result(timeout=60).metrics["loss:sum"]

        step = tc.submit("optim_step", messages.encode_adam(ADAM), seq_id=2,
                         decode=messages.decode_optim_step_response)  # early: held until 1 has run
        fb = tc.submit("forward_backward", loss_body, seq_id=1, decode=decode_fb, argsrepr="test")
        got_fb = fb.result(timeout=60).metrics["loss:sum"]
        assert got_fb == pytest.approx(want_fb.result(timeout=60).metrics["loss:sum"], rel=1e-6)
        assert isinstance(step.result(timeout=60), types.OptimStepResponse)
        again = tc.submit("forward_backward", loss_body, seq_id=1, decode=decode_fb)  # a resend
        assert again.result(timeout=60).metrics["loss:sum"] == got_fb

        refused = tc.submit("create_model", {}, seq_id=3)  # not an ordered request: refused, position filled
        assert isinstance(refused.exception(timeout=5), errors.UserError)
        assert isinstance(tc.submit("forward", probe_body, seq_id=0).exception(timeout=5), errors.UserError)
        with pytest.raises(errors.ValidationError):
            tc.check_loss_request(make_batch(rng, 2), "no_such_loss")

        attached = other.attach_training_client(tc.info)
        assert attached.model_id == tc.model_id
        forward = attached.submit("forward", probe_body, seq_id=4, decode=decode_fb)
        assert forward.result(timeout=60).metrics["loss:sum"] == pytest.approx(want, rel=1e-6)  # 1 applied once
        assert tc.skip(5, "test").result(timeout=60) is None
        tc.close()  # request 6: after every id given to submit (as request 1, it would be answered as a repeat)
        closed = True
        with pytest.raises(errors.TinkerqError, match="not open"):
            attached.submit("forward", probe_body, seq_id=7, decode=decode_fb).result(timeout=60)
    finally:
        reference.close()
        other.close()
        if not closed:
            tc.close(timeout=10)
    with pytest.raises(errors.UnknownModelError):
        service.open_training_client("/nobody/serves/this")
    with pytest.raises(errors.ValidationError):
        service.open_training_client(str(model_dir), types.LoraConfig(rank=0))


def test_compute_logprobs_match_forward(service, model_dir, training_client):
    tokens = [1, 17, 33, 5, 60, 2, 9, 41]
    sampler = service.create_sampling_client(base_model=str(model_dir)).result()
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=60)
    assert len(logprobs) == len(tokens) and logprobs[0] is None
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1)})
    forward = training_client.forward([datum]).result(timeout=60).loss_fn_outputs[0]["logprobs"].tolist()
    np.testing.assert_allclose(logprobs[1:], forward, atol=2e-4, rtol=0)

    last = asyncio.run(sampler.compute_logprobs_async(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=3))
    assert last[:-3] == [None] * (len(tokens) - 3)
    np.testing.assert_allclose(last[-3:], logprobs[-3:], atol=1e-5, rtol=0)
    response = sampler.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=2),
                              include_prompt_logprobs=True).result(timeout=60)
    np.testing.assert_allclose(response.prompt_logprobs[1:], logprobs[1:], atol=1e-5, rtol=0)
    assert response.sequences[0].tokens

    prompt = types.ModelInput.from_ints(tokens)
    # Malformed per-position options are user errors (served ones: tests/test_sdk_sampling_options.py).
    for options in ({"topk_prompt_logprobs": -1}, {"topk_sample_logprobs": 5000}, {"prompt_alt_tokens_k": -1},
                    {"target_prompt_logprobs": types.TensorData([[1]], dtype="int64")},
                    {"prompt_logprobs_last_n": 2}, {"include_prompt_logprobs": True, "prompt_logprobs_last_n": 99}):
        err = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), **options).exception(timeout=5)
        assert isinstance(err, errors.UserError), options


def test_sampler_handles_and_pickles_name_the_same_weights(service, model_dir, monkeypatch):
    from tinkerq.producer import SamplingClient

    monkeypatch.setenv("TINKERQ_BROKER_URL", service.settings.broker_url)
    sampler = service.create_sampling_client(base_model=str(model_dir)).result()
    prompt, params = types.ModelInput.from_ints([3, 4, 5]), types.SamplingParams(max_tokens=4, seed=7)
    expected = [s.tokens for s in sampler.sample(prompt, 2, params).result(timeout=60).sequences]
    # What pickle (or copy) stores for a client is its __reduce__: the handle, never the broker URL. Rebuilt
    # here without pickle: the project never unpickles anything, in tests either.
    rebuild, args = sampler.__reduce__()
    assert args == (sampler.get_sampler_handle(),)
    for other in (SamplingClient.from_sampler_handle(sampler.get_sampler_handle()), rebuild(*args)):
        assert other.get_base_model() == str(model_dir)
        assert [s.tokens for s in other.sample(prompt, 2, params).result(timeout=60).sequences] == expected
    with pytest.raises(errors.UserError):
        SamplingClient.from_sampler_handle("not-a-handle")


def test_forward_backward_custom_gives_the_gradients_of_its_loss(service, model_dir):
    """A custom loss equal to cross_entropy trains exactly as cross_entropy does."""
    import torch

    batch = make_batch(np.random.default_rng(4), 3)
    probe = make_batch(np.random.default_rng(5), 2)

    def weighted_nll(data, logprobs_list):
        loss = sum(-(lp * torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy())).sum()
                   for d, lp in zip(data, logprobs_list, strict=True))
        return loss, {"custom:count": float(len(data))}

    a = service.create_training_client(str(model_dir)).result(timeout=60)
    b = service.create_training_client(str(model_dir)).result(timeout=60)
    try:
        reference = a.forward_backward(batch, "cross_entropy")
        custom = b.forward_backward_custom(batch, weighted_nll)
        a.optim_step(ADAM)
        b.optim_step(ADAM)
        out = custom.result(timeout=60)
        assert out.metrics["loss:sum"] == pytest.approx(reference.result(timeout=60).metrics["loss:sum"], rel=1e-5)
        assert out.metrics["custom:count"] == 3 and "surrogate_loss:sum" in out.metrics
        after_a = a.forward(probe).result(timeout=60).metrics["loss:sum"]
        after_b = b.forward(probe).result(timeout=60).metrics["loss:sum"]
        assert after_b == pytest.approx(after_a, rel=1e-5)
    finally:
        a.close()
        b.close()


def test_code_built_on_tinker_types_runs_unchanged(service, model_dir):
    """Existing Tinker code builds tinker.Datum / ModelInput / TensorData / SamplingParams / AdamParams: the
    producer takes them as they are, with the same numbers as tinkerq's own types."""
    import tinker

    batch = make_batch(np.random.default_rng(4), 3, max_len=16)
    theirs = [tinker.Datum(model_input=tinker.ModelInput.from_ints(d.model_input.to_ints()),
                           loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"].to_numpy().tolist(),
                                           "weights": tinker.TensorData.from_numpy(d.loss_fn_inputs["weights"]
                                                                                  .to_numpy())})
              for d in batch]
    a = service.create_lora_training_client(str(model_dir), rank=2, seed=1).result(timeout=60)
    b = service.create_lora_training_client(str(model_dir), rank=2, seed=1).result(timeout=60)
    try:
        out_a = a.forward_backward(theirs, "cross_entropy").result(timeout=60)
        out_b = b.forward_backward(batch, "cross_entropy").result(timeout=60)
        assert out_a.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-6)
        a.optim_step(tinker.AdamParams(learning_rate=5e-3)).result(timeout=60)
        b.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=60)
        after_a = a.forward(theirs, "cross_entropy").result(timeout=60)
        after_b = b.forward(batch, "cross_entropy").result(timeout=60)
        assert after_a.metrics["loss:sum"] == pytest.approx(after_b.metrics["loss:sum"], rel=1e-6)
        sampler = a.save_weights_and_get_sampling_client().result(timeout=60)
        params = tinker.SamplingParams(max_tokens=4, seed=3, temperature=1.0)
        got = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 2, params).result(timeout=60)
        want = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                              types.SamplingParams(max_tokens=4, seed=3)).result(timeout=60)
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        assert len(sampler.compute_logprobs(tinker.ModelInput.from_ints([1, 2, 3])).result(timeout=60)) == 3
    finally:
        a.close()
        b.close()
