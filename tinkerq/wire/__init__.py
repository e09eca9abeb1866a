"""The wire format: the only place that knows how bytes on Redis look.

* :mod:`tinkerq.wire.codec`: msgpack with numpy arrays as an ExtType (dtype allow-list, never pickle),
  and the kombu serializer Celery is restricted to.
* :mod:`tinkerq.wire.messages`: requests and results as msgpack maps, to and from :mod:`tinkerq.types`.
* :mod:`tinkerq.wire.claimcheck`: large payloads stored as raw Redis values referenced from the message.
"""
