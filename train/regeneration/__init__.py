"""The target's own answers to a dataset's prompts (train/regenerate.py): backends, chat turns, shards,
resume."""
