"""LoRA sessions: adapters over one shared frozen base, trained in mixed-tenant passes (docs/lora.md)."""
