"""The tinkerq worker: a Celery worker that holds a model and serves the training API (torch)."""

# Installed as tinkerq.worker (pyproject.toml's package-dir). `import worker` from a checkout's root would find
# this folder under a name another distribution may own, as a second copy: say which name to use instead.
if __name__ != "tinkerq.worker":
    raise ImportError(f"tinkerq's worker package is tinkerq.worker: import it by that name, not as {__name__!r}")
