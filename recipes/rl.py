"""``tinkerq rl``: reinforcement learning through the fleet on a task with a checkable reward.

The demo model is first SFT-warmed for a few steps on string reversal. RL then teaches it a rule the SFT
data never showed — answer with only the first three letters of the reversed string — from a reward
alone. Each RL iteration follows the Tinker cookbook loop:

1. ``sampler = tc.save_weights_and_get_sampling_client().result()`` freezes the current weights;
2. ``group_size`` completions are sampled per prompt, with their per-token logprobs;
3. reward = fraction of the rule's answer reproduced (position by position, a wrong length costs),
   advantage = reward minus the group's mean reward;
4. datums ``target=[prompt..., sampled...]``, ``logprobs=[0]*prompt + sampled_logprobs``,
   ``advantages=[0]*prompt + [adv]*sampled`` go to ``forward_backward(..., "importance_sampling")``
   (or ``ppo``), then ``optim_step``.

Outputs in the run directory: ``metrics.jsonl``, ``reward.png``, ``summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from typing import Any

from tqdm import tqdm

from tinkerq import types
from tinkerq.producer import TrainingClient
from tinkerq.recipes.sft_args import LORA_LR_HELP, add_lora_argument, non_negative_int, positive_float, positive_int

# Also the default of a LoRA run (see sft_args.LORA_LR_HELP): measured on the demo, `tinkerq rl --lora-rank 8
# --lr X`, mean sampled reward of the first -> last 10 iterations: 2e-4 0.08 -> 0.19, 5e-4 0.08 -> 0.27,
# 1e-3 0.08 -> 0.30, 2e-3 0.07 -> 0.02 (collapses), 5e-3 (10x) 0.02 -> 0.00.
DEFAULT_RL_LR = 5e-4


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", help="redis:// URL of a running fleet (default: an embedded fleet in this process)")
    p.add_argument("--model", help="model directory a worker serves (default: the demo model, built once)")
    p.add_argument("--warmup-steps", type=non_negative_int, default=80, help="SFT steps before RL, 0 for none "
                                                                             "(default 80)")
    p.add_argument("--iterations", type=positive_int, default=200, help="RL iterations (default 200)")
    p.add_argument("--prompts", type=positive_int, default=16, help="prompts per iteration (default 16)")
    p.add_argument("--group-size", type=positive_int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--lr", type=positive_float, default=DEFAULT_RL_LR,
                   help=f"AdamW learning rate for RL (default {DEFAULT_RL_LR:g}; {LORA_LR_HELP})")
    add_lora_argument(p)
    p.add_argument("--loss-fn", choices=["importance_sampling", "ppo", "cispo"], default="importance_sampling",
                   help="the RL loss forward_backward computes (default importance_sampling; ppo and cispo clip "
                        "the importance ratio)")
    p.add_argument("--updates-per-batch", type=positive_int, default=1,
                   help="optimizer steps on each sampled batch; after the first the data is off-policy, which "
                        "the importance ratio corrects and ppo/cispo clip (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the batches, the samples and a LoRA adapter's start (default 0)")
    p.add_argument("--out", help="run directory (default: runs/rl-<time>)")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads of the embedded worker (default: torch's)")


TARGET_LETTERS = 3


def rule_target(prompt: str) -> str:
    """The rule RL teaches: the first three letters of the reversed string ("abcdef>" -> "fed").

    The SFT data always asks for the whole reversal, so the warm model must learn to stop early on longer
    strings; on strings of three letters the two rules agree.
    """
    return prompt.rstrip(">")[::-1][:TARGET_LETTERS]


def reward(prompt: str, completion: str) -> float:
    """Matching positions against the rule's answer, over the longer of the two lengths (in [0, 1])."""
    target = rule_target(prompt)
    if not completion:
        return 0.0
    return sum(a == b for a, b in zip(completion, target, strict=False)) / max(len(target), len(completion))


def rl_datums(prompt_tokens: list[int], samples: list[types.SampledSequence],
              advantages: list[float], scale: float) -> list[types.Datum]:
    """Cookbook-style RL datums: zero logprobs and advantages on the prompt, sampled ones after it."""
    datums = []
    for seq, adv in zip(samples, advantages, strict=True):
        if adv == 0.0 or not seq.tokens:
            continue  # no signal: nothing to learn from this sample
        full = prompt_tokens + seq.tokens
        n_prompt = len(prompt_tokens) - 1  # input positions whose targets are prompt tokens
        datums.append(types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": full[1:],
                "logprobs": [0.0] * n_prompt + list(seq.logprobs or []),
                "advantages": [0.0] * n_prompt + [adv * scale] * len(seq.tokens),
            },
        ))
    return datums


def evaluate(tc: TrainingClient, tokenizer: Any, pairs: list[dict[str, str]]) -> tuple[float, float]:
    """Greedy mean reward and exact-match rate on held-out prompts, sampled through the fleet."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[tokenizer.eos_token_id])
    futures = [(p, sampler.sample(_prompt(tokenizer, p["prompt"]), 1, params)) for p in pairs]
    rewards, exact = [], 0
    for p, f in futures:
        text = _decode(tokenizer, f.result(timeout=600).sequences[0])
        rewards.append(reward(p["prompt"], text))
        exact += text == rule_target(p["prompt"])
    return sum(rewards) / len(rewards), exact / len(pairs)


def _prompt(tokenizer: Any, prompt: str) -> types.ModelInput:
    return types.ModelInput.from_ints([tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)])


def _decode(tokenizer: Any, seq: types.SampledSequence) -> str:
    tokens = seq.tokens[:-1] if seq.stop_reason == "stop" else seq.tokens
    return tokenizer.decode(tokens, skip_special_tokens=True)


def main(args: argparse.Namespace) -> int:
    from tinkerq.recipes import demo_model
    from tinkerq.recipes.plotting import plot_metrics
    from tinkerq.recipes.sft import (
        DATA_DIR,
        check_sample_size,
        load_pairs,
        load_tokenizer,
        make_datums,
        model_directory,
        open_fleet,
        open_training_client,
        run_directory,
    )
    from tinkerq.settings import Settings

    # Every mistake in the command line is found here, before the model is built or the fleet started.
    settings = Settings.from_env(broker_url=args.broker)
    train = load_pairs(DATA_DIR / "train.jsonl")
    heldout = load_pairs(DATA_DIR / "eval.jsonl")[:50]
    check_sample_size(args.prompts, "--prompts", train, "the bundled training set")
    model_dir = model_directory(args.model)
    tokenizer = load_tokenizer(model_dir)
    out_dir = run_directory(args.out, "rl")  # last: a mistake found above leaves no empty run directory
    rng = random.Random(args.seed)
    sample_params = types.SamplingParams(max_tokens=10, temperature=1.0, stop=[tokenizer.eos_token_id])
    lora_rank = getattr(args, "lora_rank", None)
    rl_lr = args.lr
    warmup_lr = demo_model.DEFAULT_LR  # tinkerq sft's default peak

    with open_fleet(settings, model_dir, args.threads) as sc:
        tc = open_training_client(sc, model_dir, lora_rank, args.seed)
        lora_info = tc.get_info().extra.get("lora") if lora_rank is not None else None
        print(f"RL learning rate {rl_lr:g} (SFT warm-up peak {warmup_lr:g})")
        for step in tqdm(range(args.warmup_steps), desc="sft warm-up", unit="step"):
            lr = demo_model.lr_at_step(step, args.warmup_steps, warmup_lr)
            tc.forward_backward(make_datums(tokenizer, rng.sample(train, demo_model.DEFAULT_BATCH_SIZE)))
            tc.optim_step(types.AdamParams(learning_rate=lr, eps=1e-8))
        before = evaluate(tc, tokenizer, heldout)
        print(f"after SFT warm-up: held-out greedy reward {before[0]:.3f}, exact match {100 * before[1]:.0f}%")

        metrics_path = out_dir / "metrics.jsonl"
        totals: dict[str, float] = {}
        started = time.perf_counter()
        with open(metrics_path, "w") as log, tqdm(total=args.iterations, desc="rl", unit="iter") as bar:
            for it in range(args.iterations):
                t_start = time.perf_counter()
                sampler = tc.save_weights_and_get_sampling_client().result()
                t_snapshot = time.perf_counter()
                batch = rng.sample(train, args.prompts)
                prompts = [_prompt(tokenizer, p["prompt"]) for p in batch]
                # Seeded from --seed: the same command samples the same completions (on the same hardware).
                futures = [sampler.sample(m, args.group_size, dataclasses.replace(sample_params,
                                                                                  seed=rng.randrange(2**31)))
                           for m in prompts]
                datums, rewards = [], []
                groups = []
                for pair, prompt, fut in zip(batch, prompts, futures, strict=True):
                    seqs = fut.result(timeout=600).sequences
                    group = [reward(pair["prompt"], _decode(tokenizer, s)) for s in seqs]
                    mean = sum(group) / len(group)
                    groups.append((prompt.to_ints(), seqs, [r - mean for r in group]))
                    rewards.extend(group)
                t_sampled = time.perf_counter()
                n_tokens = sum(len(s.tokens) for _, seqs, _ in groups for s in seqs)
                for prompt_tokens, seqs, advs in groups:
                    # Normalising is the client's job: advantages scaled so the loss is a per-token mean.
                    datums.extend(rl_datums(prompt_tokens, seqs, advs, 1.0 / n_tokens))
                row: dict[str, Any] = {"iteration": it + 1, "reward": sum(rewards) / len(rewards),
                                       "datums": len(datums), "sampled_tokens": n_tokens}
                if datums:
                    steps = [(tc.forward_backward(datums, args.loss_fn),
                              tc.optim_step(types.AdamParams(learning_rate=rl_lr, eps=1e-8)))
                             for _ in range(args.updates_per_batch)]  # all submitted before waiting
                    out = steps[-1][0].result(timeout=600)  # the last update is the most off-policy
                    row.update({k.replace(":", "_"): v for k, v in out.metrics.items()})
                    row["grad_norm"] = steps[-1][1].result(timeout=600).metrics["grad_norm:mean"]
                t_end = time.perf_counter()
                # Where the iteration's time went: freezing the weights, sampling, training (and the client).
                timing = {"snapshot_s": t_snapshot - t_start, "sample_s": t_sampled - t_snapshot,
                          "train_s": t_end - t_sampled, "iteration_s": t_end - t_start}
                row.update({k: round(v, 4) for k, v in timing.items()})
                row["samples_per_s"] = round(args.prompts * args.group_size / timing["sample_s"], 1)
                row["sampled_tokens_per_s"] = round(n_tokens / timing["sample_s"], 1)
                for k, v in timing.items():
                    totals[k] = totals.get(k, 0.0) + v
                totals["samples"] = totals.get("samples", 0.0) + args.prompts * args.group_size
                row["elapsed_s"] = round(time.perf_counter() - started, 2)
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:.3f}", samples_s=f"{row['samples_per_s']:.0f}")
        rl_seconds = time.perf_counter() - started
        after = evaluate(tc, tokenizer, heldout)
        print(f"after RL: held-out greedy reward {after[0]:.3f}, exact match {100 * after[1]:.0f}%")
        tc.close()

    plot = plot_metrics(metrics_path, out_dir / "reward.png", keys=["reward"], x="iteration",
                        title=f"tinkerq rl ({args.loss_fn}): mean sampled reward", smooth=5)
    share = {k: round(totals.get(k, 0.0) / max(totals.get("iteration_s", 0.0), 1e-9), 3)
             for k in ("snapshot_s", "sample_s", "train_s")}
    samples_per_s = totals.get("samples", 0.0) / max(totals.get("sample_s", 0.0), 1e-9)
    summary = {"model": model_dir, "lora": lora_info, "learning_rate": rl_lr, "loss_fn": args.loss_fn,
               "iterations": args.iterations,
               "rl_seconds": round(rl_seconds, 1),
               "iteration_s": round(totals.get("iteration_s", 0.0) / max(args.iterations, 1), 3),
               "samples_per_s": round(samples_per_s, 1), "share": share,
               "heldout_before": {"reward": before[0], "exact_match": before[1]},
               "heldout_after": {"reward": after[0], "exact_match": after[1]},
               "metrics": str(metrics_path), "plot": str(plot)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.iterations} RL iterations in {rl_seconds:.0f} s ({summary['iteration_s']:.2f} s each): "
          f"{samples_per_s:.0f} samples/s while sampling; time share: sampling {100 * share['sample_s']:.0f}%, "
          f"training {100 * share['train_s']:.0f}%, snapshot {100 * share['snapshot_s']:.0f}%")
    print(f"metrics: {metrics_path}; curve: {plot}")
    return 0
