"""Reading a JSON Schema into grammar nodes (meshlm/inference/constrained/json_schema.py): each
keyword becomes the node it describes, references resolve (to themselves too), and what cannot be
held to while decoding is refused by name and place."""

import pytest

from meshlm.errors import ConfigError
from meshlm.inference.constrained.json_schema import (ANY, ANY_ARRAY, ANY_OBJECT, ANY_STRING, ArrayNode, Choice,
                                                      Literal, NumberNode, ObjectNode, Reference, StringNode,
                                                      read_schema, resolved)


def test_types_become_their_nodes():
    assert read_schema({}, "s") is ANY and read_schema(True, "s") is ANY
    assert read_schema({"type": "string"}, "s") is ANY_STRING
    assert read_schema({"type": "object"}, "s") is ANY_OBJECT and read_schema({"type": "array"}, "s") is ANY_ARRAY
    assert read_schema({"type": "integer"}, "s").integer and not read_schema({"type": "number"}, "s").integer
    boolean = read_schema({"type": "boolean"}, "s")
    assert isinstance(boolean, Choice) and [option.text for option in boolean.options] == [b"true", b"false"]
    assert read_schema({"type": "null"}, "s").text == b"null"
    nullable = read_schema({"type": ["string", "null"]}, "s")
    assert nullable.options[0] is ANY_STRING and nullable.options[1].text == b"null"
    bounded = read_schema({"type": "string", "minLength": 2, "maxLength": 5}, "s")
    assert isinstance(bounded, StringNode) and (bounded.min_length, bounded.max_length) == (2, 5) and bounded.counted
    openapi_nullable = read_schema({"type": "integer", "nullable": True}, "s")
    assert isinstance(openapi_nullable.options[0], NumberNode) and openapi_nullable.options[1].text == b"null"


def test_objects_keep_their_keys_required_and_other_keys():
    node = read_schema({"type": "object", "properties": {"name": {"type": "string"}, "say \"hi\"": {}},
                        "required": ["name"]}, "s")
    assert isinstance(node, ObjectNode) and list(node.properties) == [b"name", b'say \\"hi\\"']
    assert node.required == frozenset({b"name"}) and node.additional is None  # strict by default
    extra = read_schema({"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}, "s")
    assert isinstance(extra.additional, NumberNode)
    assert read_schema({"properties": {"a": {}}, "additionalProperties": True}, "s").additional is ANY


def test_arrays_enums_consts_and_choices():
    array = read_schema({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"},
                         "minItems": 1, "maxItems": 3}, "s")
    assert isinstance(array, ArrayNode) and array.item(0) is ANY_STRING and array.item(2).integer
    assert array.item(3) is None and array.min_items == 1
    closed = read_schema({"prefixItems": [{}, {}], "items": False}, "s")
    assert closed.max_items == 2 and closed.item(2) is None
    enum = read_schema({"enum": ["a", 1, None, {"k": "é"}]}, "s")
    assert [option.text for option in enum.options] == [b'"a"', b"1", b"null", '{"k":"é"}'.encode()]
    assert read_schema({"const": [1, 2]}, "s").text == b"[1,2]"
    choice = read_schema({"anyOf": [{"type": "string"}, {"type": "integer"}], "description": "either"}, "s")
    assert isinstance(choice, Choice) and choice.options[0] is ANY_STRING
    assert read_schema({"allOf": [{"type": "string"}], "title": "t"}, "s") is ANY_STRING
    assert isinstance(read_schema({"oneOf": [{"const": 1}, {"const": 2}]}, "s"), Choice)


def test_references_resolve_also_to_themselves():
    tree = {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                                 "children": {"type": "array",
                                                                              "items": {"$ref": "#/$defs/node"}}},
                               "required": ["value"]}},
            "$ref": "#/$defs/node"}
    root = read_schema(tree, "s")
    assert isinstance(root, Reference) and isinstance(resolved(root), ObjectNode)
    children = resolved(root).properties[b"children"]
    assert resolved(children.items) is resolved(root)
    whole = read_schema({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}, "s")
    assert resolved(whole.properties[b"next"].options[0]) is whole
    assert isinstance(read_schema({"definitions": {"x": {"const": 1}}, "items": {"$ref": "#/definitions/x"}},
                                  "s").items.target, Literal)


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "^a+$"}, "s.properties.x: pattern bound values by their content"),
    ({"type": "integer", "minimum": 0}, "minimum bound values"),
    ({"type": "string", "format": "date"}, "format bound values"),
    ({"type": "strng"}, "type='strng' must be one of"),
    ({"anyOf": [{"type": "string"}], "type": "string"}, "anyOf is read only with nothing beside it"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf is read only as a list of one schema"),
    ({"$ref": "http://example.com/s.json"}, "follows only references into this schema"),
    ({"$ref": "#/$defs/missing"}, "names no schema in $defs"),
    ({"required": ["b"], "properties": {"a": {}}}, "required must list names that properties defines"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems=2 is below minItems=3"),
    ({"type": "string", "maxLength": -1}, "maxLength=-1 must be a whole number"),
    ({"frobnicate": 1}, "unknown keywords ['frobnicate']"),
    (False, "a schema must be an object or true"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "refers only to itself"),
])
def test_what_cannot_be_held_to_is_refused_by_name_and_place(schema, message):
    wrapped = {"type": "object", "properties": {"x": schema}} if message.startswith("s.properties") else schema
    with pytest.raises(ConfigError, match="^s") as error:
        read_schema(wrapped, "s")
    assert message in str(error.value)
