"""Running `ip` and `tc`: a failure is one line naming the command and what it said."""
from __future__ import annotations

import subprocess


class EdgeError(Exception):
    """The testbed could not be built or run: one line, no traceback (exit status 1)."""


def run(*argv: str) -> str:
    """stdout of argv; EdgeError with the command and its first line of stderr if it fails.
    In a session of its own: a Ctrl-C at the terminal must not kill an `ip link del` halfway
    through the teardown it interrupts."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, start_new_session=True)
    except OSError as e:
        raise EdgeError(f"cannot run `{argv[0]}`: {e.strerror}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
        raise EdgeError(f"`{' '.join(argv)}` failed: {said}")
    return done.stdout


def undo(*argv: str) -> str | None:
    """Run a teardown command: None when it worked or found nothing left to remove, else the
    one-line problem (teardown goes on with the rest and reports it at the end)."""
    try:
        run(*argv)
    except EdgeError as e:
        gone = ("Cannot find", "No such", "does not exist", "Cannot remove namespace file")
        return None if any(g in str(e) for g in gone) else str(e)
    return None
