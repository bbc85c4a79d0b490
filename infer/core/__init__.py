"""The decode loop and what it runs on: the KV cache, masks, rows, tree verification and lossless
acceptance."""
