"""The ``tinkerq`` command: starts workers and runs jobs. Sits on top of every other package."""

# Installed as tinkerq.launcher (pyproject.toml's package-dir). `import launcher` from a checkout's root would find
# this folder under a name another distribution may own, as a second copy: say which name to use instead.
if __name__ != "tinkerq.launcher":
    raise ImportError(f"tinkerq's launcher package is tinkerq.launcher: import it by that name, not as {__name__!r}")
