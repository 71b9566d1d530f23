"""The grammar libraries behind one interface: a backend compiles a StructuredOutputsParams
into a grammar, and makes matchers of it; a matcher accepts tokens, rolls them back, says
whether it has terminated and fills its row of a token bitmask.

The bitmask is the format both libraries share: int32 [rows, ceil(vocab / 32)], bit j of
word i set when token 32 * i + j may come next. A terminated grammar allows only the
end-of-sequence tokens, so a finished JSON value ends the request with finish_reason "stop".
"""

from __future__ import annotations

import json
from typing import Protocol

import torch

from tandem.structured.params import StructuredOutputsParams, choice_grammar

# Tokens a matcher can take back: the drafts of one speculative step, with room to spare.
MAX_ROLLBACK = 32


class Matcher(Protocol):
    def accept(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    @property
    def terminated(self) -> bool: ...


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        # our own cache (compiler.py) keys by the request's spec; theirs would double it
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, so: StructuredOutputsParams):
        c, kind = self.compiler, so.kind
        if kind == "json":
            return c.compile_json_schema(
                json.dumps(so.json), any_whitespace=False, strict_mode=True
            )
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(so.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(so.choice))
        if kind == "grammar":
            return c.compile_grammar(so.grammar)
        tag = so.structural_tag
        if "structures" in tag:  # vLLM's form: {"structures": [{begin, schema, end}], triggers}
            items = [
                self.xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return c.compile_structural_tag(items, tag.get("triggers", []))
        return c.compile_structural_tag(json.dumps(tag))  # xgrammar's: {"type", "format"}

    def matcher(self, grammar) -> Matcher:
        return _XGrammarMatcher(self.xgr.GrammarMatcher(grammar, max_rollback_tokens=MAX_ROLLBACK))


class _XGrammarMatcher:
    def __init__(self, m) -> None:
        self.m = m

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()


# JSON as xgrammar writes it without any_whitespace: ", " and ": ", no other whitespace
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.fill_row = llguidance, llguidance.torch.fill_next_token_bitmask
        eos = stop_token_ids[0] if stop_token_ids else None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, so: StructuredOutputsParams):
        M, kind = self.llg.LLMatcher, so.kind
        if kind == "json":
            grammar = M.grammar_from_json_schema(json.dumps(so.json), defaults=_COMPACT)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema('{"type": "object"}', defaults=_COMPACT)
        elif kind == "regex":
            grammar = M.grammar_from_regex(so.regex)
        elif kind == "choice":
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        elif kind == "grammar":
            grammar = M.grammar_from_lark(so.grammar)
        else:
            raise ValueError(f"{so.source}: structural_tag needs the xgrammar backend")
        error = M.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, grammar) -> Matcher:
        return _GuidanceMatcher(self.llg.LLMatcher(self.tokenizer, grammar), self.fill_row)


class _GuidanceMatcher:
    def __init__(self, m, fill_row) -> None:
        self.m, self.fill_row = m, fill_row

    def accept(self, token: int) -> bool:
        # checked first: a token llguidance refuses would leave the matcher in error (a
        # speculative draft the grammar refuses must leave it as it was, as xgrammar does)
        return self.m.validate_tokens([token]) == 1 and self.m.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.fill_row(self.m, bitmask, row)

    @property
    def terminated(self) -> bool:
        return self.m.is_stopped()


BACKEND_CLASSES = {"xgrammar": XGrammarBackend, "guidance": GuidanceBackend}
