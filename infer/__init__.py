"""Speculative decoding: draft trees, one-forward verification, lossless acceptance, the decode loop."""
