"""The worker that serves remote backwards from a Redis queue (``asyncgraph worker``).

Private: its public names (``Worker``, ``WorkerConfig``, ``build_registry``,
``ConfigError``) are exported by ``asyncgraph.distributed``, their one home; the process
supervisor and the registry type are internal. Use the command (``asyncgraph worker --redis URL --queue grads --import
myapp.functions``), or embed a worker in a program::

    registry = build_registry(["myapp.functions"])
    await Worker(WorkerConfig(redis_url="redis://127.0.0.1:6379/0"), registry).serve()
"""

__all__: list[str] = []
