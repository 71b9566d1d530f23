"""Structured output: a request's tokens held to a JSON schema, regex, choice or grammar.

params.py    what a request asks for (StructuredOutputsParams), checked without torch
backends.py  xgrammar and llguidance behind one interface (compile, matcher)
compiler.py  compiles off the step loop, cached, with a deadline
masks.py     the runner's part: one matcher per request, the batch's bitmask, accept
"""
