"""The HTTP gateway: the official tinker SDK talks to it; it talks to the fleet as a producer (docs/gateway.md)."""
