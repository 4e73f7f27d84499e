"""OpenAI's `response_format` -> the JSON Schema the engine constrains decoding with.

    {"type": "text"}                                   no constraint (the default)
    {"type": "json_object"}                            any JSON object: the schema {"type": "object"}
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true,
                                            "description": ...}}

The shape is checked here (a ValueError whose message names the member; the request schema reports it
under `param: "response_format"`); whether the schema itself can be honoured is the grammar library's
call (`engine.structured_output.StructuredOutputs.compile`, run by `Completions._start` once the
quota admitted the call and before anything is queued; a refusal is refunded). `strict` is accepted either way: the output always follows the schema
(as vLLM does), and OpenAI's strict-mode subset rules are not imposed on the schema. `/v1/completions`
takes the same field (as vLLM's does).
"""

from __future__ import annotations

import re

JSON_OBJECT_SCHEMA = {"type": "object"}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
_TYPES = ("text", "json_object", "json_schema")


def parse_response_format(value: dict | None) -> dict | None:
    """The JSON Schema `value` asks for, or None for plain text. Raises ValueError for a malformed one."""
    if value is None:
        return None
    kind = value.get("type")
    if kind not in _TYPES:
        raise ValueError(f"response_format.type must be one of {', '.join(map(repr, _TYPES))}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with `name` and `schema` when type is "
                         "'json_schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError("response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -, "
                         f"got {name!r}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema.schema must be a JSON Schema object, got "
                         f"{type(schema).__name__ if schema is not None else 'nothing'}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError(f"response_format.json_schema.strict must be a boolean, got {spec['strict']!r}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ValueError("response_format.json_schema.description must be a string")
    return schema
