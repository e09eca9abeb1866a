"""Every mixture-of-experts causal LM class of the installed transformers, built tiny from its config class.

Enumeration (:func:`moe_classes`), from what transformers ships, not from a list of names:

1. Candidates: every class transformers exports whose name ends in ``ForCausalLM``, plus every value of its
   causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; it also holds a few ``...LMHeadModel`` and
   ``...ForConditionalGeneration`` classes).
2. A candidate is MoE when either
   - its modeling module's source defines an experts module: a class decorated with transformers'
     ``@use_experts_implementation`` (the fused 3-D layouts) or a class whose name ends in ``Experts``
     (fused layouts without the decorator, e.g. Llama-4's ``Llama4TextExperts``), or
   - its config class declares an expert count (``num_experts``, ``num_local_experts``, ``n_routed_experts``,
     ``moe_num_experts``), whatever its default (some default to None: MoE off).
   Both are read without building a model; the union catches MoE layers whose experts are not a fused module
   (Doge's embedding-table experts) and fused experts whose config names its count otherwise.

Each MoE class is built (:func:`build_moe_class`) from its config class's defaults with :data:`GENERIC` sizes set
on every field the config has (hidden 32, 2 layers, 4 heads, 4 experts, top-2, vocab 101, ...), per-layer lists
cut to the new depth keeping one layer of each kind, and :data:`OVERRIDES` for the fields a generic rule cannot
set (which layers are MoE, hybrid layer kinds, switches that turn the MoE block on). Weights come from a fixed
seed, with zero-initialised biases and routers drawn (recipes/families.py).

A candidate that is not built is in :func:`skipped` with its reason; tests/test_moe_classes.py asserts that every
enumerated class is either built or skipped, so a new transformers class cannot pass unnoticed.
``python -m tinkerq.recipes.moe_classes`` prints both lists.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from pathlib import Path
from typing import Any

from tinkerq.recipes.families import VOCAB, _nonzero_biases

# Config fields that count a MoE layer's routed experts.
_EXPERT_COUNT = re.compile(r"^(num|n)_(local_|routed_)?experts$|^moe_num_experts$")
# A modeling module that defines an experts module.
_EXPERTS_CLASS = re.compile(r"^@use_experts_implementation|^class \w*Experts\(", re.MULTILINE)

# Sizes set on every config field of that name the class has (a field it lacks is left alone).
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    moe_shared_expert_intermediate_size=16, shared_experts_intermediate_size=16, expert_intermediate_size=16,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    num_experts_per_token=2, moe_topk=2, top_k_experts=2, n_group=1, topk_group=1, first_k_dense_replace=1,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    max_position_embeddings=256, sliding_window=4, sliding_window_size=4, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
    output_router_logits=False,
    # DeepSeek sparse attention (DSA): the indexer keeps the top 4 columns, so the sparse choice matters at toy length
    index_topk=4, index_head_dim=8, index_n_heads=16,
    # Inkling's sliding-window layers have heads of their own (and a relative-position bias over rel_extent columns)
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, rel_extent=16,
)

# Per class, the fields a generic rule cannot set.
OVERRIDES: dict[str, dict[str, Any]] = {
    "Dots1ForCausalLM": dict(n_shared_experts=1),
    "DogeForCausalLM": dict(is_moe=True),
    "FlintForCausalLM": dict(mlp_only_layers=[0]),
    "Ernie4_5_MoeForCausalLM": dict(moe_k=2, moe_layer_end_index=1),  # layer 0 dense, layer 1 MoE
    "Lfm2MoeForCausalLM": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "ZayaForCausalLM": dict(num_experts_per_tok=1, router_hidden_size=16),  # the class takes top-1 only
    "JambaForCausalLM": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                             mamba_dt_rank=4, mamba_d_state=4, use_mamba_kernels=False),
    "GraniteMoeHybridForCausalLM": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
                                        shared_intermediate_size=16,
                                        layer_types=["linear_attention", "full_attention"]),
    "Mistral4ForCausalLM": dict(head_dim=16),  # rotary on half of it (partial_rotary_factor 0.5): qk_rope_head_dim
    # attn_config's rope_theta and clip_qkv: the attention reads them, the config class does not set them
    "DbrxForCausalLM": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256,
                            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                            ffn_config={"hidden_size": 32, "ffn_hidden_size": 16, "moe_num_experts": 4,
                                        "moe_top_k": 2}),
    "Gemma4ForCausalLM": dict(enable_moe_block=True, top_k_experts=2, moe_intermediate_size=16,
                              per_layer_config={}, hidden_size_per_layer_input=8,
                              layer_types=["sliding_attention", "full_attention"]),
    "LongcatFlashForCausalLM": dict(num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=16, moe_topk=2,
                                    zero_expert_num=2),
    "BailingHybridForCausalLM": dict(num_expert_group=1, first_k_dense_replace=1, layer_group_size=2,
                                     linear_head_dim=8, linear_num_heads=4, num_nextn_predict_layers=0),
    "KimiLinearForCausalLM": dict(num_expert_group=1, linear_head_dim=8, linear_num_heads=4),
    # compression every 2 and 4 tokens (defaults 4 and 128: the heavy one would never close a window at toy length),
    # the grouped output projection small
    "DeepseekV4ForCausalLM": dict(compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                                  o_groups=2, o_lora_rank=8),
}

# Classes that are not built, and why (a class listed here must still be enumerated: tests check both ways).
_SKIP_REASONS: dict[str, str] = {
    "Gemma4ForConditionalGeneration": "vision-language model (in the causal-LM auto mapping for its text side); "
                                      "its text model, Gemma4ForCausalLM, is built and checked",
}


@functools.cache
def _candidates() -> dict[str, str]:
    """{causal-LM class name: its modeling module (dotted, under transformers)}."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    where: dict[str, str] = sys.modules["transformers"]._class_to_module  # type: ignore[attr-defined]
    names = {n for n in where if n.endswith("ForCausalLM") and not n.startswith("Auto")}
    names |= {n for n in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() if n in where}
    del transformers
    return {n: where[n] for n in sorted(names)}


def _source(module: str) -> str:
    import transformers

    path = Path(transformers.__file__).parent.joinpath(*module.split(".")).with_suffix(".py")
    return path.read_text() if path.exists() else ""


@functools.cache
def _config_classes() -> dict[str, list[Any]]:
    """{causal-LM class name: its config classes (a class may serve several model types)}, from the auto
    mappings (no modeling module imported)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, list[Any]] = {}
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        out.setdefault(name, []).append(CONFIG_MAPPING[model_type])
    return out


def _declares_expert_count(config_cls: Any) -> bool:
    fields: set[str] = set()
    for klass in config_cls.__mro__:
        fields |= set(getattr(klass, "__annotations__", {}))
    fields |= set(inspect.signature(config_cls.__init__).parameters)
    return any(_EXPERT_COUNT.match(f) for f in fields)


@functools.cache
def moe_classes() -> dict[str, str]:
    """{class name: why it counts as MoE} for every MoE causal LM class of the installed transformers."""
    found: dict[str, str] = {}
    configs = _config_classes()
    for name, module in _candidates().items():
        reasons = []
        if _EXPERTS_CLASS.search(_source(module)):
            reasons.append("experts module")
        config_classes = configs.get(name)
        if config_classes is None:  # not in the auto mapping: the class itself says
            import transformers

            config_classes = [getattr(transformers, name).config_class]
        if any(_declares_expert_count(c) for c in config_classes):
            reasons.append("expert count in config")
        if reasons:
            found[name] = " + ".join(reasons)
    return found


# Classes this module does not build yet (no tiny config found for them so far): not skipped by design, listed so
# that the tests and docs/families.md say so. Each is work left.
NOT_BUILT: dict[str, str] = {
    "Dots3NoteForCausalLM": "not built yet: its default config's per_layer_config names layers 3..44, which a "
                            "generic cut to 2 layers does not rewrite",
    "Qwen4ExpForCausalLM": "not built yet: its indexed-attention layers need indexer_* sizes the defaults leave None",
}


def skipped() -> dict[str, str]:
    """{class name: why it is not built} for the enumerated classes that are not."""
    return {name: why for name, why in {**_SKIP_REASONS, **NOT_BUILT}.items() if name in moe_classes()}


def built_classes() -> list[str]:
    """The enumerated MoE classes that are built and checked."""
    return [name for name in moe_classes() if name not in _SKIP_REASONS and name not in NOT_BUILT]


def _per_layer(fields: dict[str, Any], layers: int) -> tuple[dict[str, Any], int]:
    """Per-layer lists (as long as the default depth) cut to one layer of each kind, in order, at least two
    layers; returns the changed fields and the new depth."""
    lists = {k: v for k, v in fields.items() if isinstance(v, list) and len(v) == layers and layers > 2}
    keep: list[int] = []
    for values in lists.values():
        seen: set[str] = set()
        for i, v in enumerate(values):
            if repr(v) not in seen:
                seen.add(repr(v))
                if i not in keep:
                    keep.append(i)
    keep = sorted(keep)[:8]
    while len(keep) < 2:
        keep.append(max(keep, default=-1) + 1)
    return {k: [v[i] for i in keep] for k, v in lists.items()}, len(keep)


def moe_config(name: str, **overrides: Any) -> Any:
    """The tiny config of transformers class ``name`` (``overrides`` replace fields)."""
    import transformers

    config_cls = getattr(transformers, name).config_class
    fields = config_cls().to_dict()
    layers = fields.get("num_hidden_layers") or 0
    small = {k: v for k, v in GENERIC.items() if k in fields}
    cut, depth = _per_layer(fields, layers)
    small.update(cut)
    if "num_hidden_layers" in fields and cut:
        small["num_hidden_layers"] = depth
    if "kv_lora_rank" in fields:  # MLA: one latent for all heads; the rope part is head_dim wide
        small.update(num_key_value_heads=GENERIC["num_attention_heads"], head_dim=GENERIC["qk_rope_head_dim"])
        if "qk_head_dim" in fields:
            small["qk_head_dim"] = GENERIC["qk_rope_head_dim"] + GENERIC["qk_nope_head_dim"]
    for key, value in fields.items():  # every vocabulary (per-layer inputs, n-gram tables) at the tiny one's size
        if "vocab_size" in key and isinstance(value, int) and key not in small:
            small[key] = VOCAB
    small.update(OVERRIDES.get(name, {}))
    small.update(overrides)
    config = config_cls(**{k: v for k, v in fields.items() if k not in ("transformers_version", "architectures",
                                                                        "model_type")} | small)
    config.architectures = [name]
    return config


def build_moe_class(name: str, seed: int = 0, **overrides: Any) -> Any:
    """Transformers class ``name`` built tiny (float32, eval mode), its weights drawn from ``seed``."""
    import torch
    import transformers

    config = moe_config(name, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, name)(config)
    _nonzero_biases(model, seed)
    return model.eval()


def table(junit_xml: str) -> str:
    """A markdown table of what passes per class, from a JUnit XML report of tests/test_moe_classes.py."""
    import xml.etree.ElementTree as ET

    from tinkerq.worker.loading import support

    checks = {"test_lora_fb_equals_the_merged_weights_reference": "LoRA",
              "test_sampled_logprobs_of_a_lora_snapshot_equal_its_forward": "sampling",
              "test_full_session_step_equals_plain_adamw": "full",
              "test_a_layout_tinkerq_cannot_adapt_is_one_user_error_and_train_mlp_false_works": "LoRA"}
    cells: dict[str, dict[str, str]] = {name: {} for name in built_classes()}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test, _, param = case.get("name", "").partition("[")
        name = param.rstrip("]")
        if test not in checks or name not in cells:
            continue
        if test.startswith("test_a_layout"):
            outcome = "train_mlp refused: one user error"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "FAILS"
        else:
            outcome = "passes"
        if "refused" in cells[name].get(checks[test], "") or "refused" in outcome:  # both LoRA tests: keep both facts
            outcome = " ".join(sorted({outcome, cells[name].get(checks[test], outcome)}, key=len, reverse=True))
            outcome = outcome.replace("one user error passes", "one user error; train_mlp=False passes")
        cells[name][checks[test]] = outcome
    columns = {"full": "full", "lora": "LoRA", "sampling": "sampling"}  # (shard-group refusals: docs/families.md)
    for (name, path), _refusal in support.REFUSED.items():  # refused at creation (its own test), never served
        if name in cells and path in columns:
            cells[name][columns[path]] = "refused at creation"
    lines = ["| class | LoRA (attn, mlp + routed experts, unembed) | sampling (LoRA snapshot) | full fine-tuning |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {row.get('LoRA', '-')} | {row.get('sampling', '-')} | {row.get('full', '-')} |"
              for name, row in cells.items()]
    return "\n".join(lines)


def main() -> None:
    """Print the enumerated classes, built or skipped (``python -m tinkerq.recipes.moe_classes``); with
    ``--table REPORT.xml`` (pytest's ``--junitxml`` of tests/test_moe_classes.py), the table of what passes."""
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(table(sys.argv[2]))
        return
    found = moe_classes()
    print(f"{len(found)} MoE causal-LM classes in transformers {__import__('transformers').__version__}:")
    for name in built_classes():
        print(f"  built    {name} ({found[name]})")
    for name, why in skipped().items():
        print(f"  skipped  {name}: {why}")


if __name__ == "__main__":
    main()
