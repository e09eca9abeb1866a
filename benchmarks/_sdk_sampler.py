"""The official tinker SDK as a sampling client, driven over stdin/stdout by benchmarks/skyrl_side_by_side.py.

Runs in SkyRL's venv (benchmarks/skyrl_env.sh: tinker 0.25, the SDK release both servers speak), so it imports no
tinkerq. One JSON object per line in, one per line out:

* ``{"cmd": "open", "base_url": ..., "api_key": ..., "base_model": ..., "rank": 8}``: a rank-``rank`` LoRA training
  client on the base and a sampling client on its saved weights (the RL loop's path); answers ``{"ok": true}``;
* ``{"cmd": "sample", "prompts": [[ids...]...], "samples": S, "tokens": T, "seed": n}``: every prompt submitted before
  any is awaited (``samples`` per request, temperature 1, ``tokens`` new tokens at most); answers
  ``{"seconds": wall time from the first submit to the last answer, "tokens": tokens generated, "submitted": when
  the last submit returned, "answered": when each request's answer was in hand, in submission order}``;
* ``{"cmd": "close"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    sampler: Any = None
    service: Any = None
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "open":
            service = tinker.ServiceClient(base_url=msg["base_url"], api_key=msg["api_key"])
            tc = service.create_lora_training_client(msg["base_model"], rank=msg["rank"], seed=0)
            sampler = tc.save_weights_and_get_sampling_client()
            reply: dict[str, Any] = {"ok": True}
        elif msg["cmd"] == "sample":
            params = tinker.SamplingParams(max_tokens=msg["tokens"], temperature=1.0, seed=msg["seed"])
            t0 = time.perf_counter()
            futures = [sampler.sample(tinker.ModelInput.from_ints(p), msg["samples"], params)
                       for p in msg["prompts"]]
            submitted = time.perf_counter() - t0
            generated, answered = 0, []
            for f in futures:
                generated += sum(len(s.tokens) for s in f.result().sequences)
                answered.append(time.perf_counter() - t0)
            reply = {"seconds": answered[-1], "tokens": generated, "submitted": submitted, "answered": answered}
        else:
            break
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
