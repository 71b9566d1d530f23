"""Structured output end to end on the tiny checkpoint (offline LLM): every output matches
its schema, regex, choice or grammar; speculative decoding changes no token; a bad grammar
fails its own request only; requests wait for their grammar outside the scheduler."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tandem.engine.messages import EngineCoreRequest
from tandem.structured.params import StructuredOutputsParams as S

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {   # enum, a bounded integer, an array with minItems/maxItems of an enum
        "type": "object",
        "properties": {
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2,
                     "maxItems": 3},
        },
        "required": ["unit", "days", "tags"],
        "additionalProperties": False,
    },
    {   # $ref and anyOf
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer",
                  "minimum": 0, "maximum": 9}}, "required": ["x"], "additionalProperties": False}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"},
                       "q": {"anyOf": [{"type": "null"}, {"const": "z"}]}},
        "required": ["p", "q"],
        "additionalProperties": False,
    },
    {   # pattern and maxLength (llguidance under auto)
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                       "name": {"type": "string", "maxLength": 5}},
        "required": ["id", "name"],
        "additionalProperties": False,
    },
]  # fmt: skip


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), dtype="float32", kv_cache_memory=0.02)


def run(llm, so, n_prompts=3, **kw):
    kw.setdefault("max_tokens", 120)
    params = SamplingParams(structured_outputs=so, **kw)
    prompts = ["The quick brown fox", "Paged attention", "Héllo wörld"][:n_prompts]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_every_output_validates_against_its_json_schema(llm, i):
    for temperature in (0.0, 1.0):
        for out in run(llm, S(json=SCHEMAS[i]), temperature=temperature, seed=i):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMAS[i])


def test_regex_choice_grammar_and_json_object_outputs_match(llm):
    for out in run(llm, S(regex=r"[a-z]{3}-[0-9]{2}"), temperature=1.0, seed=1):
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", out.text) and out.finish_reason == "stop"
    for out in run(llm, S(choice=["yes", "no way", "é"]), temperature=1.0, seed=2):
        assert out.text in ("yes", "no way", "é")
    for out in run(llm, S(grammar='root ::= "x" [0-9] [0-9]? "y"'), temperature=1.0, seed=3):
        assert re.fullmatch(r"x[0-9]{1,2}y", out.text)
    for out in run(llm, S(json_object=True), temperature=0.0, max_tokens=200):
        assert out.finish_reason != "stop" or isinstance(json.loads(out.text), dict)


def test_an_unconstrained_request_beside_constrained_ones_is_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], plain, use_tqdm=False)[0].outputs[0]
    both = llm.generate(
        ["The quick brown fox", "The quick brown fox"],
        [plain, SamplingParams(temperature=0, max_tokens=12, structured_outputs=S(regex="[0-9]+"))],
        use_tqdm=False,
    )
    assert both[0].outputs[0].token_ids == alone.token_ids
    assert re.fullmatch("[0-9]+", both[1].outputs[0].text)


def test_a_grammar_that_does_not_compile_is_a_value_error_and_the_engine_goes_on(llm):
    with pytest.raises(ValueError, match="^structured_outputs: the regex does not compile"):
        run(llm, S(regex="a(?=b)"))  # Python's re takes it, xgrammar not
    with pytest.raises(ValueError, match=r'\["uniqueItems"\]'):
        run(llm, S(json={"type": "array", "uniqueItems": True}))
    assert run(llm, S(choice=["a", "b"]), n_prompts=1)[0].text in ("a", "b")
    llm.engine.scheduler.check_invariants()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_with_a_grammar_yields_the_same_tokens(llama_path, temperature):
    """n-gram drafts from a prompt the grammar's outputs resemble: some the grammar (and
    the model) accept, some it refuses."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    specced = LLM(str(llama_path), dtype="float32", kv_cache_memory=0.02, speculative_config=spec)
    plain = LLM(str(llama_path), dtype="float32", kv_cache_memory=0.02)
    prompts = ["abababab c abab ababc", '{"unit": "c", "days": 3, "tags": ["a", "b"]} ' * 3]
    for so in (S(regex="(ab){2,6}c"), S(json=SCHEMAS[1]), S(json=SCHEMAS[3])):
        params = SamplingParams(structured_outputs=so, temperature=temperature, seed=7,
                                max_tokens=60)  # fmt: skip
        a = specced.generate(prompts, params, use_tqdm=False)
        b = plain.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    stats = specced.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both verdicts happened


class _Compiles:
    """The engine's grammar compiler, with compiles that finish when the test says."""

    timeout = 5.0

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def submit(self, so):
        self.futures.append(Future())
        return self.futures[-1]

    def prepared(self) -> bool:
        return True


def _request(rid: str, so) -> EngineCoreRequest:
    return EngineCoreRequest(
        rid, [5, 6, 7], SamplingParams(max_tokens=2, structured_outputs=so), 0.0
    )


def test_a_request_waits_for_its_grammar_outside_the_scheduler(llm):
    core, real = llm.engine, llm.engine.grammars
    core.grammars = compiles = _Compiles()
    try:
        core.add_request(_request("a", S(regex="x")))
        core.add_request(_request("b", S(regex="y")))
        core.add_request(_request("c", S(regex="z")))
        assert core.has_unfinished() and core.scheduler.num_waiting == 0
        assert core.step() == [] and core.admit_compiled() == []
        compiles.futures[0].set_result(real.submit(S(regex="x")).result())
        compiles.futures[1].set_exception(ValueError("structured_outputs: bad"))
        core.abort_requests(["c"])
        assert core.admit_compiled() == [("b", "structured_outputs: bad")]
        assert core.scheduler.num_waiting == 1 and not core.compiling
        while core.has_unfinished():
            core.step()
        core.grammars = _Compiles()
        core.clock, clock = (lambda: 100.0), core.clock
        core.add_request(_request("d", S(regex="w")))
        core.clock = lambda: 106.0
        (refused,) = core.admit_compiled()
        assert refused[0] == "d" and "did not compile within 5 s" in refused[1]
        core.clock = clock
    finally:
        core.grammars = real
    core.scheduler.check_invariants()


def test_min_tokens_does_not_hold_back_the_end_of_a_complete_grammar(llm):
    (out,) = run(llm, S(choice=["yes", "no"]), n_prompts=1, min_tokens=20, temperature=0)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_structural_tags_in_xgrammars_form_and_vllms(llm):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "content":
           {"type": "json_schema", "json_schema": schema}, "end": "</f>"}}  # fmt: skip
    for out in run(llm, S(structural_tag=tag), temperature=1.0, seed=4):
        inside = re.fullmatch(r"<f>(.*)</f>", out.text, re.S)  # any JSON whitespace inside
        assert inside and json.loads(inside[1]) in ({"a": "x"}, {"a": "y"}), out.text
    vllm_form = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
                 "triggers": ["<f>"]}  # fmt: skip
    (out,) = run(llm, S(structural_tag=vllm_form), n_prompts=1, max_tokens=8)
    assert out.finish_reason == "length"  # free text until the model writes the trigger
