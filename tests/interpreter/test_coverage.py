"""Every public cuTile operation is either emulated or refused on purpose.

The table is ``ops/interpreter/COVERAGE.md`` (operation | status | notes).
Status is ``emulated`` exactly when the operation is registered in
``registry.OPS``; otherwise ``refused`` (with the reason) or ``in progress``
(someone is adding it).  An operation that becomes registered while its row
still says refused / in progress fails the test, as does a new cuda.tile
operation without a row: the table is a decision, not a mirror.

``python -m tests.interpreter.test_coverage --write`` rewrites the file from
the registry, keeping the notes of rows that are not emulated and marking
newly registered operations emulated; new stubs get an ``in progress`` row
without notes, to be filled in by hand.
"""
import inspect
import pathlib
import re
import sys

from ops import interpreter
from ops.runtime.cutile_internals import is_stub, stub_module, stub_name
from ops.interpreter.registry import OPS

TABLE = pathlib.Path(interpreter.__file__).parent / "COVERAGE.md"
STATUSES = ("emulated", "refused", "in progress")
HEADER = """\
# CPU interpreter coverage of cuda.tile

Every public operation of cuda.tile (its API stubs: functions, and methods and
properties of `Tile`, `Array`, `TiledView`, ...), and what the CPU interpreter
does with it. `emulated` means registered in `ops/interpreter/registry.OPS`;
`refused` raises `UnsupportedOperation` (or the compiler's error) for the reason
given; `in progress` is being added. `tests/interpreter/test_coverage.py`
fails when this table and the registry disagree; regenerate with
`python -m tests.interpreter.test_coverage --write`.

| operation | status | notes |
|---|---|---|
"""


def public_stubs():
    """Names (as the registry spells them) of every API stub of cuda.tile."""
    names = set()
    for obj in vars(stub_module).values():
        if inspect.isclass(obj) and obj.__module__ == stub_module.__name__:
            members = [getattr(v, "fget", None) or getattr(v, "__func__", v)
                       for v in vars(obj).values()]
        else:
            members = [obj]
        names.update(stub_name(f) for f in members if callable(f) and is_stub(f))
    names.discard(None)
    return names


def read_table(text=None):
    text = TABLE.read_text() if text is None else text
    rows = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\| `([^`]+)` \| ([a-z ]+) \| (.*) \|", line.strip())
        if m:
            rows[m[1]] = (m[2], m[3].strip())
    return rows


def render(rows):
    lines = [HEADER]
    for name in sorted(public_stubs()):
        status, notes = rows.get(name, ("in progress", ""))
        if name in OPS:
            status, notes = "emulated", notes if status == "emulated" else ""
        elif status == "emulated":
            status = "in progress"
        lines.append(f"| `{name}` | {status} | {notes} |\n")
    return "".join(lines)


def test_every_registered_name_is_a_public_stub():
    assert set(OPS) <= public_stubs(), sorted(set(OPS) - public_stubs())


def test_table_and_registry_agree():
    rows = read_table()
    stubs = public_stubs()
    problems = []
    for name in sorted(stubs | set(rows)):
        status, notes = rows.get(name, (None, ""))
        if name not in stubs:
            problems.append(f"{name}: listed but not a cuda.tile operation (remove the row)")
        elif status is None:
            problems.append(f"{name}: new cuda.tile operation, decide: emulate or refuse")
        elif status not in STATUSES:
            problems.append(f"{name}: unknown status {status!r}")
        elif name in OPS and status != "emulated":
            problems.append(f"{name}: now registered but marked {status!r}: mark it emulated")
        elif name not in OPS and status == "emulated":
            problems.append(f"{name}: marked emulated but not registered")
        elif status == "refused" and not notes:
            problems.append(f"{name}: refused without a reason")
    assert not problems, "COVERAGE.md is out of date:\n" + "\n".join(problems)


def test_table_is_in_canonical_form():
    assert TABLE.read_text() == render(read_table()), \
        "regenerate with python -m tests.interpreter.test_coverage --write"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    TABLE.write_text(render(read_table() if TABLE.exists() else {}))
