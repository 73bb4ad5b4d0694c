"""The operation table: every module of the interpreter registers its emulations here."""

# Stub name (its name in cuTile's stub module: "load", "Tile.item") -> emulation.
OPS = {}


def emulates(*names):
    """Register the decorated function as the emulation of ``ct.<name>``."""
    def register(fn):
        for name in names:
            OPS[name] = fn
        return fn
    return register
