"""GrammarCompiler and the backends on a real tokenizer: compiles off the calling thread,
cached; failures name the field; a deadline; matchers that accept, roll back and end."""

import json
import time

import pytest
import torch

from tandem.structured.compiler import GrammarCompiler
from tandem.structured.params import StructuredOutputsParams as S

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(llama_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_path))


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(lambda: tok, len(tok), [tok.eos_token_id])
    yield c
    c.close()


def allowed(matcher, vocab: int) -> list[int]:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill(bitmask, 0)
    return [t for t in range(vocab) if (bitmask[0, t // 32] >> (t % 32)) & 1]


def test_a_spec_compiles_once_and_later_requests_hit_the_cache(compiler):
    so = S(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    first = compiler.submit(so)
    first.result(timeout=30)
    t0 = time.perf_counter()
    again = compiler.submit(S(json={"properties": {"n": {"type": "integer"}}, "type": "object"}))
    assert again is first and again.done()
    assert time.perf_counter() - t0 < 0.05  # a lookup, not a compile


def test_a_compile_error_names_the_field_without_the_librarys_source_location(compiler):
    with pytest.raises(ValueError) as e:
        compiler.compile(S(regex="a(?=b)", source="guided_regex"))  # no lookaheads
    assert str(e.value).startswith("guided_regex: the regex does not compile (xgrammar): ")
    assert ".cc:" not in str(e.value)
    with pytest.raises(ValueError, match=r'response_format: .*guidance.*\["not"\]'):
        compiler.compile(S(json={"not": {"type": "string"}}, source="response_format"))


def test_a_compile_past_the_deadline_fails_naming_the_flag(tok, monkeypatch):
    from tandem.structured.backends import XGrammarBackend

    real = XGrammarBackend.compile
    monkeypatch.setattr(  # a grammar that compiles slowly (the vocabulary's time not counted)
        XGrammarBackend, "compile", lambda self, so: (time.sleep(0.5), real(self, so))[1]
    )
    slow = GrammarCompiler(lambda: (time.sleep(0.3), tok)[1], len(tok), [2], timeout=0.1)
    try:
        with pytest.raises(
            ValueError,
            match=r"did not compile within 0.1 s "
            r"\(--structured-outputs-compile-timeout\)",
        ):
            slow.compile(S(regex="[0-9]+"))
        assert slow.prepared()
    finally:
        slow.close()


def test_under_auto_a_bounded_string_never_admits_a_control_character(compiler, tok):
    """xgrammar 0.2.9 lets raw control characters and '"' into a string with maxLength
    (invalid JSON); auto sends such schemas to llguidance."""
    m = compiler.matcher(S(json=CITY))
    for t in tok.encode('{"city": "', add_special_tokens=False):
        assert m.accept(t)
    texts = [tok.decode([t]) for t in allowed(m, len(tok))]
    assert texts and not [s for s in texts if any(ord(c) < 32 for c in s)]


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_matcher_accepts_rolls_back_and_terminates(tok, backend):
    c = GrammarCompiler(lambda: tok, len(tok), [tok.eos_token_id], backend=backend)
    try:
        m = c.matcher(S(choice=["yes", "no"]))
        ids = tok.encode("yes", add_special_tokens=False)
        bad = tok.encode("x", add_special_tokens=False)[0]
        assert not m.accept(bad)
        for t in ids:
            assert m.accept(t)
        m.rollback(len(ids))  # back to the start: "no" is possible again
        for t in tok.encode("no", add_special_tokens=False):
            assert m.accept(t)
        if not m.terminated:  # xgrammar ends on EOS; llguidance as soon as nothing can follow
            assert allowed(m, len(tok)) == [tok.eos_token_id]
            assert m.accept(tok.eos_token_id)
        assert m.terminated
    finally:
        c.close()


def test_masks_applied_to_logits_leave_only_what_the_grammar_allows(compiler, tok):
    import xgrammar as xgr

    m = compiler.matcher(S(regex="[0-9]{2}"))
    bitmask = xgr.allocate_token_bitmask(1, len(tok))
    m.fill(bitmask, 0)
    logits = torch.zeros(1, len(tok))
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    ok = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert ok and all(tok.decode([t]).isdigit() for t in ok)
    assert json.dumps(ok) == json.dumps(allowed(m, len(tok)))


def test_the_cpp_mask_kernel_equals_xgrammars_on_the_rows_it_is_given():
    import xgrammar as xgr

    from tandem.model import kernels

    kernel = kernels.token_bitmask()
    if kernel is None:
        pytest.skip("no C++ compiler here: the runner uses xgrammar's torch path")
    g = torch.Generator().manual_seed(0)
    for vocab in (400, 49152, 1000 + 7):  # a vocabulary that does not fill its last word
        bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), generator=g,
                                dtype=torch.int32)  # fmt: skip
        bitmask[1] = 0  # nothing allowed
        bitmask[2] = -1  # everything allowed
        bitmask[3, : bitmask.shape[1] // 2] = 0
        logits = torch.randn(6, vocab, generator=g)
        ours, theirs = logits.clone(), logits.clone()
        rows = [0, 1, 3, 5]
        kernel(ours, bitmask, torch.tensor(rows))
        xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=rows)
        assert torch.equal(ours, theirs)
        assert torch.equal(ours[[2, 4]], logits[[2, 4]])  # rows not named are untouched


def test_the_cache_drops_the_least_recently_used_past_its_byte_budget(tok, monkeypatch):
    from tandem.structured import compiler as compiler_module

    c = GrammarCompiler(lambda: tok, len(tok), [tok.eos_token_id])
    try:
        first = c.submit(S(regex="[0-9]{3}"))
        first.result(timeout=30)
        assert c.submit(S(regex="[0-9]{3}")) is first  # kept while within budget
        monkeypatch.setattr(compiler_module, "CACHE_BYTES", first.result().nbytes + 1)
        second = c.submit(S(regex="[a-z]{3}"))
        second.result(timeout=30)
        deadline = time.monotonic() + 10  # sizes are counted by a callback on the worker
        while first in c._cache.values() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.submit(S(regex="[0-9]{3}")) is not first  # evicted: compiled anew
    finally:
        c.close()
