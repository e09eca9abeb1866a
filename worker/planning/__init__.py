"""planning: see docs/architecture.md (The worker core)."""
