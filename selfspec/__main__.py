"""`python -m selfspec generate | bench | tune | import | export | push | draft-vocab` (the `selfspec` command)."""

from selfspec.infer.cli import main

main()
