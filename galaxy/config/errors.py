"""ConfigError: bad config values or arguments, one line per problem, each naming the key."""
from __future__ import annotations


class ConfigError(ValueError):
    """ConfigError(problem, *more): `problems` holds the lines; str() joins them with newlines.

    An entry script prints it and exits 2 before any process group starts: a mistake should cost
    one failed launch, not a hung rendezvous or a crash ten minutes into training."""

    def __init__(self, message: str, *more: str):
        # Entry scripts print exactly one line per problem, so never let a newline into one.
        self.problems = [" ".join(str(m).splitlines()) for m in (message, *more)]
        super().__init__("\n".join(self.problems))


def raise_all(problems: list[str]) -> None:
    if problems:
        raise ConfigError(*problems)
