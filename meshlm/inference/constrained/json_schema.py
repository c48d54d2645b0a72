"""A JSON Schema read into the grammar nodes the recognizer walks (``json_recognizer.py``).

Constrained decoding needs, at every byte of a reply, the set of bytes that can still lead to a
document the schema accepts. That is a property of the schema's *shape* -- which keys an object
may hold, what each value's type is, how long a string may grow -- so the schema is read once
into a small tree of nodes, each saying what one JSON value may be:

    ANY            any JSON value (``true``, ``{}``, a schema without type keywords)
    ObjectNode     ``{...}``: known properties (each its own node), which are required, and the
                   node of any other key's value (None: no other keys)
    ArrayNode      ``[...]``: the node of its items (``prefixItems`` first), min/max count
    StringNode     ``"..."``: min/max length in characters
    NumberNode     a JSON number, or an integer
    Literal        exact bytes: ``true``, ``null``, a ``const`` or one ``enum`` value as JSON
    Choice         one of several nodes (``anyOf``, ``oneOf``, a list of types, ``enum``)
    Sequence       nodes one after another (a tool call's JSON and the marker after it)
    Reference      a ``$ref`` into ``$defs`` / ``definitions``, resolved after reading, so a
                   schema may refer to itself (a tree of comments, say)

What is read is the part of JSON Schema that structured-output APIs accept (OpenAI's strict
structured outputs, vLLM's and SGLang's guided decoding): ``type`` (one or a list),
``properties``, ``required``, ``additionalProperties``, ``items``, ``prefixItems``,
``minItems``/``maxItems``, ``minLength``/``maxLength``, ``enum``, ``const``, ``anyOf``,
``oneOf`` (read as ``anyOf``: which options a value matches is not counted), ``allOf`` of one
schema and local ``$ref``; annotations (``title``, ``description``, ``default``, ...) are
skipped. An object schema with ``properties`` and no ``additionalProperties`` allows no other
keys (OpenAI's strict mode; a generating model should not invent fields), one without
``properties`` allows any. Keywords that bound values by content -- ``pattern``, ``format``,
``minimum``, ``multipleOf`` and the like -- cannot be held to byte by byte here and are refused
by name (``ConfigError``) rather than silently not enforced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from meshlm.errors import ConfigError


class Node:
    """What one JSON value may be (the module docstring lists the kinds). Nodes compare by
    identity: the recognizer's states hold them and are hashed at every byte."""

    __hash__ = object.__hash__


@dataclass(eq=False)
class AnyValue(Node):
    """Any JSON value."""


@dataclass(eq=False)
class ObjectNode(Node):
    properties: dict[bytes, Node]
    """Each known key, spelt as it appears between the quotes (JSON-escaped), -> its value's node."""
    required: frozenset[bytes] = frozenset()
    additional: Node | None = None
    """The node of a key not in ``properties``; None: no other keys."""
    _prefixes: dict[bytes, tuple[bytes, ...]] | None = field(default=None, repr=False)

    def keys_starting(self, spelt: bytes) -> tuple[bytes, ...]:
        """The known keys that begin with ``spelt`` (a table of every prefix, made on first use)."""
        if self._prefixes is None:
            prefixes: dict[bytes, list[bytes]] = {}
            for name in self.properties:
                for end in range(len(name) + 1):
                    prefixes.setdefault(name[:end], []).append(name)
            self._prefixes = {prefix: tuple(names) for prefix, names in prefixes.items()}
        return self._prefixes.get(spelt, ())


@dataclass(eq=False)
class ArrayNode(Node):
    items: Node | None
    """The node of the items after ``prefix``; None: no items after them."""
    prefix: tuple[Node, ...] = ()
    """The nodes of the first items, in order (``prefixItems``)."""
    min_items: int = 0
    max_items: int | None = None

    def item(self, index: int) -> Node | None:
        """The node of item ``index`` (None: the array may not hold it)."""
        if self.max_items is not None and index >= self.max_items:
            return None
        return self.prefix[index] if index < len(self.prefix) else self.items


@dataclass(eq=False)
class StringNode(Node):
    min_length: int = 0
    max_length: int | None = None

    @property
    def counted(self) -> bool:
        """Whether the recognizer must count this string's characters."""
        return self.min_length > 0 or self.max_length is not None


@dataclass(eq=False)
class NumberNode(Node):
    integer: bool = False


@dataclass(eq=False)
class Literal(Node):
    text: bytes


@dataclass(eq=False)
class Choice(Node):
    options: tuple[Node, ...]


@dataclass(eq=False)
class Sequence(Node):
    parts: tuple[Node, ...]


@dataclass(eq=False)
class Reference(Node):
    name: str
    target: Node | None = field(default=None, repr=False)


ANY = AnyValue()
ANY_OBJECT = ObjectNode({}, frozenset(), ANY)
ANY_ARRAY = ArrayNode(ANY)
ANY_STRING = StringNode()
ANY_NUMBER = NumberNode()
TRUE, FALSE, NULL = Literal(b"true"), Literal(b"false"), Literal(b"null")

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions", "strict", "nullable"})
"""Keywords that describe a value without constraining it (skipped; ``nullable`` is read)."""
UNENFORCEABLE = frozenset({"pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                           "multipleOf", "patternProperties", "propertyNames", "minProperties", "maxProperties",
                           "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                           "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
                           "contentEncoding", "contentMediaType"})
"""Keywords that bound a value by its content, which decoding cannot hold to byte by byte."""
KNOWN = frozenset({"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
                   "maxItems", "minLength", "maxLength", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"})
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def json_bytes(value) -> bytes:
    """``value`` as compact JSON, UTF-8 (how a ``const`` or ``enum`` value must be written)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def key_spelling(name: str) -> bytes:
    """A property name as it is written between its quotes."""
    return json_bytes(name)[1:-1]


class SchemaReader:
    """Reads one schema (``read_schema``); ``where`` names it in errors (``response_format.json_schema``)."""

    def __init__(self, root: dict | bool, where: str):
        self.root, self.where = root, where
        self.references: list[Reference] = []

    def fail(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}{path}: {message}")

    def read(self, schema, path: str = "") -> Node:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise self.fail(path, f"a schema must be an object or true, not {schema!r}.")
        unknown = set(schema) - KNOWN - ANNOTATIONS
        refused = sorted(unknown & UNENFORCEABLE)
        if refused:
            raise self.fail(path, f"{', '.join(refused)} bound values by their content, which meshlm cannot hold "
                                  "decoding to; remove them (and check the values after).")
        if unknown:
            raise self.fail(path, f"unknown keywords {sorted(unknown)}; meshlm reads {', '.join(sorted(KNOWN))}.")
        node = self._read_kinds(schema, path)
        return Choice((node, NULL)) if schema.get("nullable") is True else node

    def _read_kinds(self, schema: dict, path: str) -> Node:
        if "$ref" in schema:
            return self._reference(schema, path)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or len(schema) - len(ANNOTATIONS & set(schema)) != 1:
                raise self.fail(path, "allOf is read only as a list of one schema with nothing beside it; merge "
                                      "its schemas into one.")
            return self.read(parts[0], f"{path}.allOf[0]")
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema:
                options = schema[combinator]
                if not isinstance(options, list) or not options:
                    raise self.fail(path, f"{combinator} must be a non-empty list of schemas.")
                if set(schema) - ANNOTATIONS != {combinator}:
                    raise self.fail(path, f"{combinator} is read only with nothing beside it; move the other "
                                          "keywords into each of its options.")
                return Choice(tuple(self.read(option, f"{path}.{combinator}[{i}]")
                                    for i, option in enumerate(options)))
        if "const" in schema:
            return Literal(json_bytes(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.fail(path, "enum must be a non-empty list of values.")
            return Choice(tuple(Literal(json_bytes(value)) for value in values))
        kinds = schema.get("type")
        if kinds is None:
            kinds = ("object" if "properties" in schema or "additionalProperties" in schema else
                     "array" if "items" in schema or "prefixItems" in schema else
                     "string" if "minLength" in schema or "maxLength" in schema else None)
            if kinds is None:
                return ANY
        listed = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(listed, list) or not listed or any(kind not in TYPES for kind in listed):
            raise self.fail(path, f"type={kinds!r} must be one of {', '.join(TYPES)} or a list of them.")
        nodes = tuple(self._typed(kind, schema, path) for kind in dict.fromkeys(listed))
        return nodes[0] if len(nodes) == 1 else Choice(nodes)

    def _typed(self, kind: str, schema: dict, path: str) -> Node:
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            return self._array(schema, path)
        if kind == "string":
            low, high = self._bounds(schema, "minLength", "maxLength", path)
            return ANY_STRING if (low, high) == (0, None) else StringNode(low, high)
        if kind in ("number", "integer"):
            return NumberNode(integer=kind == "integer")
        return Choice((TRUE, FALSE)) if kind == "boolean" else NULL

    def _object(self, schema: dict, path: str) -> Node:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise self.fail(path, "properties must be an object of name -> schema.")
        required = schema.get("required", [])
        if not isinstance(required, list) or any(name not in properties for name in required):
            raise self.fail(path, "required must list names that properties defines.")
        additional = schema.get("additionalProperties", not properties)
        additional_node = (None if additional is False else
                           self.read(additional, f"{path}.additionalProperties"))
        if not properties and additional_node is ANY:
            return ANY_OBJECT
        return ObjectNode({key_spelling(name): self.read(value, f"{path}.properties.{name}")
                           for name, value in properties.items()},
                          frozenset(key_spelling(name) for name in required), additional_node)

    def _array(self, schema: dict, path: str) -> Node:
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise self.fail(path, "prefixItems must be a list of schemas.")
        items = schema.get("items", True)
        items_node = None if items is False else self.read(items, f"{path}.items")
        low, high = self._bounds(schema, "minItems", "maxItems", path)
        if items_node is None:
            high = len(prefix) if high is None else min(high, len(prefix))
        if (items_node is ANY and not prefix and (low, high) == (0, None)):
            return ANY_ARRAY
        return ArrayNode(items_node, tuple(self.read(item, f"{path}.prefixItems[{i}]") for i, item in enumerate(prefix)),
                         low, high)

    def _bounds(self, schema: dict, low_key: str, high_key: str, path: str) -> tuple[int, int | None]:
        low, high = schema.get(low_key, 0), schema.get(high_key)
        for key, value in ((low_key, low), (high_key, high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise self.fail(path, f"{key}={value!r} must be a whole number >= 0.")
        if high is not None and high < low:
            raise self.fail(path, f"{high_key}={high} is below {low_key}={low}.")
        return low, high

    def _reference(self, schema: dict, path: str) -> Node:
        target = schema["$ref"]
        if set(schema) - ANNOTATIONS != {"$ref"}:
            raise self.fail(path, "$ref is read only with nothing beside it; move the other keywords into the "
                                  "schema it names.")
        if not isinstance(target, str) or not (target == "#" or target.startswith(("#/$defs/", "#/definitions/"))):
            raise self.fail(path, f"$ref={target!r}: meshlm follows only references into this schema "
                                  "(#, #/$defs/NAME or #/definitions/NAME).")
        reference = Reference(target)
        self.references.append(reference)
        return reference

    def resolve(self, root_node: Node) -> None:
        """Point every ``Reference`` at the node of the schema it names (read once per name)."""
        read: dict[str, Node] = {"#": root_node}
        pending = list(self.references)
        while pending:
            reference = pending.pop()
            if reference.name not in read:
                _, section, name = reference.name.split("/", 2)
                definitions = self.root.get(section) if isinstance(self.root, dict) else None
                if not isinstance(definitions, dict) or name not in definitions:
                    raise self.fail("", f"$ref={reference.name!r} names no schema in {section}.")
                before = len(self.references)
                read[reference.name] = self.read(definitions[name], f".{section}.{name}")
                pending += self.references[before:]
            reference.target = read[reference.name]
        for reference in self.references:  # a $ref naming only another $ref cannot be a value
            seen = set()
            node = reference
            while isinstance(node, Reference):
                if id(node) in seen:
                    raise self.fail("", f"$ref={reference.name!r} refers only to itself.")
                seen.add(id(node))
                node = node.target


def read_schema(schema, where: str) -> Node:
    """The grammar node of a JSON Schema (module docstring); ConfigError names ``where`` and the keyword."""
    reader = SchemaReader(schema, where)
    node = reader.read(schema)
    reader.resolve(node)
    return node


def resolved(node: Node) -> Node:
    """``node`` with references followed."""
    while isinstance(node, Reference):
        node = node.target
    return node


__all__ = ["ANY", "ANY_ARRAY", "ANY_NUMBER", "ANY_OBJECT", "ANY_STRING", "AnyValue", "ArrayNode", "Choice", "Literal",
           "Node", "NumberNode", "ObjectNode", "Reference", "Sequence", "StringNode", "json_bytes", "key_spelling",
           "read_schema", "resolved"]
