"""The one training loop every recipe shares, its method contract, options, checkpoints and the end-of-run
tree fit."""
