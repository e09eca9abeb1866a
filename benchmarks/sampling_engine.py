"""The continuous-batching TorchEngine vs one batched ``model.generate``, in process, same model and load.

Model: a ~5M-parameter Llama (random weights, fixed seed) saved with save_pretrained and loaded back with
from_pretrained, float32. Load: 64 prompts of 8-40 random tokens x 8 samples x 32 new tokens (no stop
token), temperature 1, no top-k / top-p. (a) ``model.generate`` of all 512 rows at once (left padding,
do_sample=True, max_new_tokens=min_new_tokens=32, top_k=0); (b) a TorchEngine with all 64 jobs submitted at
once (``--max-rows``, default 512 so it also holds every row), stepped on the calling thread until idle
(``run_until_idle``: the engine has no thread of its own). Runs alternate, the median is reported. The
engine does more than generate (per-row seeds, logprobs, per-job results) but prefills each distinct prompt
once, where generate prefills 512 padded rows; ``--distinct`` gives all 512 rows their own prompt (512 jobs
x 1 sample), so both prefill 512 prompts.

    .venv/bin/python benchmarks/sampling_engine.py [--threads 2] [--reps 3] [--max-rows 512] [--distinct]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _fleet import build_llama, machine, median, print_table
from transformers import AutoModelForCausalLM

from tinkerq import types
from tinkerq.worker.sampling import SampleJob, StopRule, TorchEngine

PROMPTS, SAMPLES, NEW_TOKENS = 64, 8, 32
LLAMA_5M: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
)


def run_generate(model: Any, prompts: list[list[int]], samples: int) -> float:
    width = max(map(len, prompts))
    rows = [p for p in prompts for _ in range(samples)]
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])  # (512, P) left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    assert out.shape == (len(rows), width + NEW_TOKENS)
    return elapsed


def run_engine(model: Any, prompts: list[list[int]], samples: int, max_rows: int, seed: int) -> float:
    no_stop = StopRule([], [], None)
    jobs = [SampleJob(model=model, model_key="bench", prompt=p, num_samples=samples,
                      params=types.SamplingParams(seed=seed + i, temperature=1.0), stop=no_stop,
                      max_tokens=NEW_TOKENS) for i, p in enumerate(prompts)]
    results: list[list[types.SampledSequence]] = []

    def collect(seqs: list[types.SampledSequence] | None, error: BaseException | None) -> None:
        if error is not None:
            raise error  # logged by the engine; the count below fails
        results.append(seqs or [])

    engine = TorchEngine(max_rows=max_rows)
    try:
        t0 = time.perf_counter()
        for job in jobs:
            job.on_done = collect
            engine.submit(job)
        engine.run_until_idle()
        elapsed = time.perf_counter() - t0
    finally:
        engine.close()
    assert len(results) == len(jobs) and all(len(s.tokens) == NEW_TOKENS for seqs in results for s in seqs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-rows", type=int, default=PROMPTS * SAMPLES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distinct", action="store_true", help="512 prompts x 1 sample instead of 64 x 8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    n_prompts, samples = (PROMPTS * SAMPLES, 1) if args.distinct else (PROMPTS, SAMPLES)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, LLAMA_5M["vocab_size"], size=int(rng.integers(8, 41))).tolist()
               for _ in range(n_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "llama-5m", seed=args.seed, **LLAMA_5M)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    run_generate(model, prompts[:2], samples)  # warm-up
    run_engine(model, prompts[:2], samples, args.max_rows, args.seed)
    gen_s, eng_s = [], []
    for rep in range(args.reps):
        gen_s.append(run_generate(model, prompts, samples))
        eng_s.append(run_engine(model, prompts, samples, args.max_rows, args.seed))
        print(f"  rep {rep}: generate {gen_s[-1]:.3f} s, engine {eng_s[-1]:.3f} s", flush=True)

    tokens = PROMPTS * SAMPLES * NEW_TOKENS
    print(f"sampling_engine: {n_params / 1e6:.2f}M-parameter Llama, {n_prompts} prompts (8-40 tokens) x {samples} "
          f"samples x {NEW_TOKENS} new tokens = {tokens} tokens, float32, {args.threads} torch threads, engine "
          f"max_rows={args.max_rows}; {args.reps} reps; {machine()}")
    rows = [(name, median(t), min(t), tokens / median(t)) for name, t in
            (("model.generate (one batch of 512 rows)", gen_s),
             (f"TorchEngine ({n_prompts} jobs submitted at once)", eng_s))]
    print_table(["path", "median s", "min s", "tokens/s"], rows)
    print(f"RATIO engine/generate time per token: median {median(eng_s) / median(gen_s):.3f}x, "
          f"min {min(eng_s) / min(gen_s):.3f}x")


if __name__ == "__main__":
    main()
