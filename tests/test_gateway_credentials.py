"""The gateway's credential check on the event loop (gateway/auth.py ``Credentials.cached_tenant``): it answers
only from what this process already checked, never more than the full check (``Credentials.tenant``) would
accept, and leaves every other case, refusals included, to the full check."""

from __future__ import annotations

import pytest

from tinkerq.gateway.auth import Credentials, Refused
from tinkerq.gateway.signing import Signer
from tinkerq.store import MemoryStore
from tinkerq.tenants import ApiKeys

pytestmark = pytest.mark.timeout(30)


def _credentials(cache_s: float = 60.0) -> tuple[Credentials, ApiKeys]:
    store = MemoryStore()
    keys = ApiKeys(store, cache_s=cache_s)
    return Credentials(keys, Signer(store), cache_s=cache_s), keys


def test_a_key_or_token_is_answered_from_the_caches_once_fully_checked():
    creds, keys = _credentials()
    key = keys.create("alice")
    assert creds.cached_tenant(key) is None  # never checked here: the full check decides
    assert creds.tenant(key) == "alice"
    assert creds.cached_tenant(key) == "alice"
    token = creds.mint("alice")  # reads the secret and the live key: both cached now
    assert creds.cached_tenant(token) == creds.tenant(token) == "alice"


def test_without_a_cache_nothing_is_answered_on_the_loop():
    creds, keys = _credentials(cache_s=0.0)
    key = keys.create("bob")
    assert creds.tenant(key) == "bob" and creds.cached_tenant(key) is None


@pytest.mark.parametrize("header", [None, "", "tml-nope", "eyJnot.a.token", "x" * 5000])
def test_what_the_full_check_refuses_is_left_to_it(header):
    creds, keys = _credentials()
    creds.tenant(keys.create("carol"))
    assert creds.cached_tenant(header) is None
    with pytest.raises(Refused):
        creds.tenant(header)


def test_a_forged_token_or_one_of_a_replaced_key_is_left_to_the_full_check():
    creds, keys = _credentials()
    keys.create("dave")
    token = creds.mint("dave")
    head, body, signature = token.split(".")
    forged = f"{head}.{body}.{signature[:-2]}{'AA' if signature[-2:] != 'AA' else 'BB'}"
    assert creds.cached_tenant(forged) is None
    with pytest.raises(Refused, match="token refused"):
        creds.tenant(forged)
    # The key it was exchanged for is no longer the tenant's live one (as this process last read it).
    creds._live["dave"] = ("another-key-id", float("inf"))
    assert creds.cached_tenant(token) is None
    with pytest.raises(Refused, match="revoked"):
        creds.tenant(token)
