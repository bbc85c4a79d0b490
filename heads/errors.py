"""User errors end in one line, not a traceback: every entry point (CLI, training scripts) runs through here.

A user's mistake (a bad option, a missing or damaged file, a full disk) surfaces as a ValueError or an
OSError carrying a message that names the problem and the fix. `--debug` or SELFSPEC_DEBUG=1 shows the
traceback instead, for bug reports.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import NoReturn

DEBUG_ENV = "SELFSPEC_DEBUG"
EXIT_USER_ERROR = 2


def debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """Whether `--debug` (or SELFSPEC_DEBUG=1) asks for tracebacks, and argv without the flag."""
    rest = [a for a in argv if a != "--debug"]
    env = os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")
    return env or len(rest) != len(argv), rest


def describe(error: BaseException) -> str:
    """One line for a user error: OSErrors name the file and, for a full disk or a permission, the fix."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" writing {error.filename}" if error.filename else ""
        return f"no space left on the device{where}: free some space or write somewhere else"
    if isinstance(error, PermissionError) and error.filename:
        return (
            f"permission denied: {error.filename}: choose a folder you can write to (or fix its permissions)"
        )
    if isinstance(error, FileNotFoundError) and error.filename:
        return f"no such file or folder: {error.filename}"
    text = str(error)
    if isinstance(error, KeyError):  # str(KeyError) is the quoted key only
        text = f"missing key {text}"
    return " ".join(text.split()) or type(error).__name__


def run_main(main: Callable[[list[str]], object], argv: list[str] | None = None, prog: str = "") -> None:
    """Call `main(argv)`; a user error prints `error: ...` on one line and exits 2 (tracebacks with
    --debug)."""
    debug, argv = debug_requested(sys.argv[1:] if argv is None else list(argv))
    try:
        main(argv)
    except KeyboardInterrupt:
        fail("interrupted", code=130, prog=prog)
    except (ValueError, OSError, KeyError) as e:
        if debug:
            raise
        fail(describe(e), prog=prog)


def fail(message: str, code: int = EXIT_USER_ERROR, prog: str = "") -> NoReturn:
    print(f"{prog + ': ' if prog else ''}error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def disk_full_instead(error: BaseException, path: os.PathLike | str) -> BaseException:
    """torch.save on a full disk raises a C++ stream error ('basic_ios::clear'); say what it is when the
    disk is (nearly) full, otherwise hand the error back unchanged."""
    import shutil

    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        return error
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return error
    if free < 64 * 2**20:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return error
