"""Models larger than one device: N worker processes each hold a shard (torch.distributed + FSDP2)."""
