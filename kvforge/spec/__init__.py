"""Speculative decoding: proposers (n-gram, draft model, self-draft), lossless verification."""
