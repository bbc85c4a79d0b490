"""What training reads: dataset records, examples, packing, the target's feature cache and draft
vocabularies."""
