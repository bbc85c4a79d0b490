"""Measuring decoding: the bench, the tree fit (tune), kernel launches and KV bytes per step."""
