"""StructuredOutputsParams: what a request's output must match, as vLLM names it.

Exactly one of json (a JSON schema), regex, choice, grammar (EBNF / GBNF), json_object
(any JSON object) or structural_tag. Checked at construction without torch or a backend:
a schema must be a valid JSON Schema (jsonschema's own check), a regex one Python's `re`
compiles, a choice list non-empty. What only a backend can check (a grammar; a regex in a
construct xgrammar lacks, such as a lookaround) fails its compile, which the engine reports
as a 400 naming the field the client used (`source`).

Which backend compiles it: xgrammar is the fastest, but ignores JSON Schema keywords it
does not implement; llguidance refuses those it does not implement by name. So under
`auto`, a schema that uses only XGRAMMAR_KEYWORDS goes to xgrammar and any other to
llguidance, and a keyword neither enforces is an error, never silently dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

BACKENDS = ("auto", "xgrammar", "guidance")
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# Keywords xgrammar enforces exactly (or that only annotate). Anything else under `auto` goes
# to llguidance, which names the keys it cannot enforce. Not minLength / maxLength: xgrammar
# 0.2.9 lets raw control characters and '"' into a string with a length bound (invalid
# JSON), where llguidance keeps it valid (tests/structured/test_backends.py).
XGRAMMAR_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions",
    "minItems", "maxItems", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
})  # fmt: skip
# Keywords whose value is a map of name -> subschema, a subschema, or a list of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_ONE = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains",
    "propertyNames", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    # the request field the client used (response_format, guided_json, tool_choice...),
    # so that an error names what the client sent
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        _check(
            len(given) == 1,
            self.source,
            f"exactly one of {', '.join(KINDS)} must be given, got {given or 'none'}",
        )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{self.source}: the JSON schema is not valid JSON: {e}") from None
        if self.json is not None:
            check_schema(self.json, self.source)
        if self.choice is not None:
            _check(
                isinstance(self.choice, list)
                and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                self.source,
                "choice must be a non-empty list of non-empty strings",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value != ""),
                self.source,
                f"{name} must be a non-empty string",
            )
        if self.regex is not None:  # most bad regexes stop here, before the engine
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"{self.source}: invalid regex: {e}") from None
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except ValueError as e:
                raise ValueError(f"{self.source}: structural_tag is not valid JSON: {e}") from None
        _check(
            self.structural_tag is None or isinstance(self.structural_tag, dict),
            self.source,
            "structural_tag must be a JSON object",
        )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): the cache key of its compiled grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag", "choice"):
            return kind, json.dumps(value, sort_keys=True, ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, value

    def backend(self, configured: str) -> str:
        """The backend that compiles this: the server's choice, or under `auto` the one
        that enforces every keyword (ValueError naming any keyword xgrammar would drop
        when xgrammar is asked for by name)."""
        if self.json is None:
            return "xgrammar" if configured == "auto" else configured
        unknown = sorted(schema_keywords(self.json) - XGRAMMAR_KEYWORDS)
        if configured == "auto":
            return "guidance" if unknown else "xgrammar"
        _check(
            configured != "xgrammar" or not unknown,
            self.source,
            f"the schema uses {unknown}, which the xgrammar backend does not enforce "
            "(the `auto` or `guidance` backend does)",
        )
        return configured


def check_schema(schema, source: str) -> None:
    """A JSON Schema object that jsonschema's metaschema accepts."""
    _check(isinstance(schema, (dict, bool)), source, "the JSON schema must be an object")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"{source}: invalid JSON schema at {where}: {e.message}") from None


def schema_keywords(schema) -> set[str]:
    """Every keyword used anywhere in a schema (property names are not keywords)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.update(node)
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_ONE:
            value = node.get(key)
            stack.extend(value if isinstance(value, list) else [value])
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
    return found


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
