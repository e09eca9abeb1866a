"""Run tinker-cookbook's supervised or RL training loop for a few steps against a tinkerq gateway.

Works with tinker-cookbook 0.5.8 and 0.6.1, whose train.Config fields used here are the same (0.6.1 adds
rl Config.num_epochs, default 1). Runs inside .venv-cookbook or .venv-cookbook-061 (./scripts/cookbook-venv),
not the project venv: the cookbook pins other transformers/huggingface_hub versions. tests/test_cookbook.py
starts it as a subprocess with TINKER_API_KEY, HF_HOME (a fake hub cache holding the tiny 261-token tokenizer
under the repo id the cookbook maps meta-llama/Llama-3* to) and HF_HUB_OFFLINE=1.

It calls ``train.main`` with a chz Config directly: the recipe CLIs (sl_basic/rl_basic) ask interactively
when log_path exists and default to hub datasets. Data is local: a JSONL of conversations for SL
(FromConversationFileBuilder) and the in-memory arithmetic environment for RL.

    python tests/cookbook_driver.py --base-url URL --log-dir DIR --mode sl|rl [--model-name NAME]
        [--expect-version X.Y.Z]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import sys
from pathlib import Path

RENDERER = "role_colon"  # what the cookbook's model_info recommends for the base Llama-3.2 models


def write_conversations(path: Path, n: int = 8) -> Path:
    """n tiny user/assistant exchanges, one JSON object per line ({"messages": [...]})."""
    with open(path, "w") as f:
        for i in range(n):
            x, y = 3 * i + 1, 7 * i + 2
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {x} + {y}?"},
                                             {"role": "assistant", "content": str(x + y)}]}) + "\n")
    return path


def sl_config(args: argparse.Namespace, data: Path):
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model_name, renderer_name=RENDERER, max_length=128, batch_size=2,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    # 8 rows, test_size=2: 6 train rows = 3 batches of 2. The test split makes train.main run its
    # sampler NLL evaluator (compute_logprobs through a sampling session) every eval_every steps.
    builder = FromConversationFileBuilder(common_config=common, file_path=str(data), test_size=2)
    return train.Config(
        log_path=args.log_dir, model_name=args.model_name, recipe_name="recipe_sl_basic",
        renderer_name=RENDERER, dataset_builder=builder, learning_rate=1e-4, lr_schedule="linear",
        num_epochs=1, lora_rank=args.lora_rank, base_url=args.base_url,
        eval_every=2,   # evaluations at steps 0 and 2
        save_every=2,   # checkpoint "000002" (state + sampler weights); train.main adds "final"
        max_steps=args.steps, ttl_seconds=3600,
    ), train


def rl_config(args: argparse.Namespace):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    # Each step: 2 groups (problems) x 2 samples, rewarded for the right sum, trained with importance sampling.
    builder = ArithmeticDatasetBuilder(batch_size=2, group_size=2, model_name_for_tokenizer=args.model_name,
                                       renderer_name=RENDERER, n_batches=args.steps, include_fewshot=True)
    return train.Config(
        learning_rate=1e-4, dataset_builder=builder, model_name=args.model_name, recipe_name="recipe_rl_basic",
        max_tokens=8, log_path=args.log_dir, renderer_name=RENDERER, lora_rank=args.lora_rank,
        base_url=args.base_url, eval_every=0,
        save_every=1,   # checkpoint after every step, then sample from the saved sampler weights
        loss_fn="importance_sampling", num_groups_to_log=1, max_steps=args.steps, ttl_seconds=3600,
    ), train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--log-dir", required=True, help="the cookbook's log_path (must not hold a previous run)")
    ap.add_argument("--mode", choices=["sl", "rl"], required=True)
    ap.add_argument("--model-name", default="meta-llama/Llama-3.2-3B")
    ap.add_argument("--steps", type=int, default=None, help="default: 3 (sl), 2 (rl)")
    ap.add_argument("--lora-rank", type=int, default=4)
    ap.add_argument("--expect-version", help="fail unless this is the installed tinker-cookbook version")
    args = ap.parse_args()
    version = importlib.metadata.version("tinker-cookbook")
    if args.expect_version and version != args.expect_version:
        sys.exit(f"expected tinker-cookbook {args.expect_version}, {sys.executable} has {version}")
    # And the code imported is that distribution's (.venv-cookbook-061 also sees 0.5.8's copy, after its own).
    import tinker_cookbook

    own = importlib.metadata.distribution("tinker-cookbook").locate_file("tinker_cookbook/__init__.py")
    if Path(tinker_cookbook.__file__).resolve() != Path(str(own)).resolve():
        sys.exit(f"tinker_cookbook was imported from {tinker_cookbook.__file__}, not tinker-cookbook {version}'s {own}")
    args.steps = args.steps or (3 if args.mode == "sl" else 2)

    if args.mode == "sl":
        Path(args.log_dir).parent.mkdir(parents=True, exist_ok=True)
        data = write_conversations(Path(args.log_dir).parent / f"{Path(args.log_dir).name}-data.jsonl")
        cfg, train = sl_config(args, data)
    else:
        cfg, train = rl_config(args)
    asyncio.run(train.main(cfg))
    print(f"cookbook {version} {args.mode}: done, log_path={cfg.log_path}")


if __name__ == "__main__":
    main()
