"""OpenAI's ``response_format`` read into a grammar: JSON mode and structured outputs.

    {"type": "text"}                                   no constraint (the default)
    {"type": "json_object"}                            the reply is one JSON object, any keys
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
                                                       the reply is one JSON document of the schema

(OpenAI's chat completions API; vLLM and SGLang take the same field and hold decoding to it.)
The schema is read by ``json_schema.read_schema``: what it cannot hold to is refused by name. A
``strict`` of false changes nothing: decoding is held to the schema either way.
"""

from __future__ import annotations

import json

from meshlm.errors import ConfigError
from meshlm.inference.constrained.json_schema import ANY_OBJECT, Node, read_schema

FIELD = "response_format"


def response_format_grammar(response_format) -> tuple[str, Node] | None:
    """(a key naming the grammar, its node) of a ``response_format`` value, None for text; ConfigError
    names the part of the field that is wrong."""
    if response_format is None or response_format == {"type": "text"}:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return "json_object", ANY_OBJECT
    if kind != "json_schema":
        raise ConfigError(f"{FIELD} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or {{\"type\": "
                          f"\"json_schema\", \"json_schema\": {{\"schema\": {{...}}}}}}, not {response_format!r}.")
    described = response_format.get("json_schema")
    if not isinstance(described, dict) or "schema" not in described:
        raise ConfigError(f"{FIELD}.json_schema must be an object holding the JSON Schema as \"schema\" (and a "
                          "\"name\").")
    schema = described["schema"]
    node = read_schema(schema, f"{FIELD}.json_schema.schema")
    return "schema " + json.dumps(schema, sort_keys=True), node


__all__ = ["response_format_grammar"]
