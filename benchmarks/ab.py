"""A/B in one run: a benchmark script of this tree and the same script of an earlier commit, alternately.

    .venv/bin/python benchmarks/ab.py REV SCRIPT [--pairs 3] -- [SCRIPT'S ARGS...]

The earlier side runs commit REV's own ``benchmarks/SCRIPT`` with REV's tinkerq, producer and worker alike
(benchmarks/_baseline.py), in this venv, so only tinkerq's code differs. Pairs alternate their order (odd pairs:
REV first), so a drift of a shared machine's load hits both sides alike. Each run's output is printed whole, with
the load average as it started; compare the rows the script prints.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _baseline import ROOT, baseline_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the earlier commit (the baseline)")
    parser.add_argument("script", help="a script of benchmarks/, e.g. transport.py")
    parser.add_argument("--pairs", type=int, default=3)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, script_args = parser.parse_args(argv[:split]), argv[split + 1:]  # after --: the script's own arguments
    with tempfile.TemporaryDirectory() as tmp:
        env = baseline_env(args.rev, Path(tmp))
        sides = {
            "current": ([sys.executable, str(ROOT / "benchmarks" / args.script), *script_args], {}),
            args.rev: ([sys.executable, str(Path(tmp) / "source" / "benchmarks" / args.script), *script_args], env),
        }
        for pair in range(1, args.pairs + 1):
            order = [args.rev, "current"] if pair % 2 else ["current", args.rev]
            for side in order:
                cmd, extra = sides[side]
                print(f"=== pair {pair}: {side} (load average {os.getloadavg()[0]:.1f}) ===", flush=True)
                subprocess.run(cmd, env={**os.environ, **extra}, check=True)


if __name__ == "__main__":
    main()
