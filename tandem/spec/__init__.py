"""Speculative decoding: proposers guess the next tokens, the target model verifies them all
in one forward, and the longest prefix plain sampling would also have produced is kept."""
