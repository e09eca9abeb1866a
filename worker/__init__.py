"""The tinkerq worker: a Celery worker that holds a model and serves the training API (torch)."""
