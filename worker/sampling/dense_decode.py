"""A decode step and a prefill for the plain dense decoders (Llama, Qwen2, Qwen3) without the model's wrapping.

A Hugging Face forward of one token per row spends most of a small model's step outside its products: building the
4-D attention mask from the 2-D one (masking_utils), the rotary table, per-layer and per-module wrappers (keyword
deprecation, gradient checkpointing, output records) and the cache object's bookkeeping. This step runs the same
computation from the model's own parts: its embedding, rotary module, norms, projections, MLPs and head are called
as modules (so LoRA routing hooks on any of them apply: worker/lora/routing.py), the rotary product is the model
module's own ``apply_rotary_pos_emb``, attention is the function the model would call
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``) with the boolean padding mask the model would build, and
the keys/values are concatenated as ``DynamicLayer.update`` does. So its logits and cache are bitwise those of
``model(...)`` (tests/test_sampling_engine.py compares them); it only leaves out Python. The prefill
(:meth:`DenseDecode.prefill`) is the same for a whole unpadded prompt per row: the model's own causal SDPA call (no
mask: the model gives SDPA none when nothing is padded), its cache class filled as its attention layers fill it.
A prompt prefill of a small model costs about one decode step this way instead of several, which counts when
concurrent requests arrive with prompts of many lengths (each length its own prefill, worker/sampling/forwards.py).

Used only where that equivalence is known: exactly these classes on the CPU (where the tests run; a GPU may pick
another SDPA kernel for the same mask, untested), every layer full attention (no sliding window), SDPA attention,
a plain key/value cache per layer, no hook on (or replaced forward of) the model itself. Anything else takes the
model's own forward.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_CLASSES = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)


class DenseDecode:
    """One decode step of ``model`` (see the module doc); build it with :func:`dense_decode`."""

    def __init__(self, model: Any, attend: Callable[..., Any], rotary: Callable[..., Any]) -> None:
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.attend = attend
        self.rotary = rotary

    def applies(self) -> bool:
        """False while the model's or its decoder stack's forward must run: a hook on them (tests that pause a
        step, offloading hooks) or a forward replaced on the instance. The step then takes the model's own."""
        return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)
                       for m in (self.model, self.inner))

    def __call__(self, last: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 state: list[list[torch.Tensor | None]]) -> tuple[torch.Tensor, list[list[torch.Tensor | None]]]:
        """Feed ``last`` (B,) at positions ``pos`` (B,); ``mask`` (B, T+1) is 1 where a cache column (and the fed
        token, last) is real; ``state`` per layer [keys, values] (B, Hkv, T, D). Returns the next-token logits
        (B, V) float32 and the new per-layer [keys, values] (B, Hkv, T+1, D)."""
        x = self.inner.embed_tokens(last[:, None])  # (B, 1, H)
        cos, sin = self.inner.rotary_emb(x, pos[:, None])  # (B, 1, D) each
        # The model's SDPA mask for one query: None when no row has padding (it then lets SDPA skip the mask),
        # else True where a column may be attended, (B, 1, 1, T+1).
        attn_mask = None if bool(mask.all()) else mask.bool()[:, None, None, :]
        new_state: list[list[torch.Tensor | None]] = []
        for layer, (keys, values) in zip(self.layers, state, strict=True):
            assert keys is not None and values is not None  # a prefilled attention layer holds both

            def cat(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor = keys,
                    values: torch.Tensor = values) -> tuple[torch.Tensor, torch.Tensor]:
                # as DynamicLayer.update: the new position appended to the cache
                grown = torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
                new_state.append(list(grown))
                return grown

            x = self._layer(layer, x, cos, sin, attn_mask, cat)
        logits = self.model.lm_head(self.inner.norm(x))  # (B, 1, V)
        return logits[:, -1].float(), new_state

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
        """Feed the prompts ``ids`` (N, P), none padded, as ``model(input_ids=ids, use_cache=True,
        logits_to_keep=1)`` does. Returns the logits after each prompt (N, V) float32 and the cache the model would
        have returned (keys/values (N, Hkv, P, D) per layer)."""
        x = self.inner.embed_tokens(ids)  # (N, P, H)
        cache = DynamicCache(config=self.model.config)
        cos, sin = self.inner.rotary_emb(x, torch.arange(ids.shape[1], device=ids.device)[None])  # (1, P, D) each
        for i, layer in enumerate(self.layers):
            # causal: no mask (P > 1), as the model gives SDPA none when nothing is padded; the cache filled as the
            # model's attention layers fill it
            x = self._layer(layer, x, cos, sin, None, functools.partial(cache.update, layer_idx=i))
        logits = self.model.lm_head(self.inner.norm(x)[:, -1:])  # (N, 1, V): the model's logits_to_keep=1 slice
        return logits[:, -1].float(), cache

    def _layer(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None,
               store: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One decoder layer over ``x`` (B, T, H) at rotary ``cos``/``sin``: ``store(k, v)`` ((B, Hkv, T, D) each)
        adds the layer's new keys and values to its cache and returns all of them, which the queries attend to."""
        b, t = x.shape[:2]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (b, t, -1, attn.head_dim)
        q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: a norm over each head's features, before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, H(kv), T, D)
        keys, values = store(k, v.transpose(1, 2))
        out, _ = self.attend(attn, q, keys, values, attn_mask, dropout=0.0, scaling=attn.scaling,
                             sliding_window=None)  # (B, T, H, D)
        x = x + attn.o_proj(out.reshape(b, t, -1).contiguous())
        return x + layer.mlp(layer.post_attention_layernorm(x))


def dense_decode(model: Any) -> DenseDecode | None:
    """The fast decode step for ``model``, or None where the model's own forward must run (see the module doc)."""
    if type(model) not in _CLASSES or model.config._attn_implementation != "sdpa":
        return None
    if next(model.parameters()).device.type != "cpu":  # the equivalence is tested on the CPU only so far
        return None
    layers = list(model.model.layers)
    if any(getattr(layer.self_attn, "sliding_window", None) is not None for layer in layers):
        return None
    if any(type(layer.self_attn).forward is not _attention_forward(type(model)) for layer in layers):
        return None  # the attention module was replaced (a patched or quantised model): not the code above
    rotary = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", None)
    if rotary is None:
        return None
    return DenseDecode(model, ALL_ATTENTION_FUNCTIONS["sdpa"], rotary)


def _attention_forward(cls: type) -> Any:
    module = sys.modules[cls.__module__]
    name = cls.__name__.replace("ForCausalLM", "Attention")
    return getattr(getattr(module, name, None), "forward", None)
