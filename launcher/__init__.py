"""The ``tinkerq`` command: starts workers and runs jobs. Sits on top of every other package."""
