"""Shared test helpers: tiny models, batches, and the plain-PyTorch reference."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tinkerq import types

VOCAB = 97


def build_tiny_llama(out_dir: Path, seed: int = 0, *, tied: bool = False) -> Path:
    """A ~30k-parameter Llama saved with save_pretrained (tests load it back with from_pretrained)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    # The demo's character tokenizer (50 ids, all inside VOCAB), so stop strings can be decoded.
    from tinkerq.recipes.demo_model import build_tokenizer

    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def load_reference(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def make_batch(rng: np.random.Generator, n: int, min_len: int = 3, max_len: int = 40) -> list[types.Datum]:
    """Datums of different lengths with prompt positions weighted 0 and random completion weights."""
    data = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        seq = rng.integers(0, VOCAB, size=length + 1)
        prompt = int(rng.integers(1, length))  # at least one zero-weight position
        weights = np.where(np.arange(length) < prompt, 0.0, rng.uniform(0.5, 1.5, size=length)).astype(np.float32)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
            loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": weights},
        ))
    return data


def peak_rss_growth(fn) -> int:
    """Peak RSS growth of this process while ``fn`` runs (Linux: VmHWM, reset through clear_refs)."""
    from tinkerq.worker import memory

    memory.release_memory()
    Path("/proc/self/clear_refs").write_text("5")
    before = memory.rss_bytes()
    fn()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 - before
    raise AssertionError("no VmHWM")


class LiveTensorBytes:
    """The peak of live tensor bytes while it is on, above what was live before: what
    ``torch.cuda.max_memory_allocated`` counts on a GPU, on the CPU (whose allocator keeps no such count).

    A dispatch mode sees every operator's outputs (autograd's backward, checkpointing's recomputation, FSDP's
    all-gather buffers and DTensors' local tensors included); each new storage counts until it is freed (a weakref
    finalizer on it). Tensors made outside the dispatcher (a file read by safetensors) are not seen."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._mode = None

    def _count(self, t: torch.Tensor) -> None:
        import weakref

        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        self._seen.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)

        def freed(key: int = key, n: int = n) -> None:
            self.live -= n
            self._seen.discard(key)

        weakref.finalize(storage, freed)

    def __enter__(self) -> LiveTensorBytes:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        tracker._count(t)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def reference_logprobs(model: torch.nn.Module, datum: types.Datum) -> torch.Tensor:
    """log p(target_i | input_<=i) for one datum, unpadded, full logits: the plain definition."""
    tokens = torch.tensor(datum.model_input.to_ints()).unsqueeze(0)
    targets = torch.from_numpy(np.array(datum.loss_fn_inputs["target_tokens"].to_numpy()))
    logits = model(input_ids=tokens).logits[0].float()  # (N, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)


def reference_loss(model: torch.nn.Module, data: list[types.Datum]) -> torch.Tensor:
    total = torch.zeros(())
    for d in data:
        weights = torch.from_numpy(np.array(d.loss_fn_inputs["weights"].to_numpy()))
        total = total + (-reference_logprobs(model, d) * weights).sum()
    return total


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[list[types.Datum]],
                   adam: types.AdamParams) -> float:
    """forward_backward over ``batches`` then optim_step, in process; returns the pre-clip grad norm."""
    for batch in batches:
        reference_loss(model, batch).backward()
    return adamw_step(opt, list(model.parameters()), adam)


def adamw_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], adam: types.AdamParams) -> float:
    """Tinker's optim_step in plain torch: clip ``params``' gradients by global norm (when asked), AdamW with
    ``adam``'s hyperparameters, gradients cleared; returns the pre-clip grad norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf"))
    for group in opt.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    opt.step()
    opt.zero_grad()
    return float(norm)


def max_weight_diff(model: torch.nn.Module, other_dir: str) -> float:
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    ref = dict(model.named_parameters())
    with torch.no_grad():
        return max(float((ref[name] - p).abs().max()) for name, p in other.named_parameters())


RL_CONFIGS = {
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
}


def rl_batch(ref, rng):
    """RL datums as the cookbook builds them: prompt positions carry zero logprobs and advantages; the
    sampler's logprobs are the reference's, perturbed so that ratios differ from 1 (clipping triggers)."""
    data = []
    for i, d in enumerate(make_batch(rng, 5, min_len=6, max_len=30)):
        n = d.model_input.length
        prompt = int(rng.integers(1, n - 2))
        with torch.no_grad():
            t = reference_logprobs(ref, d).numpy()
        s = (t + rng.normal(0, 0.3, n)).astype(np.float32)
        s[:prompt] = 0.0
        adv = np.zeros(n, np.float32)
        adv[prompt:] = 0.0 if i == 1 else rng.normal()  # datum 1 is fully masked
        mask = (np.arange(n) >= prompt).astype(np.float32)
        inputs = {"target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": s, "advantages": adv}
        data.append((d.model_input, inputs, mask))
    return data


def send_raw(tc, op: str, envelope, *, task_id: str | None = None, decode=None, **send_options):
    """Post a hand-made message on a training client's worker queue, bypassing the producer's checks, and
    return a future for its answer (the reply comes to the client's inbox like any other)."""
    import uuid

    from tinkerq.celery_app import TASK_NAMES
    from tinkerq.wire import messages

    service = tc.service
    task_id = task_id or str(uuid.uuid4())
    future = service._dispatch.expect(task_id, decode or messages.decode_forward_backward_output, describe=op)
    service.connection.app.send_task(TASK_NAMES[op], args=(envelope,), queue=tc._queue, task_id=task_id,
                                     headers={messages.REPLY_HEADER: service._dispatch.inbox}, **send_options)
    return future


def run_tinker_cli(args: list[str], *, base_url: str, api_key: str, timeout: float = 120,
                   env: dict[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """The SDK's `tinker` command against a gateway (``tinker -f json checkpoint list ...``), recorded for the SDK
    surface check (tests/sdk_coverage.py): the one way tests run it. ``input``: its standard input (a prompt's
    answer, e.g. the key `tinker auth login` asks for)."""
    import os
    import sys

    from tests.sdk_coverage import cli_entry, record

    entry = cli_entry(args)
    if entry is not None:
        record(entry)
    tinker = Path(sys.executable).with_name("tinker")
    return subprocess.run([str(tinker), *args], capture_output=True, text=True, timeout=timeout, input=input,
                          env={**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": api_key,
                               "TINKER_TELEMETRY": "0", **(env or {})})
