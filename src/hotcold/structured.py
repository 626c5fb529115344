"""Constrained decoding: output that follows a JSON schema or a grammar, through llguidance (the
constraint library llama.cpp uses; the `structured` extra). The one module that imports it.

    grammar = compile_constraint(json_schema=schema)        # ValueError naming the field if it is bad
    matcher = Matcher(tokenizer, grammar)                   # one per sequence
    matcher.start()                                         # the first mask, computed off the thread
    logits = matcher.apply(logits)                          # -inf outside the grammar  [V]
    matcher.consume(token)                                  # and the next mask, while the next forward runs

The tokenizer's vocabulary goes to llguidance once per `Tokenizer` (token bytes, control tokens marked
with a 0xFF byte as llama.cpp marks them, every end-of-generation token as an end token). A mask is
computed on a worker thread as soon as the previous token is consumed, so it overlaps the next forward
(llguidance drops the GIL while it computes, and so do the model's C kernels and torch ops); `apply`
waits for it only if it is not ready yet.

Grammars: a JSON schema (`json_schema`, a dict or JSON text), any JSON object (`json_object`), or a
grammar in llama.cpp's GBNF or in Lark (`grammar`, llguidance tells them apart). Limits per request:
`MAX_SPEC_CHARS` of grammar or schema text, and llguidance's parser limits (lexer fuel, grammar size),
which bound the compile time and the work per token.

Schemas are read as llama.cpp's json-schema-to-grammar reads them: an object that lists `properties` and
does not give `additionalProperties` has no other keys (JSON Schema's own default, any key, let a model
add keys until max_tokens; OpenAI's strict mode forbids them too); give `"additionalProperties": true` to
allow them. This holds for `json_schema`, and for `%json` schemas inside a grammar (tool arguments).
A grammar with a rule that has no finite derivation (`root ::= "a" root`) or a schema with a subschema
that has no finite instance (a required property that refers back to it) is refused here, with the rule
or the subschema named (hotcold.schema_rules). A constraint that still fails during generation raises
ConstraintError, naming its field."""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.grammar_rules import close_inline_schemas, endless_rules
from hotcold.schema_rules import closed_objects, infinite_subschemas
from hotcold.tokenizer.types import CONTROL, USER_DEFINED
from hotcold.tokenizer.vocab import Tokenizer

MAX_SPEC_CHARS = 64 * 1024  # schema or grammar text per request
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=100_000)
# JSON on one line with a space after "," and ":" (a schema's "x-guidance" may say otherwise): flexible
# whitespace lets a small model wander into endless newlines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hotcold-mask")


def _llg():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - the extra is in the test install
        raise ValueError("structured output needs llguidance: pip install 'hotcold[structured]'") from exc
    return llguidance


class ConstraintError(ValueError):
    """A constraint failed during generation: the request's grammar or schema (`field`) caused it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Constraint:
    """A compiled grammar (llguidance's grammar text) and the request field it came from."""

    grammar: str
    field: str


def compile_constraint(
    *,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    grammar: str | None = None,
    field: str | None = None,
) -> Constraint | None:
    """The constraint for at most one of the three (None when none is given). ValueError, with the
    field's name (`field`, else the argument's) and llguidance's message, for a bad schema or grammar, and
    for one whose output could never end. Objects with `properties` and no `additionalProperties` take no
    other keys, as llama.cpp's converter reads them (see the module doc)."""
    given = [n for n, v in (("json_schema", json_schema), ("grammar", grammar)) if v is not None]
    if json_object:
        given.append("json_object")
    if len(given) > 1:
        raise ValueError(f"give one of json_schema, grammar, json_object, not {' and '.join(given)}")
    if not given:
        return None
    name = field or given[0]
    llg = _llg()
    try:
        if json_object:
            text = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_OPTIONS)
        elif json_schema is not None:
            if isinstance(json_schema, str):
                _check_size(name, json_schema)
                json_schema = json.loads(json_schema)
            if not isinstance(json_schema, dict | bool):
                raise ValueError(f"a JSON schema is an object, got {type(json_schema).__name__}")
            _check_size(name, json.dumps(json_schema))
            json_schema = closed_objects(json_schema)
            _check_finite_schema(json_schema)
            text = llg.LLMatcher.grammar_from_json_schema(json.dumps(json_schema), JSON_OPTIONS)
        else:
            if not isinstance(grammar, str) or not grammar.strip():
                raise ValueError("the grammar is empty")
            _check_size(name, grammar)
            text = close_inline_schemas(llg.grammar_from("grammar", grammar))
            _check_finite_grammar(text, gbnf="::=" in grammar)
        error = llg.LLMatcher.validate_grammar(text, None, limits=_limits())
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from exc
    except Exception as exc:  # llguidance raises plain exceptions for some parse errors
        raise ValueError(f"{name}: {exc}") from exc
    if error and not error.startswith("WARNING"):
        raise ValueError(f"{name}: {error}")
    return Constraint(text, name)


def _check_finite_schema(schema) -> None:
    bad = infinite_subschemas(schema)
    if bad:
        where = "the schema" if bad[0] == "#" else bad[0]
        raise ValueError(
            f"{where} has no finite instance: a required property or item of it leads back to it"
            " through $ref, so the output could never end"
        )


def _check_finite_grammar(lark: str, *, gbnf: bool) -> None:
    rules, schemas = endless_rules(lark)
    if rules:
        names = ", ".join("root" if gbnf and r == "start" else r for r in rules)
        which = f"rule {names} has" if len(rules) == 1 else f"rules {names} have"
        raise ValueError(
            f"{which} no finite derivation (each alternative leads back to a rule without one), so the"
            " output could never end"
        )
    if schemas:
        raise ValueError(
            f"the %json schema's {schemas[0]} has no finite instance: a required property or item of it"
            " leads back to it through $ref, so the output could never end"
        )


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{len(text)} characters, more than the limit of {MAX_SPEC_CHARS}")


def _limits():
    return _llg().LLParserLimits(**_LIMITS)


# ------------------------------------------------------------------------------------------------
# The vocabulary, handed over once per tokenizer
# ------------------------------------------------------------------------------------------------

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


class _Vocabulary:
    """llguidance's generic byte-token interface over a hotcold Tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokens = [_token_bytes(tokenizer, i) for i in range(tokenizer.n_vocab)]
        eog = sorted(tokenizer.eog_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        self.eos_token_id = eog[0] if eog else 0
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if b.startswith(b"\xff")]
        self.eog = eog
        self._tokenizer = tokenizer
        self._by_bytes: dict[bytes, int] | None = None  # bytes -> token, built on first need
        self._longest = 1

    def __call__(self, text: str) -> list[int]:  # llguidance passes str (a bytes call raises)
        """Token ids whose bytes are exactly `text`'s: llguidance tokenizes forced pieces of output
        with it. The tokenizer's own encoding when it gives those bytes back (SentencePiece without its
        space prefix), else the longest vocabulary match at each byte (a vocabulary that strips extra
        whitespace encodes " " as nothing)."""
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")
        tok = self._tokenizer
        out: list[int] = []
        if tok._spm is not None:
            tok._spm.encode(text, out, prefix=False)
        else:
            out = tok.encode(text, add_bos=False, parse_special=False)
        data = text.encode("utf-8")
        if b"".join(self.tokens[i] for i in out) == data:
            return out
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        if self._by_bytes is None:
            self._by_bytes = {}
            for i in reversed(range(len(self.tokens))):  # the lowest id wins among equal bytes
                if self.tokens[i] and not self.tokens[i].startswith(b"\xff"):
                    self._by_bytes[self.tokens[i]] = i
            self._longest = max(map(len, self._by_bytes), default=1)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._by_bytes.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                raise ValueError(f"the vocabulary has no token for byte {data[i]:#04x}")
        return out


def _token_bytes(tokenizer: Tokenizer, i: int) -> bytes:
    kind = tokenizer.token_types[i]
    piece = tokenizer.tokens[i]
    # llama.cpp's rule (llguidance.llamacpp): control tokens, and user-defined ones spelled <...>, are
    # special tokens, marked by a leading 0xFF (never a byte of UTF-8 text)
    if kind == CONTROL or (kind == USER_DEFINED and piece.startswith("<") and piece.endswith(">")):
        return b"\xff" + piece.encode("utf-8")
    return tokenizer.token_bytes(i)


def lltokenizer(tokenizer: Tokenizer):
    """llguidance's tokenizer for `tokenizer`, built on first use and kept with it (~0.1-1 s once)."""
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(tokenizer)
        if found is None:
            llg = _llg()
            vocab = _Vocabulary(tokenizer)
            found = llg.LLTokenizer(
                llg.TokenizerWrapper(vocab), n_vocab=tokenizer.n_vocab, eos_token=vocab.eog or None
            )
            _TOKENIZERS[tokenizer] = found
        return found


# ------------------------------------------------------------------------------------------------
# One sequence's matcher
# ------------------------------------------------------------------------------------------------

_MATCHERS: OrderedDict = OrderedDict()  # (tokenizer id, grammar) -> a fresh matcher to copy
_MATCHERS_LOCK = threading.Lock()
_MATCHER_CACHE = 32


def _fresh_matcher(tokenizer: Tokenizer, grammar: str):
    """A new matcher: a copy of a cached one for a grammar seen before (the lexer is not rebuilt)."""
    key = (id(lltokenizer(tokenizer)), grammar)
    with _MATCHERS_LOCK:
        template = _MATCHERS.get(key)
        if template is not None:
            _MATCHERS.move_to_end(key)
            return template.deep_copy()
    llg = _llg()
    template = llg.LLMatcher(lltokenizer(tokenizer), grammar, log_level=0, limits=_limits())
    if template.is_error():
        raise ValueError(template.get_error())
    with _MATCHERS_LOCK:
        _MATCHERS[key] = template
        while len(_MATCHERS) > _MATCHER_CACHE:
            _MATCHERS.popitem(last=False)
    return template.deep_copy()


def prepare(tokenizer: Tokenizer, constraint: Constraint) -> None:
    """Build the constraint's matcher for `tokenizer` now (its lexer; later matchers copy it), so a bad
    grammar fails here with a ValueError and the batch thread only copies it."""
    try:
        _fresh_matcher(tokenizer, constraint.grammar)
    except ValueError as exc:
        raise ValueError(f"{constraint.field}: {exc}") from exc


class Matcher:
    """One sequence's position in its grammar, and the mask of the tokens allowed next."""

    def __init__(self, tokenizer: Tokenizer, constraint: Constraint):
        try:
            self._m = _fresh_matcher(tokenizer, constraint.grammar)
        except ValueError as exc:
            raise ValueError(f"{constraint.field}: {exc}") from exc
        self.field = constraint.field
        self.n_vocab = tokenizer.n_vocab
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)  # [ceil(V/32)]
        self._future: Future | None = None
        self.mask_seconds = 0.0  # time `apply` waited for masks (what the overlap did not hide)
        self.stopped = False  # the grammar is complete: nothing but an end token may follow

    def start(self) -> None:
        """Compute the next mask on a worker thread (call after each consume)."""
        if self._future is None:
            self._future = _POOL.submit(self._fill)

    def _fill(self) -> None:
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def allowed(self) -> torch.Tensor:
        """The mask [V] bool of the tokens the grammar allows next."""
        import time

        t0 = time.perf_counter()
        if self._future is None:
            self.start()
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            except Exception as exc:
                raise ConstraintError(self.field, f"the grammar failed: {_first_line(str(exc))}") from exc
        self.mask_seconds += time.perf_counter() - t0
        if self._m.is_error():
            raise ConstraintError(self.field, f"the grammar failed: {_first_line(self._m.get_error())}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab]
        return torch.from_numpy(bits.view(np.bool_))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V'] with every token the grammar does not allow at -inf (V' >= V: the padding too)."""
        allowed = self.allowed()
        if logits.shape[-1] != self.n_vocab:
            padded = torch.zeros(logits.shape[-1], dtype=torch.bool)
            n = min(self.n_vocab, logits.shape[-1])
            padded[:n] = allowed[:n]
            allowed = padded
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        """Advance past `token`, then start the next mask (unless the grammar is complete, `stopped`).
        The matcher is never touched while a mask is being computed (llguidance's objects are not
        shared between threads). ConstraintError when the grammar fails there (a parser limit)."""
        if self._future is not None:
            future, self._future = self._future, None
            future.exception()  # wait; an error of that mask is the matcher's error, reported below
        if not self._m.consume_token(token):
            error = _first_line(self._m.get_error()) or "no reason given"
            raise ConstraintError(self.field, f"the grammar failed after token {token}: {error}")
        self.stopped = self._m.is_stopped()
        if not self.stopped:
            self.start()


def _first_line(message: str) -> str:
    """llguidance's error without the parser state and grammar it appends."""
    return message.strip().split("\n", 1)[0].strip()
