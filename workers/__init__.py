"""The deployable worker service: ``python -m workers`` from a checkout or a container.

Settings come from the environment (``workers.settings``); the functions the
fleet serves by default are in ``workers.functions``. The service is a thin
shell over ``asyncgraph worker`` (supervision, draining, health and metrics all
live in ``asyncgraph.distributed.worker``, so a plain ``pip install asyncgraph`` has them too).
This folder is not installed into site-packages: it ships as files (deploy/).
"""
