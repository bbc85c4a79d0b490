"""Drafters (Medusa heads, EAGLE layers), their config and files. Nothing here trains or decodes."""
