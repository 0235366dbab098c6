"""The one exception type the data package raises for bad input files."""


class DataError(ValueError):
    """A bad row or file; the message is one line naming `file:line` and the problem."""
