"""benchmarks/tenants.py runs end to end at a smoke size: its own Redis, a worker, two gateways behind `tinkerq proxy`,
SDK clients of two keys, a gateway killed (-9) and started again half-way. Checked: no call failed, every usage
counter the fleet recorded equals what the clients sent, every call kind ran. Nothing here looks at a timing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tinkerq.launcher.processes import ROOT

pytest.importorskip("tinker")
pytestmark = pytest.mark.timeout(180)


def test_two_keys_through_two_gateways_with_a_restart():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tenants.py"), "--keys", "2", "--clients", "2",
                          "--duration", "6", "--workers", "1", "--rss-every", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    text = out.stdout
    assert out.returncode == 0, text[-4000:] + out.stderr[-3000:]
    assert "RESULT OK: 0 errors, 0 usage counters differ" in text, text[-4000:]
    assert "restarting gateway 2 (KILL)" in text and "serves again" in text, text[-4000:]
    usage = text.split("usage per key:")[1]
    for key in ("tenant-0", "tenant-1"):
        for counter in ("training_tokens", "prefill_tokens", "sampled_tokens", "checkpoints"):
            line = next(line for line in usage.splitlines() if line.split()[:2] == [key, counter])
            assert line.split()[-1] == "equal", line
    assert "NOT EQUAL" not in text
    latency = text.split("latency per call kind")[1].split("\n\n")[0]
    ran = {line.split()[0]: int(line.split()[1]) for line in latency.splitlines()[3:] if line.strip()}
    for kind in ("create_lora_training_client", "forward_backward", "optim_step", "forward",
                 "save_weights_and_get_sampling_client", "sample"):
        assert ran.get(kind, 0) > 0, latency
