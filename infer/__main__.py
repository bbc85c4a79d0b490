"""`python -m infer ...` in a checkout, kept for scripts written before `selfspec`: the same as `python -m selfspec`."""

from selfspec.cli import main

main()
