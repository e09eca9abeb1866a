"""Demo recipes for tinkerq: a tiny model, a tokenizer and a small SFT data set."""

# Installed as tinkerq.recipes (pyproject.toml's package-dir). `import recipes` from a checkout's root would find
# this folder under a name another distribution may own, as a second copy: say which name to use instead.
if __name__ != "tinkerq.recipes":
    raise ImportError(f"tinkerq's recipes package is tinkerq.recipes: import it by that name, not as {__name__!r}")
