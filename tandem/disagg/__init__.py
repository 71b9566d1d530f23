"""Prefill/decode disaggregation: the KV wire format and transport, the prefill and decode
sides of a handoff, and `tandem proxy`."""
