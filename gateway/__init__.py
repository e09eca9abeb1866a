"""The HTTP gateway: the official tinker SDK talks to it; it talks to the fleet as a producer (docs/gateway.md)."""

# Installed as tinkerq.gateway (pyproject.toml's package-dir). `import gateway` from a checkout's root would find
# this folder under a name another distribution may own, as a second copy: say which name to use instead.
if __name__ != "tinkerq.gateway":
    raise ImportError(f"tinkerq's gateway package is tinkerq.gateway: import it by that name, not as {__name__!r}")
