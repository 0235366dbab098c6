"""The ranks' output on the launcher's terminal, every line prefixed with its device's name.

A progress bar (tqdm, on rank 0) redraws its line: it writes "\\r" and the new text, with no
newline until it closes. Such text is shown at once, prefixed, over the line it replaces; when
another device prints a line meanwhile, the bar's line is ended first and the bar goes on redrawing
on the line below. Ordinary text waits for its newline, so lines of two devices never mix.
"""
from __future__ import annotations

import re

SEPARATOR = re.compile(rb"([\r\n])")


class Console:
    """Writes (device, text) to the launcher's stdout or stderr (binary streams)."""

    def __init__(self, names: list[str], out, err):
        width = max(len(n) for n in names)
        self.prefixes = [f"{n:<{width}} | ".encode() for n in names]
        self.streams = {"out": out, "err": err}
        self.pending: dict = {}         # (device, stream) -> bytes of a line not yet ended
        self.redrawing: dict = {}       # (device, stream) -> the last separator was "\r"
        self.shown: dict = {}           # (device, stream) -> text of its open line
        self.open = None                # (device, stream) whose line the terminal shows unfinished

    def feed(self, device: int, stream: str, data: bytes) -> None:
        """Data a rank wrote; empty data: its stream closed (a line left without newline ends)."""
        key = (device, stream)
        if not data:
            rest = self.pending.pop(key, b"")
            if rest or self.open == key:
                self._show(key, rest or self.shown.get(key, b""), final=True)
            return
        parts = SEPARATOR.split(self.pending.pop(key, b"") + data)
        for text, sep in zip(parts[0::2], parts[1::2]):
            if sep == b"\n":
                # "\r" then "\n" (a bar closing, or CRLF) ends the line already shown
                self._show(key, text or (self.shown.get(key, b"") if self.redrawing.get(key) else b""), final=True)
                self.redrawing[key] = False
            else:
                if text:
                    self._show(key, text, final=False)
                self.redrawing[key] = True
        rest = parts[-1]
        if rest and self.redrawing.get(key):
            self._show(key, rest, final=False)     # a bar's new text: show it now
        elif rest:
            self.pending[key] = rest

    def note(self, line: str) -> None:
        """A line of the launcher's own, on stderr."""
        self._end_open_line()
        self.streams["err"].write(line.encode() + b"\n")
        self.streams["err"].flush()

    def _show(self, key, text: bytes, final: bool) -> None:
        device, stream = key
        out = self.streams[stream]
        if self.open == key:
            out.write(b"\r")                        # redraw the line this device has open
        else:
            self._end_open_line()
        out.write(self.prefixes[device] + text + (b"\n" if final else b""))
        out.flush()
        self.open, self.shown[key] = (None, b"") if final else (key, text)

    def _end_open_line(self) -> None:
        if self.open is not None:
            stream = self.streams[self.open[1]]
            stream.write(b"\n")
            stream.flush()
            self.open = None
