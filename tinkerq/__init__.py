"""tinkerq core: Tinker-compatible types, the wire format, settings, the Celery app. No torch here."""

from tinkerq import errors, types
from tinkerq.settings import Settings

__all__ = ["Settings", "errors", "types"]
__version__ = "0.1.0"
