"""The SDK surface check itself (tests/sdk_coverage.py): it reads the installed SDK, and records what tests call."""

from __future__ import annotations

import pytest

from tests import sdk_coverage

tinker = pytest.importorskip("tinker")


def test_the_surface_is_read_from_the_installed_sdk():
    entries = sdk_coverage.surface()
    for expected in ("TrainingClient.forward_backward", "TrainingClient.forward_backward_async",
                     "RestClient.list_user_checkpoints", "ServiceClient.copy_weights", "SamplingClient.sample",
                     "loss:cross_entropy", "loss:stable_reinforce", "cli:checkpoint list", "cli:auth whoami",
                     "cli:checkpoint push-hf", "cli:version"):
        assert expected in entries
    assert len([e for e in entries if e.startswith("cli:")]) >= 19
    assert set(sdk_coverage.NEEDS_THE_HUB) <= entries and set(sdk_coverage.NOT_YET) <= entries


def test_a_call_from_a_test_is_recorded_and_the_sdks_own_calls_are_not():
    sdk_coverage._used_now.clear()
    # A public method called from here (a test): recorded under the client it was called on.
    assert tinker.SamplingClient.get_telemetry.__wrapped__  # wrapped, signature kept
    with pytest.raises(Exception):  # noqa: B017  (an instance that was never set up: the call itself fails)
        tinker.SamplingClient.get_base_model(object.__new__(tinker.SamplingClient))
    assert "SamplingClient.get_base_model" in sdk_coverage._used_now
    assert sdk_coverage.cli_entry(["-f", "json", "checkpoint", "list", "--run-id", "x"]) == "cli:checkpoint list"
    assert sdk_coverage.cli_entry(["version"]) == "cli:version"
    assert sdk_coverage.cli_entry(["nonsense"]) is None
