"""Generate the demo SFT data set: reverse a short lowercase string.

Each line of train.jsonl / eval.jsonl is ``{"prompt": "abcd>", "completion": "dcba"}``:
the prompt is 3-6 random lowercase letters followed by ``>``, the completion is those
letters reversed. A 1M-parameter Llama learns this from scratch in a few hundred
steps on a CPU, so an SFT demo visibly goes from 0% to high exact-match.

Deterministic (fixed seed, stdlib ``random`` only): rerunning rewrites identical files.
Eval prompts are drawn first and are excluded from train, so eval is truly held out.

    python recipes/data/make_data.py
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

SEED = 20240611
MIN_LEN, MAX_LEN = 3, 6
N_TRAIN, N_EVAL = 4000, 200
HERE = Path(__file__).resolve().parent


def make_pair(rng: random.Random) -> tuple[str, str]:
    """One (prompt, completion) pair."""
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
    return f"{word}>", word[::-1]


def make_splits(seed: int = SEED) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Return (train, eval) with distinct prompts and no eval prompt in train."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            prompt, completion = make_pair(rng)
            if prompt not in seen:  # dedupe within and across splits
                seen.add(prompt)
                out.append((prompt, completion))
        return out

    eval_pairs = draw(N_EVAL)
    return draw(N_TRAIN), eval_pairs


def write_jsonl(path: Path, pairs: list[tuple[str, str]]) -> None:
    """Write pairs as one JSON object per line."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for prompt, completion in pairs:
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def main() -> None:
    train, eval_pairs = make_splits()
    write_jsonl(HERE / "train.jsonl", train)
    write_jsonl(HERE / "eval.jsonl", eval_pairs)
    print(f"wrote {len(train)} train and {len(eval_pairs)} eval pairs to {HERE}")


if __name__ == "__main__":
    main()
