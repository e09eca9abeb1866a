"""A tiny, deterministic Llama model and character tokenizer for demos and tests.

Everything here is built locally from a fixed alphabet and a seed: nothing is ever
downloaded, so the demo works offline and the token ids never change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
# Order fixes the ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then the characters.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Fixed alphabet (never derived from data files) so ids are stable across runs and versions.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-=>|:,. \n"

MAX_POSITIONS = 128

# The bundled SFT data set (see data/make_data.py): reverse 3-6 lowercase letters, "abcd>" -> "dcba".
DATA_DIR = Path(__file__).resolve().parent / "data"
# Bump when the model's config or tokenizer changes: cached copies of an older build are not reused.
DEMO_MODEL_VERSION = 1

# Model shape at the defaults: 4 layers x 128 wide, tied embeddings, 1,056,128 params.
# A 4.2M model (256 wide) learns the task too but each step is ~3x slower on 2 CPU cores.
DEFAULT_HIDDEN_SIZE = 128
DEFAULT_LAYERS = 4
DEFAULT_HEADS = 4
DEFAULT_INTERMEDIATE_SIZE = 512

# Recommended full-parameter SFT settings for the bundled task, measured with a plain
# PyTorch loop (AdamW betas=(0.9, 0.95), eps=1e-8, no weight decay, loss = sum of
# -logprob*weight over the batch / number of weighted tokens, torch.set_num_threads(2)):
# greedy exact-match on the first 100 eval pairs goes 0% -> 100% for data-order seeds
# 0, 1 and 2; loss 3.95 -> ~1.6 (step 50) -> ~0.57 (100) -> ~0.15 (150) -> ~0.02 (250).
# Training takes ~19 s on an idle 2-core CPU (~0.075 s/step), up to ~55 s when the
# cores are shared, leaving room for a fleet's per-step overhead in a 2-minute demo.
DEFAULT_BATCH_SIZE = 64
DEFAULT_STEPS = 250
DEFAULT_LR = 2e-3
# The lr decays linearly from DEFAULT_LR to 0 over the run (see lr_at_step): without
# the decay the loss stays noisy at the end and seed 1 reached only 67% at 250 steps.
DEFAULT_LR_SCHEDULE = "linear"
# If the trainer can only use a constant lr: batch 32, 600 steps, lr 1e-3 gave
# 97% / 96% (seeds 0 / 1) in ~26 s idle.
CONSTANT_LR_BATCH_SIZE = 32
CONSTANT_LR_STEPS = 600
CONSTANT_LR = 1e-3


def lr_at_step(step: int, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR) -> float:
    """Learning rate for 0-based ``step`` of ``steps`` under the linear-decay schedule."""
    return lr * max(0.0, 1.0 - step / steps)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer: one token per character of ALPHABET.

    ``tokenizer(text)`` prepends ``<bos>`` (Llama convention), so it yields a ready
    generation prompt; ``add_special_tokens=False`` gives just the characters.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character (newline included, hence [\s\S]) is its own pre-token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens back without the default space separator.
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MAX_POSITIONS,
        padding_side="left",  # left padding keeps batched generation correct
    )


def build_demo_model(
    out_dir: Path,
    *,
    seed: int = 0,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    layers: int = DEFAULT_LAYERS,
    heads: int = DEFAULT_HEADS,
    intermediate_size: int = DEFAULT_INTERMEDIATE_SIZE,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """Create a randomly initialised tiny Llama plus tokenizer in ``out_dir``.

    The same seed gives the same weights. The directory appears atomically: it is
    built in a temporary sibling and renamed, so a crash never leaves half a model.
    An existing ``out_dir`` is replaced.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Greedy decoding that stops at <eos> by default, so demos need no generate() kwargs.
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            # Move the old dir aside first: os.replace cannot overwrite a non-empty dir.
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "model")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_home() -> Path:
    """The ``home`` setting (``TINKERQ_HOME``, default ``~/.cache/tinkerq``)."""
    from tinkerq.settings import Settings

    return Path(Settings.from_env().home)


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return a ready demo model dir, building it on first use.

    ``cache_dir`` is the model dir itself; by default ``$TINKERQ_HOME/demo-model-v<N>``.
    """
    out_dir = Path(cache_dir) if cache_dir is not None else default_home() / f"demo-model-v{DEMO_MODEL_VERSION}"
    # config.json, weights and tokenizer all land in one rename, so any one of them
    # present means the whole dir is complete.
    if (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    try:
        return build_demo_model(out_dir)
    except OSError:
        # Another process may have won the race to build it; its copy is identical.
        if (out_dir / "config.json").is_file():
            return out_dir
        raise


def encode_example(
    tokenizer: PreTrainedTokenizerFast, prompt: str, completion: str
) -> tuple[list[int], list[int], list[float]]:
    """Turn one SFT pair into (input_tokens, target_tokens, weights), Tinker style.

    The sequence is ``<bos> prompt completion <eos>``; inputs are ``seq[:-1]``,
    targets ``seq[1:]``; a weight is 1.0 where the target is a completion token or
    ``<eos>`` and 0.0 where it is a prompt token.
    """
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)
    seq = [tokenizer.bos_token_id, *prompt_ids, *completion_ids, tokenizer.eos_token_id]
    # targets seq[1 : 1 + len(prompt)] are prompt tokens; the rest are completion + <eos>.
    weights = [0.0] * len(prompt_ids) + [1.0] * (len(completion_ids) + 1)
    return seq[:-1], seq[1:], weights
