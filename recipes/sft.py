"""``tinkerq sft``: supervised fine-tuning through the fleet, with a before/after evaluation.

Every training step is a ``forward_backward`` + ``optim_step`` pair posted through the queue; step k+1 is
submitted before waiting on step k, as Tinker recommends. With no broker configured the job runs an
embedded fleet in this process (same serialisation and worker code, in-memory transport).

Outputs in the run directory: ``metrics.jsonl`` (one line per step), ``loss.png``, ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tinkerq import types
from tinkerq.errors import UserError
from tinkerq.producer import ServiceClient, TrainingClient
from tinkerq.recipes.jsonl import read_objects
from tinkerq.settings import Settings

DATA_DIR = Path(__file__).resolve().parent / "data"


PAIRS_FORMAT = 'one {"prompt": "...", "completion": "..."} object per line'


def load_pairs(path: Path, flag: str = "") -> list[dict[str, str]]:
    """The {prompt, completion} pairs of a JSONL file, or a UserError naming the file (and ``flag``, the option
    that gave it), the line and what the file must hold."""
    where = f"{flag} {path}" if flag else str(path)
    pairs = []
    for lineno, row in read_objects(path, where=where, needs=f"a JSONL file with {PAIRS_FORMAT}"):
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise UserError(f"{where}, line {lineno}: needs string fields 'prompt' and 'completion', found fields "
                            f"{', '.join(map(repr, row))}; the file needs {PAIRS_FORMAT}")
        pairs.append(row)
    return pairs


def model_directory(model: str | None) -> str:
    """``--model`` as an absolute path, checked before anything starts, or the demo model (built once)."""
    if model is None:
        from tinkerq.recipes import demo_model

        return str(demo_model.ensure_demo_model())
    path = Path(model).expanduser().resolve()
    fix = "pass a local Hugging Face model directory (what save_pretrained writes), or leave --model out for the demo"
    if not path.is_dir():
        raise UserError(f"--model {model}: no such directory; {fix}")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {model}: no config.json there; {fix}")
    return str(path)


def load_tokenizer(model_dir: str) -> Any:
    """The model directory's tokenizer (the recipes encode their data with it on this machine)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:400] or type(exc).__name__  # transformers' messages span lines
        raise UserError(f"--model {model_dir}: cannot load its tokenizer ({reason}); the directory needs the "
                        f"tokenizer files (tokenizer.json ...) that save_pretrained writes") from None


def run_directory(out: str | None, recipe: str) -> Path:
    """``--out``, or ``runs/<recipe>-<time>``: created now, so a wrong path fails before the fleet starts."""
    path = Path(out or f"runs/{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {path} is a file; pass a directory for the run's metrics, curve and summary")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {path}: cannot create it ({exc.strerror or exc}); pass a writable directory") from None
    return path


def check_sample_size(n: int, flag: str, pairs: list[dict[str, str]], source: str) -> None:
    """Each step draws ``n`` distinct pairs: refuse more than there are before anything runs."""
    if n > len(pairs):
        raise UserError(f"{flag} {n} is more than the {len(pairs)} pairs in {source}; pass at most {len(pairs)}")


def make_datums(tokenizer: Any, pairs: list[dict[str, str]]) -> list[types.Datum]:
    """SFT datums whose weights average the NLL over the batch's completion tokens (loss:sum = mean NLL)."""
    from tinkerq.recipes.demo_model import encode_example

    encoded = [encode_example(tokenizer, p["prompt"], p["completion"]) for p in pairs]
    n_completion = sum(sum(w) for _, _, w in encoded)
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(inputs),
            loss_fn_inputs={"target_tokens": targets, "weights": [w / n_completion for w in weights]},
        )
        for inputs, targets, weights in encoded
    ]


def heldout_nll(tc: TrainingClient, tokenizer: Any, pairs: list[dict[str, str]]) -> float:
    """Mean NLL per completion token on held-out pairs, computed by the fleet (``forward``)."""
    out = tc.forward(make_datums(tokenizer, pairs), "cross_entropy").result(timeout=600)
    return out.metrics["loss:sum"]


def exact_match(model_dir: str, tokenizer: Any, pairs: list[dict[str, str]]) -> float | None:
    """Greedy-decode each held-out prompt with the weights in ``model_dir``; fraction fully correct."""
    if not os.path.isdir(model_dir):
        return None  # the fleet's checkpoint directory is not visible from here
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None  # a producer-only install (no torch): the held-out NLL still comes from the fleet

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    correct = 0
    with torch.no_grad():
        for p in pairs:
            prompt = [tokenizer.bos_token_id, *tokenizer.encode(p["prompt"], add_special_tokens=False)]
            target = tokenizer.encode(p["completion"], add_special_tokens=False)
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=len(target) + 1, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt):].tolist()
            correct += out == [*target, tokenizer.eos_token_id]
    return correct / len(pairs)


def open_training_client(sc: ServiceClient, model_dir: str, lora_rank: int | None,
                         seed: int | None = None) -> TrainingClient:
    """A full-parameter session (``lora_rank`` None) or a LoRA session of that rank whose initial adapter is
    drawn from ``seed`` (so a run repeats); a LoRA one prints its size."""
    if lora_rank is None:
        return sc.create_training_client(model_dir).result()
    tc = sc.create_lora_training_client(model_dir, rank=lora_rank, seed=seed).result()
    print(describe_lora(tc.get_info()))
    return tc


def describe_lora(info: types.ModelInfo) -> str:
    """The adapter's size, as in "LoRA rank 8: 12,345 trainable parameters (0.4% of 3.1M), 193 KiB of
    training state" (from ``get_info().extra["lora"]``)."""
    lora = info.extra.get("lora") or {}
    trainable = lora.get("trainable_parameters")
    if not isinstance(trainable, int):
        return f"LoRA rank {lora.get('rank', '?')}: the worker did not report the adapter's size"
    share = f"{100 * trainable / info.num_parameters:.1f}% of {_count(info.num_parameters)}" \
        if info.num_parameters else "of an unknown total"
    text = f"LoRA rank {lora.get('rank', '?')}: {trainable:,} trainable parameters ({share})"
    state = lora.get("state_bytes")
    return text + (f", {_bytes(state)} of training state" if isinstance(state, int) else "")


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _bytes(n: int) -> str:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


@contextlib.contextmanager
def open_fleet(settings: Settings, model_dir: str, threads: int | None) -> Iterator[ServiceClient]:
    """A client on the fleet ``settings`` names, or on an embedded fleet started here."""
    if settings.broker_url is not None and not settings.is_embedded:
        from tinkerq.connection import redact_url

        print(f"using the fleet at {redact_url(settings.broker_url)}")
        with ServiceClient(settings=settings) as sc:
            yield sc
        return
    import torch

    from tinkerq.worker.core.embedded import EmbeddedFleet

    if threads is not None:
        torch.set_num_threads(threads)
    print("no broker configured: starting an embedded fleet in this process (pass --broker redis://... "
          "or set TINKERQ_BROKER_URL to use a running one)")
    with EmbeddedFleet(model_dir, settings) as fleet, ServiceClient(settings=fleet.settings) as sc:
        yield sc


def main(args: argparse.Namespace) -> int:
    from tinkerq.recipes import demo_model
    from tinkerq.recipes.plotting import plot_metrics

    # Every mistake in the command line is found here, before the model is built or the fleet started.
    settings = Settings.from_env(broker_url=args.broker)
    train_path = Path(args.train) if args.train else DATA_DIR / "train.jsonl"
    train = load_pairs(train_path, "--train" if args.train else "")
    heldout = load_pairs(Path(args.eval) if args.eval else DATA_DIR / "eval.jsonl",
                         "--eval" if args.eval else "")[: args.eval_examples]
    steps, batch_size, lr = args.steps, args.batch_size, args.lr
    check_sample_size(batch_size, "--batch-size", train, str(train_path))
    lora_rank = getattr(args, "lora_rank", None)
    model_dir = model_directory(args.model)
    tokenizer = load_tokenizer(model_dir)
    out_dir = run_directory(args.out, "sft")  # last: a mistake found above leaves no empty run directory
    rng = random.Random(args.seed)

    with open_fleet(settings, model_dir, args.threads) as sc:
        tc = open_training_client(sc, model_dir, lora_rank, args.seed)
        lora_info = tc.get_info().extra.get("lora") if lora_rank is not None else None
        kind = f"LoRA rank {lora_rank} over" if lora_rank is not None else "full-parameter,"
        print(f"training session {tc.model_id[:8]} on {tc.info.worker}: {kind} {tc.info.num_parameters / 1e6:.2f}M "
              f"parameters, {len(train)} train / {len(heldout)} held-out pairs, {steps} steps of {batch_size}, "
              f"peak lr {lr:g}")
        before = {"heldout_nll": heldout_nll(tc, tokenizer, heldout),
                  "exact_match": exact_match(model_dir, tokenizer, heldout)}
        _print_eval("before", before)

        metrics_path = out_dir / "metrics.jsonl"
        started = time.perf_counter()
        with open(metrics_path, "w") as log, tqdm(total=steps, desc="sft", unit="step") as bar:
            in_flight: list[tuple[int, Any, Any, int, float]] = []
            for step in range(steps + 1):
                if step < steps:  # submit step k+1 before waiting on step k: the fleet keeps the order
                    batch = make_datums(tokenizer, rng.sample(train, batch_size))
                    tokens = sum(d.model_input.length for d in batch)
                    step_lr = demo_model.lr_at_step(step, steps, lr) if args.lr_schedule == "linear" else lr
                    adam = types.AdamParams(learning_rate=step_lr, beta1=0.9, beta2=0.95, eps=1e-8)
                    fb, opt = tc.forward_backward(batch), tc.optim_step(adam)
                    in_flight.append((step, fb, opt, tokens, step_lr))
                if len(in_flight) == 2 or (step == steps and in_flight):
                    done_step, fb, opt, tokens, step_lr = in_flight.pop(0)
                    loss = fb.result(timeout=600).metrics["loss:sum"]
                    grad_norm = opt.result(timeout=600).metrics["grad_norm:mean"]
                    row = {"step": done_step + 1, "loss": loss, "grad_norm": grad_norm, "learning_rate": step_lr,
                           "tokens": tokens, "elapsed_s": round(time.perf_counter() - started, 3),
                           # what the worker measured for this forward_backward
                           **{f"fb_{k}": round(v, 4) for k, v in fb.timing.items() if k != "tokens"}}
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", grad_norm=f"{grad_norm:.2f}")
        train_seconds = time.perf_counter() - started

        # A LoRA session saves a PEFT adapter directory; merged=True adds <path>/merged, a plain model
        # directory the exact-match check loads without peft.
        saved = tc.save_weights_for_sampler("final", merged=lora_rank is not None).result(timeout=600).path
        scored = os.path.join(saved, "merged") if lora_rank is not None else saved
        after = {"heldout_nll": heldout_nll(tc, tokenizer, heldout),
                 "exact_match": exact_match(scored, tokenizer, heldout)}
        _print_eval("after", after)
        tc.close()

    plot = plot_metrics(metrics_path, out_dir / "loss.png", keys=["loss"], title="tinkerq sft: training loss")
    summary = {"model": model_dir, "lora": lora_info, "steps": steps, "batch_size": batch_size,
               "learning_rate": lr,
               "lr_schedule": args.lr_schedule, "train_seconds": round(train_seconds, 1), "before": before,
               "after": after, "weights": saved,
               "metrics": str(metrics_path), "plot": str(plot)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"trained {steps} steps in {train_seconds:.0f} s; metrics: {metrics_path}; curve: {plot}; "
          f"weights: {saved}")
    return 0


def _print_eval(label: str, result: dict[str, float | None]) -> None:
    em = result["exact_match"]
    em_text = f"{100 * em:.1f}%" if em is not None else "n/a (needs torch and the saved weights on this machine)"
    print(f"{label:>6}: held-out NLL/token {result['heldout_nll']:.3f}, exact match {em_text}")
