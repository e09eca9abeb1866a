"""The tenants' web console (gateway/console.py) in a real headless chromium, against a real gateway, worker and Redis.

A run trained by the official SDK through the gateway; the SDK's own console link (tinkerq.sdk_console) opens it;
the browser signs in with the key typed into the form and shows the run's loss curve: the plotted values are the
losses the SDK got, the first one equal to a plain torch forward of the base model (a fresh LoRA adds nothing).
A second tenant signed in sees none of it. Chromium is driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: JSON messages ending in NUL on fds 3 and 4), so no client library is needed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.conftest import start_named_worker
from tests.helpers import load_reference, make_batch, reference_loss
from tests.test_gateway import ADAM, NAME, post, result, sdk_batch
from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, wait_for
from tinkerq.quotas import Limits
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.timeout(420)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "console.png"


@pytest.fixture(scope="module")
def gateway_url(model_dir: Path, redis_url: str, checkpoint_dir: Path, tmp_path_factory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("console-logs")
    env = {"TINKERQ_CHECKPOINT_DIR": str(checkpoint_dir)}  # the gateway reads exports there for download links
    worker = start_named_worker(model_dir, redis_url, NAME, logs / "worker.log", env=env)
    port = free_port()
    gateway = start_process(gateway_command(redis_url, port), logs / "gateway.log",
                            {**env, "TINKERQ_GATEWAY_POLL_S": "2"})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: gateway_up(url), 60, "tinkerq gateway", gateway, logs / "gateway.log")
    yield url
    for proc in (gateway, worker):
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def api_keys(redis_url: str) -> Iterator[dict[str, str]]:
    keys = ApiKeys.open(Settings(broker_url=redis_url))
    yield {tenant: keys.create(f"{tenant}-console-{uuid.uuid4().hex[:6]}") for tenant in ("alice", "bob")}
    keys.close()


@pytest.fixture(scope="module")
def trained(gateway_url: str, api_keys: dict[str, str], model_dir: Path) -> dict[str, Any]:
    """Alice's LoRA run: four forward_backward + optim_step on one batch through the SDK, a save_state and an
    export (save_weights_external)."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(base_url=gateway_url, api_key=api_keys["alice"])
    tc = service.create_lora_training_client(NAME, rank=4, seed=7).result(timeout=120)
    rng = np.random.default_rng(11)
    batches = [make_batch(rng, 3, max_len=20)] * 4  # one batch, learnt: a loss curve that goes down
    losses = []
    for batch in batches:
        losses.append(tc.forward_backward(sdk_batch(batch), "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(tinker.AdamParams(**ADAM)).result()
    saved = tc.save_state("console-ckpt").result().path
    exported = tc.save_weights_external("console-export").result(timeout=120).path
    base = float(reference_loss(load_reference(model_dir), batches[0]).detach())
    return {"service": service, "tc": tc, "losses": losses, "saved": saved, "exported": exported, "base_loss": base}


def test_console_json_is_per_key(gateway_url, api_keys, trained, monkeypatch):
    from tinkerq.sdk_console import use_gateway_console

    run_id = trained["tc"].model_id
    _restore_sdk_console(monkeypatch)
    use_gateway_console(gateway_url)
    session_link = trained["service"].get_console_url()
    assert session_link.startswith(f"{gateway_url}/console/sessions/")
    assert trained["tc"].get_console_url() == f"{gateway_url}/console/training_runs/{run_id}"
    assert session_link.rsplit("/", 1)[1] == run_id.split(":")[0]  # the run's session

    def get(path: str, key: str | None) -> requests.Response:
        return requests.get(f"{gateway_url}{path}", headers={} if key is None else {"X-API-Key": key}, timeout=30)

    page = get("/console", None)  # the page itself is public; every number on it comes from keyed JSON
    assert page.status_code == 200 and "sign-in" in page.text and "script-src 'self'" in page.headers[
        "content-security-policy"]
    assert get(f"/console/training_runs/{run_id}", None).text == page.text  # every view is the same page
    assert requests.get(session_link, timeout=30).text == page.text
    assert get("/console/static/console.py", None).status_code == 404  # only the page's own two files
    assert get("/console/static/..%2Fconsole.py", None).text == page.text  # a path is a view name, never a file
    assert get("/api/v1/console/overview", None).status_code == 401

    alice = get("/api/v1/console/overview", api_keys["alice"]).json()
    assert [r["training_run_id"] for r in alice["training_runs"]] == [run_id] and alice["training_runs_total"] == 1
    assert alice["quota"]["in_use"]["max_training_clients"] == 1 and alice["usage"]["totals"]["training_tokens"] > 0
    assert alice["storage"]["checkpoints"] == 2 and alice["queue"]["waiting"] == 0
    assert {"base_model": NAME, "role": "trainer", "count": 1} in alice["queue"]["workers"]
    points = get(f"/api/v1/console/training_runs/{run_id}/metrics", api_keys["alice"]).json()["points"]
    assert [p["metrics"]["loss:sum"] for p in points if p["op"] == "forward_backward"] == trained["losses"]
    assert [p["op"] for p in points] == ["forward_backward", "optim_step"] * 4

    bob = get("/api/v1/console/overview", api_keys["bob"]).json()
    assert bob["training_runs"] == [] and bob["sessions"] == [] and bob["storage"]["checkpoints"] == 0
    assert get(f"/api/v1/console/training_runs/{run_id}/metrics", api_keys["bob"]).status_code == 404


def test_console_queue_shows_a_create_the_quota_holds(gateway_url, redis_url, trained):
    """Carol may hold one training client: her second create waits, and the console's queue and quota say so (the
    state and reason her SDK's polls get); it leaves the queue once her first run is unloaded."""
    keys = ApiKeys.open(Settings(broker_url=redis_url))
    key = keys.create(f"carol-console-{uuid.uuid4().hex[:6]}", Limits(max_training_clients=1))
    keys.close()

    def overview() -> dict:
        return requests.get(f"{gateway_url}/api/v1/console/overview", headers={"X-API-Key": key}, timeout=30).json()

    session = post(gateway_url, "create_session", key, {}).json()["session_id"]

    def create(n: int) -> str:
        return post(gateway_url, "create_model", key, {"session_id": session, "model_seq_id": n, "base_model": NAME,
                                                       "lora_config": {"rank": 2, "seed": n}}).json()["request_id"]

    first = result(gateway_url, key, create(0)).json()["model_id"]
    second = create(1)
    deadline = time.monotonic() + 30
    while (seen := overview())["queue"]["by_state"] != {"paused_rate_limit": 1}:
        assert time.monotonic() < deadline, seen["queue"]
        time.sleep(0.5)
    held = seen["queue"]["oldest"][0]
    assert held["request_id"] == second and held["kind"] == "CreateModel" and "max_training_clients" in held["reason"]
    polled = post(gateway_url, "retrieve_future", key, {"request_id": second, "allow_metadata_only": False}).json()
    assert (polled["queue_state"], polled["queue_state_reason"]) == (held["state"], held["reason"])
    assert seen["quota"] == {"limits": {"max_training_clients": 1, "max_sampling_inflight": None,
                                        "max_tokens_per_minute": None, "keep_checkpoints": None},
                             "in_use": {"max_training_clients": 1, "max_sampling_inflight": 0}}
    assert [r["training_run_id"] for r in seen["training_runs"]] == [first]  # none of Alice's

    result(gateway_url, key, post(gateway_url, "unload_model", key, {"model_id": first}).json()["request_id"])
    made = result(gateway_url, key, second).json()["model_id"]
    assert overview()["queue"]["waiting"] == 0
    result(gateway_url, key, post(gateway_url, "unload_model", key, {"model_id": made}).json()["request_id"])


def _restore_sdk_console(monkeypatch) -> None:
    """use_gateway_console sets a constant of the SDK for the whole process: put it back after the test."""
    from tinker.lib import console_urls

    monkeypatch.setattr(console_urls, "_CONSOLE_BASE_URL", console_urls._CONSOLE_BASE_URL)


def test_use_gateway_console_needs_the_gateways_url(monkeypatch):
    from tinkerq.errors import ValidationError
    from tinkerq.sdk_console import use_gateway_console

    _restore_sdk_console(monkeypatch)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    with pytest.raises(ValidationError, match="TINKER_BASE_URL"):
        use_gateway_console()
    monkeypatch.setenv("TINKER_BASE_URL", "http://gw.example:8000/")
    assert use_gateway_console() == "http://gw.example:8000/console"
    assert tinker.types.SaveWeightsResponse(path="tinker://r1/weights/a").get_console_url() == \
        "http://gw.example:8000/console/checkpoints/r1/weights%2Fa"  # the page decodes it (route() in console.js)


class Chromium:
    """Headless chromium driven over the DevTools protocol on a pipe: one page, JS evaluated in it."""

    def __init__(self, profile: Path) -> None:
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1280,1000", "--remote-debugging-pipe", "about:blank"]
        # chromium reads commands on fd 3 and writes on fd 4
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome} 4>&{from_chrome}', CHROMIUM,
                                      *flags], pass_fds=(to_chrome, from_chrome), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._replies: dict[int, dict] = {}
        self._ready = threading.Condition()
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t["targetId"] for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page, flatten=True)["sessionId"]

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._in, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self._ready:
                        self._replies[message["id"]] = message
                        self._ready.notify_all()

    def call(self, method: str, session: str | None = None, **params: Any) -> dict:
        self._next += 1
        ident = self._next
        message = {"id": ident, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._out, json.dumps(message).encode() + b"\0")
        with self._ready:
            assert self._ready.wait_for(lambda: ident in self._replies, timeout=60), f"no reply to {method}"
            reply = self._replies.pop(ident)
        assert "error" not in reply, reply
        return reply["result"]

    def page(self, method: str, **params: Any) -> dict:
        return self.call(method, self.session, **params)

    def js(self, expression: str) -> Any:
        out = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in out, out
        return out["result"].get("value")

    def wait_js(self, expression: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.js(expression)
            except AssertionError:  # evaluated while a page was being replaced: ask the next one
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.2)

    def sign_in(self, key: str) -> None:
        """Type ``key`` into the form and submit it, as a user does."""
        self.wait_js("document.readyState === 'complete' && !document.getElementById('sign-in').hidden")
        self.js("document.getElementById('api-key').focus()")
        self.page("Input.insertText", text=key)
        self.js("document.querySelector('#sign-in button').click()")
        self.wait_js("document.body.dataset.tenant")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        os.close(self._out)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (scripts/test installs it)")
def test_console_in_headless_chromium(gateway_url, api_keys, trained, tmp_path, monkeypatch):
    from tinkerq.sdk_console import use_gateway_console

    _restore_sdk_console(monkeypatch)

    tc = trained["tc"]
    assert use_gateway_console(gateway_url) == f"{gateway_url}/console"
    link = tc.get_console_url()
    assert link == f"{gateway_url}/console/training_runs/{tc.model_id}"

    browser = Chromium(tmp_path / "profile")
    try:
        browser.page("Page.navigate", url=link)
        browser.sign_in(api_keys["alice"])
        run = f'document.querySelector(\'details[data-run-id="{tc.model_id}"]\')'
        browser.wait_js(f"{run} && {run}.open && {run}.dataset.ready")
        chart = f"{run}.querySelector('svg[data-series=\"forward_backward loss:sum\"]')"
        plotted = json.loads(browser.js(f"{chart}.dataset.values"))
        assert plotted == trained["losses"] and plotted[-1] < plotted[0]  # the SDK's own numbers, as JSON carries
        assert plotted[0] == pytest.approx(trained["base_loss"], rel=1e-4)  # and the first is a plain torch forward
        assert len(browser.js(f"{chart}.querySelector('polyline').getAttribute('points')").split()) == 4
        points = requests.get(f"{gateway_url}/api/v1/console/training_runs/{tc.model_id}/metrics", timeout=30,
                              headers={"X-API-Key": api_keys["alice"]}).json()["points"]
        series = sorted({f"{p['op']} {name}" for p in points for name in p["metrics"]})
        assert sorted(browser.js(f"[...{run}.querySelectorAll('svg.chart')].map(c => c.dataset.series)")) == series
        rows = browser.js(f"[...{run}.querySelectorAll('tr[data-checkpoint]')].map(r => r.dataset.checkpoint)")
        assert sorted(rows) == sorted([trained["saved"], trained["exported"]])
        # The key is in this tab's sessionStorage, nowhere else the page could leak it.
        assert browser.js("sessionStorage.getItem('tinkerq-console-key')") == api_keys["alice"]
        assert browser.js("document.cookie") == "" and api_keys["alice"] not in browser.js("location.href")

        size = browser.page("Page.getLayoutMetrics")["cssContentSize"]  # the whole page, not the scrolled view
        shot = browser.page("Page.captureScreenshot", format="png", captureBeyondViewport=True, clip={
            "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})["data"]
        png = tmp_path / "console.png"
        png.write_bytes(base64.b64decode(shot))
        assert png.read_bytes()[:4] == b"\x89PNG"
        if not SCREENSHOT.exists():  # docs/gateway.md's screenshot; refreshed by deleting it and running this test
            shutil.copy(png, SCREENSHOT)

        # The checkpoint actions, by their buttons: download links (signed, no key), publish, delete.
        def button(path: str, action: str) -> str:
            return f"{run}.querySelector('tr[data-checkpoint=\"{path}\"] button[data-action=\"{action}\"]')"

        def checkpoints() -> dict[str, dict]:
            listed = requests.get(f"{gateway_url}/api/v1/training_runs/{tc.model_id}/checkpoints", timeout=30,
                                  headers={"X-API-Key": api_keys["alice"]}).json()["checkpoints"]
            return {c["tinker_path"]: c for c in listed}

        assert browser.js(f"{button(trained['saved'], 'download')}.disabled")  # only exported weights have links
        browser.js(f"{button(trained['exported'], 'download')}.click()")
        notice = browser.wait_js("document.getElementById('notice').textContent")
        files = dict(browser.js("[...document.querySelectorAll('#notice a')].map(a => [a.textContent.trim(), a.href])"))
        assert notice.startswith(f"Signed links for {trained['exported']}"), notice
        assert "adapter_config.json" in files and all(api_keys["alice"] not in url for url in files.values())
        config = requests.get(files["adapter_config.json"], timeout=30)  # no key: the signature is the grant
        assert config.status_code == 200 and config.json()["r"] == 4  # the run's LoRA rank

        if browser.js("Boolean(document.querySelector('button[data-action=\"publish\"]:not([disabled])'))"):
            browser.js(f"{button(trained['saved'], 'publish')}.click()")
            browser.wait_js("document.getElementById('notice').textContent.includes('readable by every API key')")
            assert checkpoints()[trained["saved"]]["public"] is True
            browser.wait_js(f"{run} && {run}.dataset.ready")
            browser.js(f"{button(trained['saved'], 'unpublish')}.click()")
            browser.wait_js("document.getElementById('notice').textContent.includes('private again')")
            assert checkpoints()[trained["saved"]]["public"] is False
        else:  # a gateway without the route: the button says so rather than failing
            assert "publish" in browser.js(f"{run}.querySelector('.note').textContent")
        browser.wait_js(f"{run} && {run}.dataset.ready")
        browser.js(f"{button(trained['saved'], 'delete')}.click()")  # armed: nothing deleted yet
        assert trained["saved"] in checkpoints()
        browser.js(f"{button(trained['saved'], 'delete')}.click()")
        browser.wait_js("document.getElementById('notice').textContent.endsWith('deleted')")
        assert trained["saved"] not in checkpoints() and trained["exported"] in checkpoints()

        # The SDK's link to a checkpoint opens its run (still signed in: the tab keeps its sessionStorage).
        browser.js("window.before = true")  # gone once the new page is loaded
        browser.page("Page.navigate", url=tinker.types.SaveWeightsResponse(path=trained["exported"]).get_console_url())
        browser.wait_js(f"!window.before && {run} && {run}.classList.contains('selected') && {run}.dataset.ready")
        assert browser.js("location.pathname").startswith("/console/checkpoints/")
        browser.js("window.before = true")
        browser.page("Page.navigate", url=trained["service"].get_console_url())  # the session's link
        session = tc.model_id.split(":")[0]
        row = f"document.querySelector('tr.selected[data-session-id=\"{session}\"]')"
        browser.wait_js(f"!window.before && {row} !== null")

        # Bob, in the same tab after signing out, on the link to Alice's run: nothing of hers.
        browser.js("document.getElementById('sign-out').click()")
        assert browser.js("document.getElementById('console').textContent.includes('train:')") is False
        assert browser.js("sessionStorage.length") == 0
        browser.sign_in(api_keys["bob"])
        browser.wait_js("document.querySelector('#runs .body p') !== null")
        assert browser.js("document.querySelector('#runs .body').textContent") == "No training runs yet."
        text = browser.js("document.body.innerText")
        assert tc.model_id.split(":")[0] not in text  # no run, session or checkpoint of hers
        assert browser.js("document.querySelectorAll('svg[data-series^=\"forward_backward\"]').length") == 0

        # `tinker auth`'s link to make a key: the console says who makes keys here.
        from tinker.lib.console_urls import new_api_key_console_url

        browser.page("Page.navigate", url=new_api_key_console_url("laptop"))
        browser.wait_js("document.getElementById('page-note').textContent.includes('tinkerq keys create')")
    finally:
        browser.close()
