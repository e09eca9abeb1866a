"""How often the `tinker` command dies as it exits, on each of the SDK's HTTP transports.

The SDK (tinker 0.38.0) talks HTTP through pyqwest (Rust reqwest on tokio) unless the server's ``client/config``
says ``use_pyqwest_transport: false`` (then httpx). With pyqwest 0.12, a process can die of SIGABRT as the
interpreter finalises (docs/gateway.md#the-sdks-http-transport). This starts a private redis-server and one
``tinkerq gateway`` per transport (``TINKERQ_GATEWAY_SDK_PYQWEST`` 0 and 1; no worker: the command asks the
gateway only), runs ``tinker -f json billing usage`` ``--runs`` times against each, alternating, and counts exit
statuses. ``--busy N`` starts N busy-looping processes beside it, as a loaded machine.

    .venv/bin/python benchmarks/sdk_exit.py [--runs 150] [--busy 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _fleet import machine

from tinkerq.launcher.processes import free_port, gateway_command, gateway_up, start_process, start_redis, wait_for
from tinkerq.settings import Settings
from tinkerq.tenants import ApiKeys

COMMAND = ["-f", "json", "billing", "usage", "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=150, help="`tinker` commands per transport")
    parser.add_argument("--busy", type=int, default=3, help="busy-looping processes beside the runs")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tinkerq-sdk-exit-"))
    port = free_port()
    procs = [start_redis(port, work / "redis")]
    broker = f"redis://127.0.0.1:{port}/0"
    urls = {}
    try:
        for transport, flag in (("httpx", "0"), ("pyqwest", "1")):
            gw_port = free_port()
            log = work / f"gateway-{transport}.log"
            gateway = start_process(gateway_command(broker, gw_port), log, {"TINKERQ_GATEWAY_SDK_PYQWEST": flag})
            procs.append(gateway)
            urls[transport] = f"http://127.0.0.1:{gw_port}"
            wait_for(lambda u=urls[transport]: gateway_up(u), 60, "tinkerq gateway", gateway, log)
        keys = ApiKeys.open(Settings(broker_url=broker))
        key = keys.create("sdk-exit")
        keys.close()
        procs += [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]

        tinker = Path(sys.executable).with_name("tinker")
        codes: dict[str, collections.Counter] = {t: collections.Counter() for t in urls}
        for i in range(args.runs):
            for transport, url in urls.items():
                env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
                done = subprocess.run([str(tinker), *COMMAND], capture_output=True, text=True, env=env, timeout=120)
                codes[transport][done.returncode] += 1
                if done.returncode != 0:
                    print(f"run {i} on {transport}: exit status {done.returncode}", flush=True)
        print(f"{machine()}; {args.busy} busy processes beside; `tinker {' '.join(COMMAND)}`")
        for transport, counted in codes.items():
            failed = sum(n for code, n in counted.items() if code != 0)
            print(f"{transport:8s} {failed} of {args.runs} runs failed; exit statuses {dict(sorted(counted.items()))}")
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
