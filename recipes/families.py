"""Tiny random models of every family Tinker users train, built offline from a transformers config.

Each is a real Hugging Face causal LM (``save_pretrained`` / ``from_pretrained``) with the family's own
structure kept at toy width: MoE families keep several routed experts (and shared experts, dense-then-MoE
layers, grouped routing where the family has them), hybrid families keep at least one layer of each kind
(full attention, sliding window, gated-delta-net linear attention, Mamba-2), DeepSeek-V3 keeps MLA's
compressed q/kv projections. Nothing is downloaded: the weights come from a fixed seed, the tokenizer is
the demo's character tokenizer (its 50 ids fit every vocabulary here).

``tinkerq families build DIR`` writes them all (``--family NAME`` for one); ``benchmarks/families.py`` and
``tests/test_families*.py`` use :func:`build_family`. ``REAL_SMALL`` holds reduced-depth, real-width shapes
for the GPU benchmark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 101

# One config per family: (transformers model class name, config class name, fields).
_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, head_dim=8,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the demo tokenizer's ids

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_COMMON, num_hidden_layers=2, intermediate_size=64)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_COMMON, num_hidden_layers=2, intermediate_size=64,
                                                      tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])),  # layer 0 dense, layer 1 MoE
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=64, layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        _COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        _COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, routed_scaling_factor=2.5)),
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig", dict(
        _COMMON, num_hidden_layers=4, layers_block_type=["mamba", "moe", "attention", "mlp"],
        intermediate_size=64, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
        conv_kernel=4, expand=1, chunk_size=8, use_mamba_kernels=False)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_COMMON, num_hidden_layers=2, intermediate_size=64,
                                                            sliding_window=4)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_COMMON, num_hidden_layers=2, intermediate_size=64)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(_COMMON, num_hidden_layers=2, intermediate_size=64)),
}

# Today's lineup (tinker-cookbook 0.6.1's model list: docs/families.md), by the config's model_type, whose tiny
# config is recipes/moe_classes.py's generic one for the class (the class checks of tests/test_moe_classes.py run on
# the same config): Inkling and Inkling-2 (their text models), DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention),
# DeepSeek-V4 (compressed attention), Kimi-Linear, Qwen3-Next.
GENERIC_TINY: dict[str, str] = {
    "inkling": "InklingForCausalLM",
    "inkling2": "Inkling2ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
FAMILIES.update({family: (cls, "", {}) for family, cls in GENERIC_TINY.items()})
# Kimi-K2.5 / K2.6: DeepSeek-V3's text model inside a vision-language checkpoint (``kimi_k25``) that transformers has
# no causal-LM class for; the worker serves its text model (worker/loading/models.py, text_model_class).
FAMILIES["kimi_k25"] = ("DeepseekV3ForCausalLM", "DeepseekV3Config", FAMILIES["deepseek_v3"][2])

MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss", "deepseek_v3", "nemotron_h", *GENERIC_TINY, "kimi_k25")

# Reduced-depth, real-width shapes for the GPU benchmark (benchmarks/families.py --shape real-small): the
# widths, heads and expert counts of the named checkpoints, with 4 layers. (DeepSeek-V3 is left out: one of its
# MoE layers alone holds 11B parameters.) Other fields are the tiny config's.
REAL_SMALL: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3-30B-A3B", dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=4,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        intermediate_size=6144, mlp_only_layers=[])),  # every layer MoE
    "gpt_oss": ("gpt-oss-20b", dict(vocab_size=201088, hidden_size=2880, num_hidden_layers=4, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"] * 2)),
    "llama": ("Llama-3.1-8B", dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=4, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336)),
}

# Full-size configs (meta device only: parameter counts per rank, docs/families.md).
REAL_FULL: dict[str, tuple[str, str, dict[str, Any]]] = {
    "Qwen3-30B-A3B": ("qwen3_moe", "Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, intermediate_size=6144)),
    "gpt-oss-20b": ("gpt_oss", "GptOssConfig", dict(
        vocab_size=201088, hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)),
    "DeepSeek-V3": ("deepseek_v3", "DeepseekV3Config", {}),  # the config class's defaults are DeepSeek-V3's
    "Qwen3.5-35B-A3B": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", {}),  # likewise
    "Qwen3.5-9B": ("qwen3_5", "Qwen3_5TextConfig", {}),  # likewise
}


def family_config(family: str, **overrides: Any) -> Any:
    """The transformers config of ``family``'s tiny model (``overrides`` replace fields)."""
    import transformers

    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if family in GENERIC_TINY:
        from tinkerq.recipes.moe_classes import moe_config

        return moe_config(GENERIC_TINY[family], **overrides)
    _, config_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**fields, **overrides})
    config.architectures = [FAMILIES[family][0]]
    return config


def build_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """``family``'s tiny model in memory (float32, eval mode), its weights drawn from ``seed``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][0])(family_config(family, **overrides))
    _nonzero_biases(model, seed)
    return model.eval()


def _nonzero_biases(model: Any, seed: int) -> None:
    """transformers initialises some parameters to zeros or ones (expert biases, gpt-oss sinks, the routers'
    correction bias): draw them, so tests see what a trained checkpoint has.

    Persistent buffers are part of the saved weights too (DeepSeek-V3's and Nemotron-H's
    ``e_score_correction_bias``: nonzero in the real checkpoints, it steers routing): floating ones that
    transformers leaves all zeros or all ones are drawn as well (after the parameters, so the parameters' values
    do not depend on them), so a save that drops a buffer changes the model's logprobs. Non-persistent buffers
    (rotary ``inv_freq``, Gemma's ``embed_scale``) are computed from the config and never saved; integer, boolean
    and mask buffers are structure, not weights: both are left as they are."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("_bias") or leaf == "sinks":
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            elif p.dim() >= 2 and float(p.abs().max()) == 0.0:  # an all-zero matrix (a router's weight)
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        saved = model.state_dict(keep_vars=True).keys()  # parameters and persistent buffers
        experts = getattr(model.config, "n_routed_experts", None)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid") and isinstance(experts, int) and not b.any():
                # DeepSeek-V4's hash routing table (token id -> its top-k experts, read from the checkpoint; all
                # zeros as built): each token a distinct draw of experts, so the hash layers route like a real one
                b.copy_(torch.stack([torch.randperm(experts, generator=generator)[:b.shape[1]]
                                     for _ in range(b.shape[0])]))
                continue
            if name not in saved or not b.is_floating_point() or b.numel() == 0 or "mask" in name:
                continue
            # 0.05: enough to move routing (a dropped DeepSeek-V3 bias moves logprobs by ~0.05); at 0.1 seed 0 puts a
            # routing choice within Adam's rounding of a tie, which the LoRA reference tests cannot tell from a bug.
            if float(b.abs().max()) == 0.0:
                b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
            elif bool((b == 1).all()):
                b.copy_(1 + torch.randn(b.shape, generator=generator) * 0.05)


# Qwen3.5 checkpoints are vision-language ones (Qwen3_5[Moe]ForConditionalGeneration, the text model under
# model.language_model.*); AutoModelForCausalLM loads their text model. A tiny vision tower keeps that layout.
_VISION_LANGUAGE = {"qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config"),
                    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig"),
                    "kimi_k25": ("Kimi_K25ForConditionalGeneration", "Kimi_K25Config"),
                    "inkling2": ("Inkling2ForConditionalGeneration", "Inkling2Config")}
# The families whose checkpoints transformers maps to no causal-LM class (a vision-language class only): a worker
# serves their text model (worker/loading/models.py, text_model_class); a shard group refuses them at start.
TEXT_OF_VISION_LANGUAGE = ("kimi_k25", "inkling2")
_TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                    temporal_patch_size=1, spatial_merge_size=1)
# Kimi-K2.5's MoonViT tower and projector, tiny (its config's own field names)
_TINY_VISION_OF = {"kimi_k25": (dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                     patch_size=2), dict(projection_hidden_size=16)),
                   "inkling2": (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     patch_size=2, posemb_grid_size=4, projection_hidden_dim=32, text_hidden_size=32),
                                {})}


def build_family(family: str, out_dir: Path, seed: int = 0, **overrides: Any) -> Path:
    """``family``'s tiny model and the demo tokenizer, saved with ``save_pretrained`` in ``out_dir``, in the
    layout the family's real checkpoints have."""
    import torch
    import transformers

    from tinkerq.recipes.demo_model import build_tokenizer

    out_dir = Path(out_dir)
    if family in _VISION_LANGUAGE:
        model_cls, config_cls = _VISION_LANGUAGE[family]
        text = family_config(family, **overrides).to_dict()
        vision, extra = _TINY_VISION_OF.get(family, (_TINY_VISION, {}))
        config = getattr(transformers, config_cls)(text_config=text, vision_config=vision,
                                                   tie_word_embeddings=text.get("tie_word_embeddings", False), **extra)
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
        _nonzero_biases(model, seed)
    else:
        model = build_model(family, seed, **overrides)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir
