"""StructuredOutputsParams: checked at construction, naming the field the client used; the
backend that enforces every keyword of a schema is chosen, never one that drops some."""

import pytest

from tandem.structured.params import StructuredOutputsParams as S
from tandem.structured.params import schema_keywords

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def test_exactly_one_kind_is_given():
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        S()
    with pytest.raises(ValueError, match=r"got \['regex', 'choice'\]"):
        S(regex="a+", choice=["a"])
    assert S(regex="a+").kind == "regex"


def test_errors_name_the_field_the_client_used():
    with pytest.raises(ValueError, match=r"^guided_choice: choice must be a non-empty list"):
        S(choice=[], source="guided_choice")
    with pytest.raises(ValueError, match=r"^response_format: invalid JSON schema at type"):
        S(json={"type": "strnig"}, source="response_format")
    with pytest.raises(ValueError, match="not valid JSON"):
        S(json="{not json")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        S(regex="")
    with pytest.raises(ValueError, match=r"^guided_regex: invalid regex: missing \)"):
        S(regex="(unclosed", source="guided_regex")


def test_a_schema_given_as_text_is_parsed_and_keys_order_does_not_change_the_cache_key():
    a = S(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    b = S(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.json == b.json and a.spec() == b.spec()
    assert S(choice=["x", "y"]).spec() != S(choice=["y", "x"]).spec()


def test_property_names_are_not_keywords():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "pattern": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "array", "items": {"uniqueItems": True}}},
        "anyOf": [{"minLength": 1}],
    }
    assert schema_keywords(schema) == {
        "type", "properties", "$ref", "$defs", "items", "uniqueItems", "anyOf", "minLength",
    }  # fmt: skip


def test_auto_sends_a_schema_to_xgrammar_only_when_it_enforces_every_keyword():
    assert S(json=WEATHER).backend("auto") == "xgrammar"
    bounded = {"type": "string", "maxLength": 8}  # xgrammar lets control characters in
    assert S(json=bounded).backend("auto") == "guidance"
    assert S(json={"type": "array", "uniqueItems": True}).backend("auto") == "guidance"
    assert S(regex="a+").backend("auto") == "xgrammar"


def test_xgrammar_by_name_refuses_a_keyword_it_would_drop():
    with pytest.raises(ValueError, match=r"\['not'\].*xgrammar backend does not enforce"):
        S(json={"type": "object", "not": {"required": ["a"]}}).backend("xgrammar")
    assert S(json={"not": {}}).backend("guidance") == "guidance"
