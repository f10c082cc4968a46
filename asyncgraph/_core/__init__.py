"""The core: variables, Functions, the backward engine, grad modes, GradManager, Module and
the Executor protocol.

Private: users import these names from ``asyncgraph``, whose ``__init__`` re-exports
them. Imports from here go only to the standard library, anyio and the exception tree
(``asyncgraph._exceptions``); the import contracts in ``pyproject.toml`` check it for
every module of this package, present and future. Inside, imports go downwards but
for the circles ``tests/test_layers.py`` keeps, each with its reason (NOTE [Import
circles of the core]).
"""
