"""The `selfspec` command (also `python -m selfspec`): infer's commands and train's draft-vocab in one command
line.

The table is assembled here, above both packages, so that infer never imports train.
"""

from __future__ import annotations

from selfspec.infer.cli import commands as infer_cli
from selfspec.infer.cli.options import PROG, Command
from selfspec.train.data.draft_vocab import DRAFT_VOCAB


def insert_after(commands: dict[str, Command], after: str, name: str, command: Command) -> dict[str, Command]:
    """`commands` with `name` added right after `after`: the order the parser lists them in."""
    items = list(commands.items())
    at = list(commands).index(after) + 1
    return dict([*items[:at], (name, command), *items[at:]])


COMMANDS = insert_after(infer_cli.COMMANDS, "export", "draft-vocab", DRAFT_VOCAB)


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    """`selfspec ...` on `argv` (default: the process's arguments); a user error ends in one `error: ...` line
    and exit status 2 (`--debug`: the traceback)."""
    infer_cli.main(argv, prog, COMMANDS)
