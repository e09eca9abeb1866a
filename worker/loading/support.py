"""Which paths a worker serves for the model class it loaded, and why the others are refused.

A worker never serves a number it has not seen proven. Each path (a full-parameter session, a LoRA session, sampling)
of each transformers class is either proven exact by the test suite, against the class itself loaded with
``from_pretrained`` or plain PyTorch (tests/test_moe_classes.py parametrizes its checks from this table), or refused
when the session is created, with one user error that says what is not served and what works instead. A class the
suite has not proven at all is refused whole: tinkerq does not guess from a class's name or config that its padding,
caches and layouts behave like a proven one's.

Beyond this table, :func:`tinkerq.worker.lora.adapter.find_targets` refuses per-flag LoRA layouts it cannot adapt
(experts it cannot read: one user error naming the module), and the sampling engine refuses a cache layer class it
does not know (worker/sampling/cache_rows.py): both are checked when the session is made too.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinkerq.errors import ValidationError

# "shard_group": a worker started with --shards (every rank streams its shards from the files);
# "expert_parallel": a shard group started with --expert-parallel (its routed experts split over the ranks).
PATHS = ("full", "lora", "sampling", "shard_group", "expert_parallel")

# Dense classes proven by the suite (tests/test_families_*.py, tests/test_sampling_*.py, tests/test_loss_head.py,
# the demo model's Llama): full sessions, LoRA on every flag and sampling.
_DENSE = frozenset({
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "MistralForCausalLM",
    "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM",
})

# Mixture-of-experts and hybrid classes proven by tests/test_moe_classes.py (every MoE causal LM of transformers
# 5.24 that recipes/moe_classes.py builds) and tests/test_families_*.py.
_MOE = frozenset({
    "AXK1ForCausalLM", "AXK2ForCausalLM", "AfmoeForCausalLM", "AriaTextForCausalLM", "BailingHybridForCausalLM",
    "BeamForCausalLM", "Cohere2MoeForCausalLM", "DbrxForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "DogeForCausalLM", "Dots1ForCausalLM", "Ernie4_5_MoeForCausalLM",
    "ExaoneMoeForCausalLM", "FlexOlmoForCausalLM", "FlintForCausalLM", "Gemma4ForCausalLM", "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "GptOssForCausalLM", "GraniteMoeForCausalLM",
    "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM", "HYV3ForCausalLM",
    "HYV4ForCausalLM", "HunYuanMoEV1ForCausalLM", "Inkling2ForCausalLM", "Inkling2LoopForCausalLM",
    "InklingForCausalLM", "JambaForCausalLM", "JetMoeForCausalLM", "KimiLinearForCausalLM", "Kolibri1ForCausalLM",
    "LagunaForCausalLM", "LaraMiniForCausalLM", "Lfm2MoeForCausalLM", "Llama4ForCausalLM", "LongcatFlashForCausalLM",
    "MellumForCausalLM", "MiMoV2FlashForCausalLM", "MiniMaxForCausalLM", "MiniMaxM2ForCausalLM",
    "MiniMaxM3VLForCausalLM", "Mistral4ForCausalLM", "MixtralForCausalLM", "NemotronHForCausalLM",
    "OlmoeForCausalLM", "PhimoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM", "SolarOpenForCausalLM", "ZayaForCausalLM",
})

PROVEN = _DENSE | _MOE

# The classes proven on a shard group (a streamed load equal to from_pretrained, then sharded training and sampling:
# tests/test_streaming_load.py, tests/test_sharding.py, tests/test_expert_parallel.py run the families of
# recipes/families.py and the published layouts of recipes/published.py). Any other class: a single worker.
_SHARD_GROUPS = frozenset({
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
    "GptOssForCausalLM", "DeepseekV3ForCausalLM", "NemotronHForCausalLM", "Gemma3ForCausalLM", "MistralForCausalLM",
    "Phi3ForCausalLM", "Olmo2ForCausalLM", "InklingForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
    "Qwen3NextForCausalLM",
})


@dataclass(frozen=True)
class Refusal:
    """A path of a proven class that is not served: why, and what works instead."""

    why: str
    instead: str


_BATCH_DEPENDENT = Refusal(
    "its outputs for one sequence change with the other sequences of the batch (a single sequence's forward "
    "already differs from its own incremental decode by up to 0.02 in logprob, in transformers itself)",
    "no path of this class is served; use another model",
)

# Paths of proven classes that are refused, each with its reason (measured; docs/families.md).
REFUSED: dict[tuple[str, str], Refusal] = {
    ("DogeForCausalLM", "full"): _BATCH_DEPENDENT,
    ("DogeForCausalLM", "lora"): _BATCH_DEPENDENT,
    ("DogeForCausalLM", "sampling"): _BATCH_DEPENDENT,
    ("InklingForCausalLM", "expert_parallel"): Refusal(
        "its shared experts run every expert on every token, beside the routed ones: expert parallelism splits routed "
        "experts only, and this layer's shared experts are not split or placed by it",
        "start the shard group without --expert-parallel (FSDP2 alone), or a single worker",
    ),
    ("KimiLinearForCausalLM", "shard_group"): Refusal(
        "its q, k and v short-convolution weights are stored apart and concatenated when loaded, and a shard group's "
        "streamed load of them gave other weights than from_pretrained (its logprobs 0.07 off on the tiny model: "
        "tests/test_streaming_load.py, tests/test_expert_parallel.py)",
        "serve it on a single worker (without --shards)",
    ),
    ("MiniMaxForCausalLM", "sampling"): Refusal(
        "its lightning-attention state lives outside the cache's layers (MiniMaxCache.linear_cache), where the "
        "sampling engine cannot keep it per sequence",
        "training (full and LoRA), forward and compute_logprobs are served; sample with another model",
    ),
}

_WHAT = {"full": "full-parameter training", "lora": "LoRA training", "sampling": "sampling",
         "shard_group": "a shard group", "expert_parallel": "expert parallelism"}


def refusal(class_name: str, path: str) -> Refusal | None:
    """Why ``path`` of ``class_name`` is not served, or None when it is."""
    assert path in PATHS, path
    if class_name not in PROVEN:
        return Refusal(
            "tinkerq has not proven this class's paths exact (its padding, caches and layouts are checked per class, "
            "not guessed)",
            "serve one of the classes listed in docs/families.md, or add this class to tinkerq's checks "
            "(recipes/moe_classes.py, worker/loading/support.py) and run tests/test_moe_classes.py",
        )
    if path == "expert_parallel" and (group := refusal(class_name, "shard_group")) is not None:
        return group  # an expert-parallel group is a shard group
    if path == "shard_group" and class_name not in _SHARD_GROUPS and (class_name, path) not in REFUSED:
        return Refusal(
            "tinkerq has not proven this class on a shard group (its streamed load and sharded passes are checked per "
            "class: tests/test_streaming_load.py)",
            "serve it on a single worker (without --shards), or add it to those checks",
        )
    return REFUSED.get((class_name, path))


def check(class_name: str, path: str) -> None:
    """Raise the user error of a refused path (at session creation: no state is made)."""
    text = message(class_name, path)
    if text is not None:
        raise ValidationError(text)


def message(class_name: str, path: str) -> str | None:
    """The refusal's one line (what is not served, why, what works instead), or None when ``path`` is served."""
    found = refusal(class_name, path)
    return None if found is None else f"{_WHAT[path]} of {class_name} is not served: {found.why}; {found.instead}"


def served(class_name: str) -> dict[str, str]:
    """{path: "served" or the refusal's reason}, for status pages and docs."""
    return {p: "served" if (r := refusal(class_name, p)) is None else r.why for p in PATHS}
