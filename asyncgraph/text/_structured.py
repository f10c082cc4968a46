"""Structured outputs: ``response_format=`` a JSON schema, a dataclass or a TypedDict.

An LLM call given ``response_format`` asks an OpenAI-compatible endpoint for JSON that
follows the schema (``response_format: {"type": "json_schema", ...}``), validates the
reply, and returns the parsed data (a dict) as its output. A reply that is not valid
JSON or does not follow the schema is sent back to the model with the validation
error, up to ``max_attempts`` in all; then ``StructuredOutputError`` names the schema
path that failed. The node's feedback still flows as text (the reply's JSON).

Whether the request carries ``response_format`` depends on the model (``ask_json``): a
model whose ``structured_outputs`` is True (the HTTP clients: OpenAI, Azure, vLLM and
llama.cpp's server, which turns the schema into a grammar; Anthropic, as a forced tool)
gets it; one whose ``structured_outputs`` is False (``SimulatedModel``, a server set so)
gets the schema in its prompt instead and its reply is parsed the same way; a server that
refuses ``response_format`` (HTTP 400 / 422) is asked again without it, and its model's
``structured_outputs`` becomes False, so later requests do not try again.

The validator covers the part of JSON Schema structured outputs use: ``type`` (object,
array, string, integer, number, boolean, null, or a list of them), ``properties``,
``required``, ``additionalProperties`` (false or a schema), ``items``, ``enum``,
``const``, ``anyOf``, ``minItems`` / ``maxItems``, ``minLength`` / ``maxLength``,
``minimum`` / ``maximum``. Other keywords are sent to the model but not checked here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from asyncgraph._exceptions import ModelRequestError, StructuredOutputError
from asyncgraph.models import BaseChatModel, ChatModel, Completion

__all__ = [
    "StructuredOutputError",
    "ask_json",
    "check_structured",
    "json_schema_of",
    "parse_structured",
    "schema_errors",
    "uses_structured",
]

logger = logging.getLogger("asyncgraph.text")

Structured = bool | Literal["auto"]
"""``structured=``: True (always send ``response_format``), False (never: the schema or
the tags go in the prompt) or ``"auto"`` (as the model says: ``structured_outputs``)."""

DEFAULT_STRUCTURED_ATTEMPTS = 3


_SCALARS: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a type hint (for dataclass and TypedDict fields)."""
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    if hint is Any:
        return {}
    origin = get_origin(hint)
    if origin is Literal:
        return {"enum": list(get_args(hint))}
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        args: list[Any] = [a for a in get_args(hint) if a is not Ellipsis]
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if origin in (dict, Mapping) or hint is dict:
        pair = get_args(hint)
        return {
            "type": "object",
            **({"additionalProperties": _type_schema(pair[1], where)} if len(pair) == 2 else {}),
        }
    if origin in (Union, types.UnionType):
        return {"anyOf": [_type_schema(a, where) for a in get_args(hint)]}
    if isinstance(hint, type) and (dataclasses.is_dataclass(hint) or _is_typeddict(hint)):
        return json_schema_of(hint)
    raise TypeError(
        f"response_format: cannot describe {where} of type {hint!r} as JSON; use str, int, "
        f"float, bool, None, list[...], dict[str, ...], Literal[...], unions, nested "
        f"dataclasses or TypedDicts, or pass a JSON schema dict"
    )


def _is_typeddict(cls: type) -> bool:
    return typing.is_typeddict(cls)


def json_schema_of(spec: Any) -> dict[str, Any]:
    """The JSON schema ``response_format`` stands for: a schema dict as is (checked to be
    JSON), or the object schema of a dataclass or TypedDict (every field, required unless
    it has a default / is ``NotRequired``; no other properties).

    Example::

        @dataclass
        class Answer:
            value: int
            reason: str = ""

        print(json_schema_of(Answer)["required"])    # ['value']
    """
    if isinstance(spec, Mapping):
        try:
            schema: dict[str, Any] = json.loads(json.dumps(dict(spec)))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"response_format: a JSON schema must be JSON data ({exc})") from None
        return schema
    if isinstance(spec, type) and dataclasses.is_dataclass(spec):
        hints = get_type_hints(spec)
        fields = dataclasses.fields(spec)
        required = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        properties = {f.name: _type_schema(hints[f.name], f"field {f.name!r}") for f in fields}
        return _object(spec.__name__, properties, required)
    if isinstance(spec, type) and _is_typeddict(spec):
        # include_extras keeps Required / NotRequired, which the class may not have
        # applied when its annotations are strings (``from __future__ import annotations``).
        hints = get_type_hints(spec, include_extras=True)
        declared = getattr(spec, "__required_keys__", frozenset(hints))
        properties, required = {}, []
        for key, hint in hints.items():
            origin = get_origin(hint)
            if origin in (typing.Required, typing.NotRequired):
                hint = get_args(hint)[0]
            if origin is typing.Required or (origin is not typing.NotRequired and key in declared):
                required.append(key)
            properties[key] = _type_schema(hint, f"key {key!r}")
        return _object(spec.__name__, properties, required)
    raise TypeError(
        f"response_format must be a JSON schema (a dict), a dataclass or a TypedDict, got "
        f"{spec!r:.80}"
    )


def _object(title: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "title": title,
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_JSON_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kind = _JSON_TYPES.get(name)
    return (
        kind is not None
        and isinstance(value, kind)
        and not (kind is not bool and isinstance(value, bool))
    )


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema``: ``"$.a[0].b: expected integer, got 'x'"`` lines,
    in document order (empty when it follows it)."""
    errors: list[str] = []
    _check(value, schema, path, errors)
    return errors


def _check(value: Any, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """Add to ``errors`` where ``value`` breaks ``schema`` (see ``schema_errors``)."""
    if "anyOf" in schema:
        _check_any_of(value, schema["anyOf"], path, errors)
        return
    if not _check_type(value, schema, path, errors):
        return  # nothing more to say of a value of another type
    _check_allowed(value, schema, path, errors)
    if isinstance(value, str):
        _check_string(value, schema, path, errors)
    if _is_type(value, "number"):
        _check_number(value, schema, path, errors)
    if isinstance(value, dict):
        _check_object(value, schema, path, errors)
    if isinstance(value, list):
        _check_array(value, schema, path, errors)


def _check_any_of(
    value: Any, options: Sequence[Mapping[str, Any]], path: str, errors: list[str]
) -> None:
    """``anyOf``: ``value`` follows one of the ``options`` at least."""
    if not any(not schema_errors(value, option, path) for option in options):
        errors.append(f"{path}: matches none of the {len(options)} allowed forms")


def _check_type(value: Any, schema: Mapping[str, Any], path: str, errors: list[str]) -> bool:
    """``type``: whether ``value`` is of the type (or one of the types) ``schema`` allows."""
    wanted = schema.get("type")
    if wanted is None:
        return True
    names = wanted if isinstance(wanted, list) else [wanted]
    if any(_is_type(value, n) for n in names):
        return True
    errors.append(f"{path}: expected {' or '.join(names)}, got {_short(value)}")
    return False


def _check_allowed(value: Any, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """``const`` and ``enum``."""
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {_short(value)}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: expected one of {schema['enum']!r}, got {_short(value)}")


def _check_string(value: str, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """``minLength`` and ``maxLength``."""
    if len(value) < schema.get("minLength", 0):
        errors.append(f"{path}: shorter than {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']} characters")


def _check_number(value: Any, schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """``minimum`` and ``maximum``."""
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")


def _check_object(
    value: dict[Any, Any], schema: Mapping[str, Any], path: str, errors: list[str]
) -> None:
    """``required``, then each property in the value's order: checked against its schema
    in ``properties``, or against ``additionalProperties`` (false: not allowed)."""
    properties = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in value:
            errors.append(f"{path}: missing required property {key!r}")
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            _check(item, properties[key], f"{path}.{key}", errors)
        elif extra is False:
            errors.append(f"{path}: unexpected property {key!r}")
        elif isinstance(extra, Mapping):
            _check(item, extra, f"{path}.{key}", errors)


def _check_array(value: list[Any], schema: Mapping[str, Any], path: str, errors: list[str]) -> None:
    """``minItems`` and ``maxItems``, then each item against ``items``."""
    if len(value) < schema.get("minItems", 0):
        errors.append(f"{path}: fewer than {schema['minItems']} items")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{path}: more than {schema['maxItems']} items")
    items = schema.get("items")
    if isinstance(items, Mapping):
        for i, item in enumerate(value):
            _check(item, items, f"{path}[{i}]", errors)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_structured(reply: str, schema: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """The reply's JSON data and the schema errors (``["$: not valid JSON: ..."]`` when it
    does not parse). A reply fenced in a markdown code block is read inside the fence."""
    text = reply.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, [f"$: not valid JSON: {exc}"]
    return data, schema_errors(data, schema)


def response_format_param(schema: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """The OpenAI ``response_format`` request parameter for ``schema`` (``strict``: ask
    OpenAI to follow it exactly; the schema must then list every property as required
    and forbid others)."""
    name = str(schema.get("title") or "response")
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64] or "response"
    spec: dict[str, Any] = {"name": name, "schema": dict(schema)}
    if strict:
        spec["strict"] = True
    return {"type": "json_schema", "json_schema": spec}


def check_structured(value: Any, where: str) -> Structured:
    """``value`` if it is True, False or ``"auto"``; else a ``ValueError`` naming ``where``."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[no-any-return]
    raise ValueError(f"{where}: structured must be True, False or 'auto', got {value!r}")


def uses_structured(model: ChatModel, structured: Structured, *, unknown: bool = True) -> bool:
    """Whether a request to ``model`` carries ``response_format``: ``structured`` if True or
    False; with ``"auto"``, the model's ``structured_outputs``, or ``unknown`` for a
    ``ChatModel`` that does not say."""
    if structured != "auto":
        return bool(structured)
    return bool(getattr(model, "structured_outputs", unknown))


def schema_instruction(schema: Mapping[str, Any]) -> str:
    """What a prompt says when the schema cannot be sent as ``response_format``."""
    return (
        "Reply with only a JSON object (no other text, no code fence) that follows this "
        f"JSON schema:\n{json.dumps(dict(schema), ensure_ascii=False)}"
    )


def with_instruction(messages: Sequence[Mapping[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` added at the end of the last one."""
    out = [dict(m) for m in messages]
    content = out[-1].get("content")
    if isinstance(content, list):
        out[-1]["content"] = [*content, {"type": "text", "text": text}]
    else:
        out[-1]["content"] = f"{content}\n\n{text}"
    return out


async def ask_json(
    model: ChatModel,
    messages: Sequence[Mapping[str, Any]],
    params: Mapping[str, Any],
    schema: Mapping[str, Any],
    *,
    structured: Structured = "auto",
    fallback: Sequence[Mapping[str, Any]] | None = None,
    strict: bool = False,
    usable: Callable[[str], bool] | None = None,
) -> tuple[Completion, bool]:
    """One request for a reply that follows ``schema``; returns the completion and whether
    it was sent with ``response_format``.

    With ``response_format`` (``uses_structured``): ``messages`` as they are. Without:
    ``fallback`` (default: ``messages`` with the schema in the last one). A server that
    refuses ``response_format`` (HTTP 400 / 422) under ``structured="auto"`` is asked
    again without it, once; when that is answered, the model's ``structured_outputs``
    becomes False (a warning on the ``asyncgraph.text`` logger says so), and when it is
    refused too, its error is raised and the model keeps its structured outputs.
    ``usable(text)``: only replies it accepts enter a ``BaseChatModel``'s response cache.
    """
    plain = (
        fallback if fallback is not None else with_instruction(messages, schema_instruction(schema))
    )
    if not uses_structured(model, structured):
        return await _send(model, plain, params, usable), False
    with_format = {**params, "response_format": response_format_param(schema, strict=strict)}
    try:
        return await _send(model, messages, with_format, usable), True
    except ModelRequestError as exc:
        if structured != "auto" or exc.status_code not in (400, 422):
            raise
        refusal = exc
    # The same request without response_format: if the server takes it, the refusal was
    # of response_format, and the model is asked without it from now on; if not, the 400
    # was about something else, and the model keeps its structured outputs.
    completion = await _send(model, plain, params, usable)
    logger.warning(
        "%s refused response_format (%s); asking with the format in the prompt from now on",
        getattr(model, "name", model),
        refusal.server_message or refusal,
    )
    try:
        model.structured_outputs = False  # type: ignore[attr-defined]
    except AttributeError:  # an object that does not take attributes
        pass
    return completion, False


async def _send(
    model: ChatModel,
    messages: Sequence[Mapping[str, Any]],
    params: Mapping[str, Any],
    usable: Callable[[str], bool] | None,
) -> Completion:
    if usable is not None and isinstance(model, BaseChatModel):
        return await model.complete(messages, cache_if=lambda c: usable(c.text), **params)
    return await model.complete(messages, **params)


def retry_message(errors: list[str]) -> dict[str, Any]:
    """The request to try again, saying what was wrong with the last reply."""
    listed = "\n".join(f"- {e}" for e in errors[:20])
    return {
        "role": "user",
        "content": (
            "Your reply does not follow the required JSON schema:\n"
            f"{listed}\nReply again with only the corrected JSON."
        ),
    }
