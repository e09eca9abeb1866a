"""The Celery app Flower loads (`celery -A launcher.flower_app:app flower`).

Flower must speak the fleet's serializer: its remote-control commands (inspect, revoke) travel in it, and
workers accept nothing else. Tasks are not registered here; Flower learns them from the workers' events.
"""

from tinkerq.celery_app import make_celery
from tinkerq.settings import Settings

app = make_celery(Settings.from_env())
