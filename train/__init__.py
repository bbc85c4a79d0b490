"""Training recipes: the demo target, Medusa heads and EAGLE drafters, on one shared accelerate loop."""
