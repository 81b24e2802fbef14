"""JSON schemas the structured-output tests decode with: small and bounded (strings have a
maxLength, integers a range, arrays maxItems, objects no additional properties), so a sampling
model always closes them within a few dozen tokens."""

_OBJ = {"type": "object", "additionalProperties": False}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {**_OBJ, "properties": properties,
            "required": list(properties) if required is None else required}


_INT9 = {"type": "integer", "minimum": 0, "maximum": 9}

SCHEMAS: dict[str, dict] = {
    "person": _obj({"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99}}),
    "enum_field": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "int_array_2_4": {"type": "array", "items": _INT9, "minItems": 2, "maxItems": 4},
    "nested_object": _obj({"user": _obj({
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}})}),
    "zip_pattern": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "nullable_string": _obj({"nick": {"anyOf": [{"type": "string", "maxLength": 6},
                                                {"type": "null"}]}}),
    "nullable_int_type_list": {"type": ["integer", "null"], "minimum": 0, "maximum": 50},
    "boolean_field": _obj({"ok": {"type": "boolean"}}),
    "const_field": _obj({"version": {"const": "1.0"}, "n": _INT9}),
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2,
                         "items": _obj({"k": {"enum": ["a", "b"]}, "v": {"type": "boolean"}})},
    "tagged_union": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                    "maximum": 9}})]},
    "mixed_enum": {"enum": ["alpha", "beta", 3, None]},
    "refs": {**_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
             "$defs": {"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                      "y": {"type": "integer", "minimum": -9, "maximum": 9}})}},
    "optional_property": _obj({"a": _INT9, "b": {"type": "string", "maxLength": 3}},
                              required=["a"]),
    "string_length": {"type": "string", "minLength": 2, "maxLength": 5},
    "exact_count_enum_array": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                               "minItems": 3, "maxItems": 3},
    "nested_arrays": {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "array", "items": _INT9, "maxItems": 2}},
    "date_pattern": _obj({"date": {"type": "string",
                                   "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"}}),
    "nullable_object": _obj({"addr": {"anyOf": [_obj({"city": {"type": "string",
                                                               "maxLength": 6}}),
                                                {"type": "null"}]}}),
    "exclusive_bounds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "enum_and_bool_array": _obj({"level": {"enum": [1, 2, 3]},
                                 "flags": {"type": "array", "items": {"type": "boolean"},
                                           "minItems": 1, "maxItems": 3}}),
    "nullable_enum_in_array": {"type": "array", "minItems": 0, "maxItems": 3,
                               "items": {"anyOf": [{"enum": ["on", "off"]}, {"type": "null"}]}},
}
