"""Prefill/decode disaggregation: the KV wire format and transport."""
