"""hotcold.structured: output constrained to JSON schemas and grammars, on the sparse and dense paths,
alone and batched (each sequence its own matcher), and bad schemas refused with the field named."""

from __future__ import annotations

import json

import pytest

import hotcold
from hotcold import structured

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["point", "ok"],
        "additionalProperties": False,
    },
]


def check(value, schema: dict, where: str = "$") -> None:
    """The subset of JSON Schema these tests use, checked by hand (jsonschema is not installed)."""
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), f"{where}: {value!r} is not an object"
        for key in schema.get("required", []):
            assert key in value, f"{where}: {key} missing"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{where}: extra keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                check(value[key], sub, f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{where}: {value!r} is not an array"
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), where
        for i, item in enumerate(value):
            check(item, schema.get("items", {}), f"{where}[{i}]")
    elif kind in ("integer", "number"):
        types = (int,) if kind == "integer" else (int, float)
        assert isinstance(value, types) and not isinstance(value, bool), f"{where}: {value!r}"
        assert schema.get("minimum", -float("inf")) <= value <= schema.get("maximum", float("inf")), where
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30), where
    elif kind == "boolean":
        assert isinstance(value, bool), where


@pytest.fixture(scope="module")
def llm():
    return hotcold.load(device="cpu", threads=2)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "numbers", "enum", "nested"])
def test_output_parses_and_validates_for_several_seeds(llm, schema):
    for seed in range(2):
        text = llm.generate("Once upon a time", max_tokens=60, temperature=0.9, seed=seed, json_schema=schema)
        assert llm.last_stats.generated_tokens < 60, f"seed {seed}: ran out of tokens: {text!r}"
        check(json.loads(text), schema)


def test_json_object_and_schema_text(llm):
    """json_object: any object; cut by max_tokens it is an unfinished one ("length"), else it parses."""
    chunks = list(llm.stream_chunks("Hello", max_tokens=30, temperature=0.7, seed=1, json_object=True))
    text = "".join(c.text for c in chunks)
    assert text.startswith("{")
    if chunks[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert json.loads(llm.generate("Hi", max_tokens=60, json_schema=json.dumps(PERSON)))["age"] >= 0


def test_grammar_forces_an_exact_string_and_ends(llm):
    chunks = list(
        llm.stream_chunks("Jesus wept", max_tokens=50, temperature=1.0, grammar='root ::= "hello world"')
    )
    assert "".join(c.text for c in chunks) == "hello world"
    assert chunks[-1].finish_reason == "stop"
    lark = 'start: "yes" | "no"'
    assert llm.generate("Is it?", max_tokens=10, temperature=1.0, seed=3, grammar=lark) in ("yes", "no")


def test_gbnf_small_language(llm):
    """Arithmetic over digits, as llama.cpp's grammars/arithmetic.gbnf writes it."""
    gbnf = r"""
root  ::= expr
expr  ::= term ([-+*/] term)*
term  ::= num | "(" expr ")"
num   ::= [0-9]{1,3}
"""
    import re

    for seed in range(3):
        text = llm.generate("Compute:", max_tokens=30, temperature=0.9, seed=seed, grammar=gbnf)
        assert re.fullmatch(r"[0-9()+\-*/]+", text), text
        assert text.count("(") >= text.count(")")


def test_batch_with_different_schemas_equals_each_alone(llm):
    prompts = ["In the beginning", "And God said", "Blessed are", "Jesus wept"]
    schemas = [SCHEMAS[0], None, SCHEMAS[1], SCHEMAS[3]]
    kwargs = dict(max_tokens=60, temperature=0.8)
    batch = llm.generate_batch(prompts, seed=[1, 2, 3, 4], json_schema=schemas, **kwargs)
    alone = [
        llm.generate(p, seed=s, json_schema=j, **kwargs) for p, s, j in zip(prompts, [1, 2, 3, 4], schemas)
    ]
    assert batch == alone
    for text, schema in zip(batch, schemas):
        if schema is not None:
            check(json.loads(text), schema)
    # the unconstrained one is what it is without any constraint in the batch
    assert batch[1] == llm.generate(prompts[1], seed=2, **kwargs)


def test_dense_path():
    dense = hotcold.load(device="cpu", threads=2, dense=True)
    for seed in range(2):
        text = dense.generate("Once", max_tokens=80, temperature=0.9, seed=seed, json_schema=PERSON)
        check(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(json_schema={"type": "nonsense"}), "json_schema"),
        (dict(json_schema="{not json"), "json_schema"),
        (dict(json_schema=[1, 2]), "json_schema"),
        (dict(grammar="root ::= undefined_rule"), "grammar"),
        (dict(grammar="root ::= ("), "grammar"),
        (dict(grammar=""), "grammar"),
        (dict(grammar='root ::= "' + "a" * (structured.MAX_SPEC_CHARS + 1) + '"'), "limit"),
        (dict(grammar='root ::= "a"', json_object=True), "one of"),
    ],
)
def test_bad_specs_are_value_errors_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        structured.compile_constraint(**kwargs)


def test_field_name_in_the_message():
    with pytest.raises(ValueError, match=r"^response_format\.json_schema"):
        structured.compile_constraint(json_schema={"type": "nonsense"}, field="response_format.json_schema")


def test_vocabulary_handed_over_once(llm):
    assert structured.lltokenizer(llm.tokenizer) is structured.lltokenizer(llm.tokenizer)
