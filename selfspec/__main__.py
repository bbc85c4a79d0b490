"""`python -m selfspec generate | bench | tune | import | export | push | draft-vocab` (the `selfspec`
command)."""

from selfspec.cli import main

main()
