"""What a failed collective says, in one line a user can read (the launcher's exit message, the
server's 503 body)."""
from __future__ import annotations

import re


def first_line(error: BaseException) -> str:
    """The error's first line, or its type's name when it says nothing."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    # gloo prefixes its messages with "[/path/to/pair.cc:537] ", which says nothing to users.
    return re.sub(r"^\[[^\]]*:\d+\]\s*", "", lines[0])
