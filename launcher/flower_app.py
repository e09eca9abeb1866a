"""The Celery app Flower loads (`celery -A launcher.flower_app:app flower`).

Flower must speak the fleet's serializer: its remote-control commands (inspect, revoke) travel in it, and
workers accept nothing else. Tasks are not registered here; Flower learns them from the workers' events.

Flower 2.2 serves ``/metrics`` without its login (only ``/healthcheck`` should be open): task names, worker
names and rates are not for anyone who can reach the port, so it goes behind the same login here.
"""

from flower.views import monitor
from tornado import web

from tinkerq.celery_app import make_celery
from tinkerq.settings import Settings

monitor.Metrics.get = web.authenticated(monitor.Metrics.get)

app = make_celery(Settings.from_env())
