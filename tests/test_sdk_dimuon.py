"""Dimuon (docs/optimizers.md) through the official SDK 0.38 and a real `tinkerq gateway`, and through the producer
library, against a real worker process and Redis.

Checked independently: a LoRA run of two Dimuon steps, ``save_state``, ``create_training_client_from_state_with_
optimizer`` and a third step (with the two settings SDK 0.38's DimuonParams lacks, sent as a raw OptimParamsBase)
ends with the adapter and the logprobs of a PeftModel loaded from the run's own initial adapter and stepped by the
plain reference of tests/test_dimuon.py; the same run without the restored momentum would not (the check can fail).
Every mistake is one user error that reaches the caller, and the worker keeps serving: the run's next step is still
the reference's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import make_batch, reference_logprobs
from tests.sdk_fleet import Fleet, sdk_fleet
from tests.test_dimuon import Reference
from tests.test_gateway import ADAM, NAME, sdk_batch
from tests.test_lora import ce_loss, lora_params, peft_model
from tests.test_sdk_checkpoints import directory_of
from tinkerq import errors, types
from tinkerq.wire import messages

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:DEPRECATED:FutureWarning")]
RANK = 4
STEPS = [  # (the SDK's hyperparameters, the same as tinkerq's)
    (tinker.DimuonParams(learning_rate=2e-2, grad_clip_norm=0.5, beta1=0.9),
     types.DimuonParams(learning_rate=2e-2, grad_clip_norm=0.5, beta1=0.9)),
    (tinker.DimuonParams(learning_rate=1e-2, beta1=0.8),
     types.DimuonParams(learning_rate=1e-2, beta1=0.8)),
    # After the resume: the fields SDK 0.38's DimuonParams no longer has, through its open-ended base class.
    (OptimParamsBase(type="dimuon", learning_rate=2e-2, beta1=0.9, damping=1e-3, rank_lr_correction_exponent=0.3),
     types.DimuonParams(learning_rate=2e-2, beta1=0.9, damping=1e-3, rank_lr_correction_exponent=0.3)),
]
WEIGHT_ATOL = 1e-5  # the adapter against the reference (measured in process: <= 1e-7)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[Fleet]:
    os.environ["TINKER_TELEMETRY"] = "0"
    with sdk_fleet(model_dir, redis_url, checkpoint_dir, tmp_path_factory.mktemp("sdk-dimuon")) as made:
        yield made


def service(fleet: Fleet) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=fleet.url, api_key=fleet.keys["alice"])


def batches() -> list[list[types.Datum]]:
    rng = np.random.default_rng(17)
    return [make_batch(rng, 3, max_len=12) for _ in STEPS]


def adapter_of(directory: Path) -> dict[str, np.ndarray]:
    """A saved state's adapter, by the names lora_params gives PEFT's."""
    return {k.removeprefix("base_model.model."): v.numpy()
            for k, v in load_file(str(directory / "adapter_model.safetensors")).items()}


class Oracle:
    """A PeftModel loaded from a run's initial adapter, stepped by the plain reference (tests/test_dimuon.py);
    ``without_momentum``: from the resume on, a twin whose momentum restarts at zero."""

    def __init__(self, model_dir: Path, initial: Path) -> None:
        self.model = peft_model(model_dir, initial)
        self.params = lora_params(self.model)
        self.ref = Reference({n: p.detach().numpy() for n, p in self.params.items()}, rank=RANK)
        self.without_momentum: Reference | None = None

    def step(self, data: list[types.Datum], hyper: types.DimuonParams) -> float:
        ce_loss(self.model, data).backward()
        grads = {n: p.grad.detach().numpy() for n, p in self.params.items()}
        self.model.zero_grad()
        if self.without_momentum is not None:
            self.without_momentum.step(grads, hyper)
        _, lr = self.ref.step(grads, hyper)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(torch.from_numpy(self.ref.weights[n]))
        return lr

    def resume(self) -> None:
        self.without_momentum = Reference(self.ref.weights, rank=RANK)

    def logprobs(self, data: list[types.Datum]) -> list[np.ndarray]:
        with torch.no_grad():
            return [reference_logprobs(self.model, d).numpy() for d in data]


def check_adapter(found: dict[str, np.ndarray], oracle: Oracle) -> None:
    assert set(found) == set(oracle.ref.weights)
    for n, w in oracle.ref.weights.items():
        np.testing.assert_allclose(found[n], w, rtol=0, atol=WEIGHT_ATOL, err_msg=n)
    assert oracle.without_momentum is not None  # the check can fail: without the momentum it is another adapter
    apart = max(float(np.abs(found[n] - w).max()) for n, w in oracle.without_momentum.weights.items())
    assert apart > 20 * WEIGHT_ATOL, apart


def test_the_sdk_trains_resumes_and_steps_with_dimuon(fleet: Fleet, model_dir: Path):
    sc = service(fleet)
    tc = sc.create_lora_training_client(NAME, rank=RANK, seed=5, optimizer=tinker.DimuonOptimizerConfig()).result(
        timeout=120)
    assert tc.get_info().optimizer_config.type == "dimuon"
    initial = tc.save_state("dimuon-init").result(timeout=120).path
    oracle = Oracle(model_dir, directory_of(fleet, initial))
    data = batches()
    for i in range(2):
        tc.forward_backward(sdk_batch(data[i]), "cross_entropy").result(timeout=120)
        metrics = tc.optim_step(STEPS[i][0]).result(timeout=120).metrics
        lr = oracle.step(data[i], STEPS[i][1])
        assert metrics["learning_rate:mean"] == pytest.approx(lr) and metrics["step:max"] == i + 1
    assert lr == pytest.approx(1e-2 * (32 / RANK) ** 0.175)
    middle = tc.save_state("dimuon-two").result(timeout=120).path
    assert tc.get_info().optimizer_config.type == "dimuon"
    resumed = sc.create_training_client_from_state_with_optimizer(middle).result(timeout=120)
    assert resumed.get_info().optimizer_config.type == "dimuon"  # the optimizer came back with its state
    assert sc.create_rest_client().get_weights_info_by_tinker_path(middle).result().optimizer_config.type == "dimuon"
    oracle.resume()
    resumed.forward_backward(sdk_batch(data[2]), "cross_entropy").result(timeout=120)
    metrics = resumed.optim_step(STEPS[2][0]).result(timeout=120).metrics
    assert metrics["learning_rate:mean"] == pytest.approx(oracle.step(data[2], STEPS[2][1]))
    assert metrics["step:max"] == 3
    final = resumed.save_state("dimuon-three").result(timeout=120).path
    check_adapter(adapter_of(directory_of(fleet, final)), oracle)
    out = resumed.forward(sdk_batch(data[0]), "cross_entropy").result(timeout=120)
    for got, want in zip(out.loss_fn_outputs, oracle.logprobs(data[0]), strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, atol=LOGPROB_ATOL)

    # Weights only: a fresh optimizer, AdamW unless another is named (the SDK's optimizer=).
    plain = sc.create_training_client_from_state(middle).result(timeout=120)
    assert plain.get_info().optimizer_config.type == "adamw"
    plain.forward_backward(sdk_batch(data[2]), "cross_entropy").result(timeout=120)
    assert plain.optim_step(tinker.AdamParams(**ADAM)).result(timeout=120).metrics["step:max"] == 1
    fresh = sc.create_training_client_from_state(middle, optimizer=tinker.DimuonOptimizerConfig()).result(timeout=120)
    assert fresh.get_info().optimizer_config.type == "dimuon"
    fresh.forward_backward(sdk_batch(data[2]), "cross_entropy").result(timeout=120)
    assert fresh.optim_step(STEPS[2][0]).result(timeout=120).metrics["step:max"] == 1  # momentum and step afresh
    found = adapter_of(directory_of(fleet, fresh.save_state("dimuon-fresh").result(timeout=120).path))
    assert oracle.without_momentum is not None
    for n, w in oracle.without_momentum.weights.items():  # the step a restarted momentum gives
        np.testing.assert_allclose(found[n], w, rtol=0, atol=WEIGHT_ATOL, err_msg=n)


def test_the_producer_trains_resumes_and_steps_with_dimuon(fleet: Fleet, model_dir: Path, tmp_path):
    from tinkerq.producer import ServiceClient

    service_client = ServiceClient(broker_url=fleet.redis_url)
    try:
        tc = service_client.create_lora_training_client(NAME, rank=RANK, seed=6,
                                                         optimizer=types.DimuonOptimizerConfig()).result(timeout=120)
        assert tc.optimizer_config == types.DimuonOptimizerConfig()
        oracle = Oracle(model_dir, Path(tc.save_state("dimuon-init").result(timeout=120).path))
        data = batches()
        for i in range(2):
            tc.forward_backward(data[i], "cross_entropy").result(timeout=120)
            metrics = tc.optim_step(STEPS[i][1]).result(timeout=120).metrics
            assert metrics["learning_rate:mean"] == pytest.approx(oracle.step(data[i], STEPS[i][1]))
        middle = tc.save_state("dimuon-two").result(timeout=120).path
        resumed = service_client.create_training_client_from_state_with_optimizer(middle).result(timeout=120)
        assert resumed.optimizer_config == types.DimuonOptimizerConfig()
        oracle.resume()
        resumed.forward_backward(data[2], "cross_entropy").result(timeout=120)
        metrics = resumed.optim_step(STEPS[2][1]).result(timeout=120).metrics
        assert metrics["learning_rate:mean"] == pytest.approx(oracle.step(data[2], STEPS[2][1]))
        assert metrics["step:max"] == 3
        check_adapter(adapter_of(Path(resumed.save_state("dimuon-three").result(timeout=120).path)), oracle)
        # load_state_with_optimizer into a Dimuon client of the same adapter shape: the same third step.
        loaded = service_client.create_lora_training_client(NAME, rank=RANK, seed=99,
                                                             optimizer=types.DimuonOptimizerConfig()).result(timeout=120)
        loaded.load_state_with_optimizer(middle).result(timeout=120)
        loaded.forward_backward(data[2], "cross_entropy").result(timeout=120)
        loaded.optim_step(STEPS[2][1]).result(timeout=120)
        check_adapter(adapter_of(Path(loaded.save_state("dimuon-three").result(timeout=120).path)), oracle)
    finally:
        service_client.close()


def test_mistakes_are_user_errors_and_the_worker_keeps_serving(fleet: Fleet, model_dir: Path):
    sc = service(fleet)
    dimuon = sc.create_lora_training_client(NAME, rank=RANK, seed=7, optimizer=tinker.DimuonOptimizerConfig()).result(
        timeout=120)
    adamw = sc.create_lora_training_client(NAME, rank=RANK, seed=8).result(timeout=120)
    oracle = Oracle(model_dir, directory_of(fleet, dimuon.save_state("init").result(timeout=120).path))
    data = batches()
    dimuon.forward_backward(sdk_batch(data[0]), "cross_entropy").result(timeout=120)
    adamw.forward_backward(sdk_batch(data[0]), "cross_entropy").result(timeout=120)
    refused = [  # (client, hyperparameters, what the one error says)
        (adamw, tinker.DimuonParams(learning_rate=1e-3),
         r"created with optimizer=AdamOptimizerConfig\(\) and steps with AdamParams, not DimuonParams"),
        (dimuon, tinker.AdamParams(**ADAM),
         r"created with optimizer=DimuonOptimizerConfig\(\) and steps with DimuonParams, not AdamParams"),
        (dimuon, OptimParamsBase(type="dimuon", learning_rate=1e-3, damping=0.0), "damping must be > 0"),
        (dimuon, OptimParamsBase(type="dimuon", learning_rate=1e-3, damping=-1e-4), "damping must be > 0"),
        (dimuon, OptimParamsBase(type="dimuon", learning_rate=-1e-3), "learning_rate must be >= 0"),
        (dimuon, OptimParamsBase(type="dimuon", learning_rate=1e-3, rank_lr_correction_exponent=-1.0),
         "rank_lr_correction_exponent must be >= 0"),
        (dimuon, OptimParamsBase(type="sgd", learning_rate=1e-3), "type 'sgd' are not served"),
    ]
    for client, hyper, message in refused:
        with pytest.raises(tinker.BadRequestError, match=message):
            client.optim_step(hyper).result(timeout=60)
    for config, message in [(OptimizerConfigBase(type="lion"), "optimizer type 'lion' is not served"),
                            (OptimizerConfigBase(type="dimuon", version=2), "Dimuon version 2 is not served")]:
        with pytest.raises(tinker.BadRequestError, match=message):
            sc.create_lora_training_client(NAME, rank=RANK, optimizer=config).result(timeout=60)
    # A Dimuon state into an AdamW client, with its optimizer: refused by the worker, naming both.
    state = dimuon.save_state("pending").result(timeout=120).path
    with pytest.raises(tinker.RequestFailedError, match=r"holds the state of the DimuonOptimizerConfig\(\) optimizer; "
                                                        r"this session trains with AdamOptimizerConfig\(\)") as failed:
        adamw.load_state_with_optimizer(state).result(timeout=60)
    assert failed.value.category == tinker.types.RequestErrorCategory.User
    # Every refused position was filled and nothing changed: the pending gradients make the reference's first step,
    # and the AdamW client still steps.
    metrics = dimuon.optim_step(STEPS[0][0]).result(timeout=120).metrics
    assert metrics["step:max"] == 1
    oracle.step(data[0], STEPS[0][1])
    final = dimuon.save_state("after").result(timeout=120).path
    found = adapter_of(directory_of(fleet, final))
    for n, w in oracle.ref.weights.items():
        np.testing.assert_allclose(found[n], w, rtol=0, atol=WEIGHT_ATOL, err_msg=n)
    assert adamw.optim_step(tinker.AdamParams(**ADAM)).result(timeout=120).metrics["step:max"] == 1


def test_the_producer_refuses_the_same_mistakes(fleet: Fleet):
    from tinkerq.producer import ServiceClient

    service_client = ServiceClient(broker_url=fleet.redis_url)
    try:
        for optimizer, message in [({"type": "lion"}, "optimizer type 'lion' is not served"),
                                   (OptimizerConfigBase(type="dimuon", version=2), "Dimuon version 2 is not served")]:
            with pytest.raises(errors.UserError, match=message):
                service_client.create_lora_training_client(NAME, rank=RANK, optimizer=optimizer)
        adamw = service_client.create_lora_training_client(NAME, rank=RANK, seed=8).result(timeout=120)
        dimuon = service_client.create_lora_training_client(NAME, rank=RANK, seed=7,
                                                            optimizer=tinker.DimuonOptimizerConfig()).result(timeout=120)
        with pytest.raises(errors.ValidationError, match="created with optimizer=AdamOptimizerConfig"):
            adamw.optim_step(types.DimuonParams(learning_rate=1e-3)).result(timeout=60)
        with pytest.raises(errors.ValidationError, match="damping must be > 0"):
            dimuon.optim_step(types.DimuonParams(learning_rate=1e-3, damping=0.0)).result(timeout=60)
        # The worker's own check, for a request that bypasses the producer's: its answer is the same user error.
        sent = adamw.submit("optim_step", messages.encode_optim(types.DimuonParams(learning_rate=1e-3)))
        with pytest.raises(errors.ValidationError, match="created with optimizer=AdamOptimizerConfig"):
            sent.result(timeout=60)
        sent = dimuon.submit("optim_step", messages.encode_optim(types.DimuonParams(learning_rate=1e-3, beta1=1.5)))
        with pytest.raises(errors.ValidationError, match=r"beta1 must be in \[0, 1\)"):
            sent.result(timeout=60)
        state = dimuon.save_state("dimuon-state").result(timeout=120).path
        with pytest.raises(errors.ValidationError, match="holds the state of the DimuonOptimizerConfig"):
            adamw.load_state_with_optimizer(state).result(timeout=60)
        # Still serving both.
        data = batches()[0]
        adamw.forward_backward(data, "cross_entropy").result(timeout=120)
        assert adamw.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120).metrics["step:max"] == 1
        dimuon.forward_backward(data, "cross_entropy").result(timeout=120)
        assert dimuon.optim_step(types.DimuonParams(learning_rate=1e-3)).result(timeout=120).metrics["step:max"] == 1
    finally:
        service_client.close()
