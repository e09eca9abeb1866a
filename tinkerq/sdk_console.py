"""Point the official tinker SDK's console links at a tinkerq gateway's console (gateway/console.py).

The SDK builds every console link (``TrainingClient.get_console_url``, ``ServiceClient.get_console_url``,
``SaveWeightsResponse.get_console_url``, the ``tinker auth`` pages) from one module constant,
``tinker.lib.console_urls._CONSOLE_BASE_URL``, read when a link is made; it has no setting and nothing in
``/client/config`` changes it. The gateway serves the same paths under ``<gateway>/console``, so setting that
constant is all it takes: ``use_gateway_console()`` once, after ``import tinker``, in the user's program.
"""

from __future__ import annotations

import os

from tinkerq.errors import ValidationError


def use_gateway_console(gateway_url: str | None = None) -> str:
    """Make the SDK's console links open ``<gateway_url>/console`` (default: ``TINKER_BASE_URL``, where the SDK
    sends its requests); returns that base. Imports the SDK (not a dependency of tinkerq's core) only here."""
    base = gateway_url or os.environ.get("TINKER_BASE_URL")
    if not base or not base.startswith(("http://", "https://")):
        raise ValidationError(f"the gateway's URL must be http(s)://host:port, got {base!r}: pass it, or set "
                              f"TINKER_BASE_URL as for the SDK")
    from tinker.lib import console_urls

    if not hasattr(console_urls, "_CONSOLE_BASE_URL"):  # a later SDK builds its links otherwise: say so, loudly
        raise ValidationError("this tinker SDK builds its console links differently (no "
                              "tinker.lib.console_urls._CONSOLE_BASE_URL); open <gateway>/console yourself")
    console = base.rstrip("/") + "/console"
    console_urls._CONSOLE_BASE_URL = console  # the SDK's one seam for it (see the module docstring)
    return console
