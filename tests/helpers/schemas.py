"""JSON schemas the structured-output tests constrain replies to: nested objects, arrays
with item bounds, enums, bounded numbers, patterns and length limits, optional fields."""

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "number", "minimum": -5, "maximum": 5},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
            }
        },
        "required": ["user"],
    },
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{3}$"},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["x", "y", "z"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["tags"],
    },
    {"type": "integer", "minimum": 10, "maximum": 99},
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "xy": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        },
        "required": ["kind", "xy"],
    },
    {"type": "boolean"},
]
