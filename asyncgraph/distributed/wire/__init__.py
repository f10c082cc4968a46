"""What crosses a process boundary: msgpack codec, message schema, signing, key names.

Private modules, shared by ``asyncgraph.distributed.RedisExecutor`` (the client)
and ``asyncgraph.distributed.worker`` (the server):

- ``_keys``: every Redis key, stream, group and stream-entry field name;
- ``_codec``: msgpack with size, length and depth limits (numpy arrays as an
  extension type with a dtype whitelist; never pickle);
- ``_limits``: those limits (``Limits``), apart from msgpack, so that a worker's
  options are read (``--help``) without loading it;
- ``_schema``: the versioned task, reply and cancel messages, each field declared once
  (key, type, bound, presence) on its class and validated on receipt;
- ``_fields``: what reads, writes and documents a record from those declarations;
- ``_signing``: HMAC-SHA256 signatures with a shared secret, of messages (``sign``,
  ``verify``) and of the records the fleet keeps in Redis (``seal``, ``unseal``);
- ``_payload``: a Function's remote identity and how its ctx and gradients travel.
"""

__all__: list[str] = []  # the fleet's insides: ``Limits``, its one user-facing type, is
# exported by ``asyncgraph.distributed``
