"""Make modules unimportable for a while, as if they were not installed (a test's view of a
machine without an optional package, and a cheaper run that skips what it would draw)."""
from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def modules_hidden(modules: list[str]):
    """`import m` (and of any m.x loaded before: `import m.x` finds a loaded m.x without looking
    at m) raises ImportError inside: None in sys.modules. Restores what was there after."""
    names = [n for n in sys.modules if any(n.startswith(m + ".") for m in modules)] + list(modules)
    hidden = {name: sys.modules.get(name) for name in names}
    sys.modules.update(dict.fromkeys(names))
    try:
        yield
    finally:
        for name, module in hidden.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module
