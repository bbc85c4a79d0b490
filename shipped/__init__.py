"""What the repository ships besides code: the demo models and the corpus they were trained on."""
