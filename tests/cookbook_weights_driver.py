"""Run tinker-cookbook's own weight tools on tinkerq's adapter archives (inside the cookbook's venv).

    <cookbook venv>/bin/python tests/cookbook_weights_driver.py JOBS.json

JOBS.json is a list of {"name", "base", "adapter", "merged", "peft"}: ``build_hf_model`` (the default "auto"
strategy) merges ``adapter`` into ``base`` at ``merged``; when ``peft`` is set, ``build_lora_adapter`` converts it
there. Prints one JSON line per job: {"name", "merged": "ok" | error, "peft": "ok" | error | null}.
"""

from __future__ import annotations

import json
import logging
import sys


def main() -> None:
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter

    logging.disable(logging.WARNING)
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        result = {"name": job["name"], "merged": None, "peft": None}
        try:
            build_hf_model(base_model=job["base"], adapter_path=job["adapter"], output_path=job["merged"],
                           dtype="float32")
            result["merged"] = "ok"
        except Exception as exc:  # reported to the test, which fails on it
            result["merged"] = f"{type(exc).__name__}: {exc}"
        if job.get("peft"):
            try:
                build_lora_adapter(base_model=job["base"], adapter_path=job["adapter"], output_path=job["peft"])
                result["peft"] = "ok"
            except Exception as exc:
                result["peft"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
