"""hotcold.structured: output constrained to JSON schemas and grammars, on the sparse and dense paths,
alone and batched (each sequence its own matcher), and bad schemas refused with the field named."""

from __future__ import annotations

import json
import re

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


# --- output that could never end: refused when compiled ------------------------------------------------

LINKED = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
ENDLESS = [
    (dict(grammar='root ::= "a" root'), "rule root has no finite derivation"),
    (dict(grammar='root ::= ("a" | "b") root'), "rule root has no finite derivation"),
    (dict(grammar='root ::= "b" | x\nx ::= "a" x'), "rule x has no finite derivation"),
    (dict(grammar='start: "a" start'), "rule start has no finite derivation"),
    (dict(grammar='root ::= x+\nx ::= y\ny ::= "(" x ")"'), "rules root, x, y have"),
    (dict(json_schema=LINKED), "the schema has no finite instance"),
    (
        dict(
            json_schema={
                "$defs": {"n": {"properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}},
                "$ref": "#/$defs/n",
            }
        ),
        "the schema has no finite instance",
    ),
    (
        dict(json_schema={"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
        "the schema has no finite instance",
    ),
    (
        dict(
            json_schema={
                "type": "object",
                "properties": {"optional": {"$ref": "#/$defs/n"}},
                "$defs": {"n": {"properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}},
            }
        ),
        "#/properties/optional has no finite instance",
    ),
    (dict(grammar='start: "<" %json ' + json.dumps(LINKED)), "%json schema's # has no finite instance"),
]


@pytest.mark.parametrize("kwargs, words", ENDLESS, ids=[f"endless{i}" for i in range(len(ENDLESS))])
def test_a_grammar_or_schema_without_a_finite_output_is_refused(kwargs, words):
    """These compile in llguidance and failed only at the first token (or ran to max_tokens)."""
    with pytest.raises(ValueError, match=re.escape(words)):
        structured.compile_constraint(field="grammar" if "grammar" in kwargs else "json_schema", **kwargs)


FINITE = [
    dict(grammar='root ::= "a" root?'),
    dict(grammar='root ::= "a" root | "b"'),
    dict(grammar='start: x\nx: "(" x ")" | "y"'),
    dict(grammar='root ::= item*\nitem ::= "[" item* "]"'),
    dict(json_schema={"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}}),
    dict(
        json_schema={
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"],
        }
    ),
    dict(json_schema={"anyOf": [{"type": "string"}, LINKED | {"$defs": {}}]}),
    dict(json_schema={"type": "object", "properties": {"a": False}}),
]


@pytest.mark.parametrize("kwargs", FINITE, ids=[f"finite{i}" for i in range(len(FINITE))])
def test_recursion_with_a_way_out_compiles(kwargs):
    assert structured.compile_constraint(**kwargs) is not None


def test_llama_cpp_grammars_compile():
    """The grammars llama.cpp ships (where its checkout is at hand) pass the finiteness check."""
    import glob
    import os

    folder = os.path.expanduser("~/.cache/hotcold-anchors/llama.cpp/grammars")
    files = sorted(glob.glob(f"{folder}/*.gbnf"))
    if not files:
        pytest.skip("no llama.cpp checkout")
    for path in files:
        with open(path, encoding="utf-8") as f:
            assert structured.compile_constraint(grammar=f.read()) is not None, path


def test_a_constraint_failing_during_generation_is_a_constraint_error(llm):
    """A grammar that gets past the compile-time check and fails later raises ConstraintError (a ValueError
    naming the field) with llguidance's first line, not its parser-state dump."""
    import llguidance

    bad = structured.Constraint(llguidance.grammar_from("grammar", 'root ::= "a" root'), "grammar")
    m = structured.Matcher(llm.tokenizer, bad)
    allowed = m.allowed().nonzero().flatten().tolist()
    with pytest.raises(structured.ConstraintError, match=r"^grammar: the grammar failed") as info:
        m.consume(allowed[0])
    assert info.value.field == "grammar" and "\n" not in str(info.value)


# --- objects take no keys beyond their properties unless additionalProperties says so -----------------


def accepts(llm, constraint, text: str) -> bool:
    m = structured._fresh_matcher(llm.tokenizer, constraint.grammar)
    ids = structured.lltokenizer(llm.tokenizer).tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


OPEN = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def test_properties_without_additional_properties_take_no_other_keys(llm):
    """llama.cpp's json-schema-to-grammar reading: `properties` and no `additionalProperties`: no extra keys
    (JSON Schema's default let a model add keys until max_tokens); nested objects too."""
    closed = structured.compile_constraint(json_schema=OPEN)
    assert accepts(llm, closed, '{"a": "x"}')
    assert not accepts(llm, closed, '{"a": "x", "b": "y"}')
    nested = structured.compile_constraint(json_schema={"type": "object", "properties": {"o": OPEN}})
    assert accepts(llm, nested, '{"o": {"a": "x"}}')
    assert not accepts(llm, nested, '{"o": {"a": "x", "z": 1}}')
    assert not accepts(llm, nested, '{"z": 1}')
    allowed = structured.compile_constraint(json_schema=OPEN | {"additionalProperties": True})
    assert accepts(llm, allowed, '{"a": "x", "b": "y"}')
    typed = structured.compile_constraint(json_schema=OPEN | {"additionalProperties": {"type": "integer"}})
    assert accepts(llm, typed, '{"a": "x", "b": 1}') and not accepts(llm, typed, '{"a": "x", "b": "y"}')
    anything = structured.compile_constraint(json_schema={"type": "object"})  # no properties: any object
    assert accepts(llm, anything, '{"b": "y"}')


def test_all_of_parts_combine_their_keys(llm):
    schema = {
        "allOf": [{"properties": {"a": {"type": "integer"}}}, {"$ref": "#/$defs/b"}],
        "$defs": {"b": {"properties": {"b": {"type": "integer"}}, "required": ["b"]}},
    }
    assert accepts(llm, structured.compile_constraint(json_schema=schema), '{"a": 1, "b": 2}')


def test_tool_arguments_take_no_other_keys(llm):
    """tool_choice="required": the function's parameters, a %json schema inside the call grammar, are read
    the same way."""
    from hotcold.server import tools

    _, grammar = tools.choice(
        [{"type": "function", "function": {"name": "f", "parameters": OPEN}}], "required"
    )
    c = structured.compile_constraint(grammar=grammar, field="tool_choice")
    assert accepts(llm, c, '<tool_call>{"name": "f", "arguments": {"a": "x"}}</tool_call>')
    assert not accepts(llm, c, '<tool_call>{"name": "f", "arguments": {"a": "x", "b": "y"}}</tool_call>')
