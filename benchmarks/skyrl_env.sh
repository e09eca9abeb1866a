#!/usr/bin/env bash
# Builds the virtual environment benchmarks/skyrl_side_by_side.py runs SkyRL's Tinker server from, outside the
# repository: Python >= 3.12 (SkyRL needs it; pyenv has one here), skyrl[tinker,jax] 0.4.0 with the official tinker SDK
# 0.25 it pins, aiohttp (imported by SkyRL, not declared), and a `uv` stand-in. The install pulls a CUDA torch wheel
# (~6.7 GB, unused by the JAX backend on the CPU): minutes.
#
#   bash benchmarks/skyrl_env.sh [VENV]        (default: $SKYRL_VENV, else /work/skyrl-venv)
#
# Why the stand-in: SkyRL's API process starts its engine as `uv run <the API's own uv flags> --extra tinker
# --extra jax -m skyrl.tinker.engine ...`, parsing its parent's command line, so the API must itself be started as
# `uv run -m skyrl.tinker.api ...`. The stand-in drops everything before `-m` and runs the module with this venv's
# python, as its child (not exec: the API reads the `uv run` line from its parent's command line).
set -euo pipefail
VENV="${1:-${SKYRL_VENV:-/work/skyrl-venv}}"
PY="${SKYRL_PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    # (a pyenv shim exists whether or not it can run: ask it)
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      PY="$candidate"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "no Python >= 3.12 found: set SKYRL_PYTHON" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install 'skyrl[tinker,jax]==0.4.0' 'tinker==0.25.0' aiohttp
mkdir -p "$VENV/uv-shim"
cat > "$VENV/uv-shim/uv" <<SHIM
#!/usr/bin/env bash
# uv stand-in for SkyRL: 'uv run [flags...] -m MODULE ARGS...' -> '$VENV/bin/python -m MODULE ARGS...'
while [ \$# -gt 0 ] && [ "\$1" != "-m" ]; do shift; done
[ \$# -gt 0 ] || { echo "uv stand-in: expected 'uv run ... -m MODULE ...'" >&2; exit 2; }
"$VENV/bin/python" "\$@"
SHIM
chmod +x "$VENV/uv-shim/uv"
"$VENV/bin/python" -c "import skyrl.tinker.api, tinker, aiohttp; print('skyrl venv ready: tinker', tinker.__version__)"
