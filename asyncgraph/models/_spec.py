"""``parse_model_spec``: a model from a command-line string such as ``openai:gpt-4o-mini``."""

from __future__ import annotations

from typing import Any

from asyncgraph.models._base import BaseChatModel
from asyncgraph.models._openai import OpenAIChat
from asyncgraph.models._simulated import SimulatedModel

__all__ = ["parse_model_spec"]

_FORMS = "'simulated', 'simulated:LATENCY_S' or 'openai:MODEL' (e.g. 'openai:gpt-4o-mini')"


def parse_model_spec(
    spec: str, *, base_url: str | None = None, api_key: str | None = None, **options: Any
) -> BaseChatModel:
    """Build the model ``spec`` names.

    - ``"simulated"`` / ``"simulated:0.05"``: a ``SimulatedModel`` (optionally with that
      ``latency_s``); ``base_url`` / ``api_key`` must not be given;
    - ``"openai:MODEL"``: ``OpenAIChat(MODEL, base_url=base_url, api_key=api_key)`` for any
      OpenAI-compatible server.

    ``options`` go to the model's constructor (``retry=``, ``rate_limit=``, ``cache=``,
    ``pricing=``, ``timeout_s=``, ...). Raises ``ValueError`` for any other spec.
    """
    provider, sep, rest = spec.strip().partition(":")
    provider = provider.lower()
    if provider == "simulated":
        if base_url is not None or api_key is not None:
            raise ValueError(
                f"model spec {spec!r} is the offline simulated model: it takes no base_url or "
                "api_key (use 'openai:MODEL' for a server)"
            )
        if sep:
            try:
                options.setdefault("latency_s", float(rest))
            except ValueError:
                raise ValueError(
                    f"bad model spec {spec!r}: the simulated latency must be a number of "
                    f"seconds; expected {_FORMS}"
                ) from None
        return SimulatedModel(**options)
    if provider == "openai" and rest.strip():
        return OpenAIChat(rest.strip(), base_url=base_url, api_key=api_key, **options)
    raise ValueError(f"bad model spec {spec!r}: expected {_FORMS}")
