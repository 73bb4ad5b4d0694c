"""A kernel's source as one launch compiles it: the branches its constants rule out left out.

A ``ct.Constant`` parameter is known when the kernel compiles, so every ``if SWAP:`` or
``if HEADS_PER_BLOCK == 1:`` on constants is decided then, and the branch not taken is not in the
machine code at all. ``specialised_source`` shows a kernel (or a helper it calls) that way, so a
reader sees the code one configuration really runs instead of every variant at once:

    plan = compute_out_plan(...)
    print(specialised_source(plan))                         # the kernel, for this launch
    print(specialised_source(output_tile, launch_constants(plan) | {"HB": 1}))
    print(source_diff(fold_chunk, {"SWAP": False}, {"SWAP": True}))   # a knob as a code change

What is left out, given values for some constants:
  * an ``if`` / ``elif`` whose test uses only known constants, or is an ``or`` with an operand
    known true or an ``and`` with one known false, the rest names and operators
    (``if WITH_DINITIAL or c > 0:``): the branch not taken (the kept branch is dedented into its
    place; a block left empty gets ``pass``); likewise ``a if TEST else b`` expressions. An
    ``elif`` is decided only once the tests before it are. A test left undecided loses its
    operands that change nothing (``if c > 0:`` for the same test with WITH_DINITIAL False);
  * ``latency=latency_hint(NAME)`` arguments with ``NAME == 0`` (no hint is the same as none);
  * with ``index64=False``, the ``ct.IndexedWithInt64`` annotations (``ops.runtime.launch`` runs a
    32-bit twin of the kernel whenever every tensor has fewer than 2**31 elements).
A name assigned once in the function from known constants (``NK = DSTATE // DSTATE_TILE``)
becomes known too; a parameter the function reassigns is never taken as known. Everything else,
comments included, is the file's text. Left as written, whatever the constants: an ``if`` whose
test spans lines, a body or ``else`` on the header's line, a string spanning lines inside the
branch, a ``latency=`` with a comment or nothing before it in its call.

A helper's constants are its parameters at ONE call: a helper called with different values at
different places (``compute_out.load_tokens`` reads ``x`` with ``SWAP=False`` whatever the
kernel's ``SWAP``) compiles once per call, and the text for one call is not the others'.
Kernel constants come from the launch (``launch_constants``); for a helper, pass the values of
the call you mean to read.
"""
import ast
import difflib
import inspect
import textwrap

import cuda.tile as ct

from ops.runtime.cutile_internals import kernel_function


def function_of(obj):
    """The Python function of a ``@ct.kernel`` (or the function itself)."""
    try:
        return kernel_function(obj)
    except TypeError:
        if inspect.isfunction(obj):
            return obj
        raise TypeError(f"expected a @ct.kernel or a function, got {type(obj).__name__}") from None


def launch_constants(plan):
    """{name: value} of the ``ct.Constant`` parameters of ``plan``'s kernel, from its arguments."""
    f = function_of(plan.kernel)
    params = list(inspect.signature(f).parameters.values())
    if len(params) != len(plan.args):
        raise ValueError(f"{f.__name__} takes {len(params)} arguments, the plan has {len(plan.args)}")
    return {p.name: a for p, a in zip(params, plan.args)
            if is_constant_annotation(f.__annotations__.get(p.name))}


def is_constant_annotation(annotation):
    """True for ``ct.Constant[...]`` (a typing.Annotated with cuTile's constant marker)."""
    return any(isinstance(m, ct.ConstantAnnotation) for m in getattr(annotation, "__metadata__", ()))


def uses_int64(kernel):
    """Whether ``kernel`` (a @ct.kernel) still carries ``ct.IndexedWithInt64`` annotations."""
    return any(a is ct.IndexedWithInt64 for a in function_of(kernel).__annotations__.values())


def specialised_source(obj, constants=None, index64=None, header=True):
    """The source of ``obj`` -- a ``Plan`` (its kernel with its launch's constants and index
    width), a ``@ct.kernel`` or a plain helper function -- with what ``constants`` rule out left
    out (see the module docstring). ``index64=False`` drops the 64-bit annotations; for a plan it
    defaults to what the plan's kernel uses. ``header`` adds a comment naming the values used."""
    if hasattr(obj, "kernel") and hasattr(obj, "args"):          # an ops.runtime.launch.Plan
        constants = {**launch_constants(obj), **(constants or {})}
        if index64 is None:
            index64 = uses_int64(obj.kernel)
        obj = obj.kernel
    f = function_of(obj)
    constants = dict(constants or {})
    known = {k: v for k, v in constants.items() if k in inspect.signature(f).parameters}
    text = textwrap.dedent(inspect.getsource(f))
    body = _Specialiser(text, known, index64 is False).render()
    if not header:
        return body
    width = {False: ["32-bit indices"], True: ["64-bit indices"]}.get(index64, [])
    shown = [f"{k}={v!r}" for k, v in known.items()] + width
    lead = "as compiled with " if isinstance(obj, ct.kernel) else "as compiled for a call with "
    note = textwrap.fill(lead + (", ".join(shown) or "no constants fixed"), 96,
                         initial_indent="# ", subsequent_indent="#   ")
    return f"{note}\n{body}"


def source_diff(obj, before, after, index64=None, context=2):
    """A unified diff between ``obj``'s source specialised for ``before`` and for ``after`` (two
    dicts of constants): a configuration change shown as the code change it makes. ``obj`` may be
    a plan (its launch's constants, updated by ``before`` / ``after``); the diff's labels name the
    constants that differ."""
    if hasattr(obj, "kernel") and hasattr(obj, "args"):          # an ops.runtime.launch.Plan
        if index64 is None:
            index64 = uses_int64(obj.kernel)
        base = launch_constants(obj)
        before, after, obj = {**base, **before}, {**base, **after}, obj.kernel
    a = specialised_source(obj, before, index64, header=False).splitlines(keepends=True)
    b = specialised_source(obj, after, index64, header=False).splitlines(keepends=True)
    name = function_of(obj).__name__
    changed = {k for k in {**before, **after} if before.get(k) != after.get(k)}
    label = lambda cfg: f"{name} " + (", ".join(f"{k}={cfg.get(k)!r}" for k in sorted(changed))
                                      or "(no change)")
    return "".join(difflib.unified_diff(a, b, label(before), label(after), n=context))


# How it works: the function's text is parsed; every decidable construct becomes an edit of a span
# of the text (a branch kept and dedented, an argument dropped), applied innermost-first.

_SAFE = (ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Name, ast.Load,
         ast.Constant, ast.Tuple, ast.cmpop, ast.boolop, ast.unaryop, ast.operator)


class _Specialiser:
    def __init__(self, text, constants, drop_int64):
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.tree = ast.parse(text)
        self.drop_int64 = drop_int64
        self.parents = {child: parent for parent in ast.walk(self.tree)
                        for child in ast.iter_child_nodes(parent)}
        # An ``elif`` is decided only as the head of what is left of its chain: when the ``if``
        # before it is decided false (then it is added here). Inside an undecided chain it stays.
        self.heads = set()
        self.known = dict(constants)
        self._derive_constants()

    # -- what is known --------------------------------------------------------------------------

    def _derive_constants(self):
        func = self.tree.body[0]
        assigned = {}                    # name -> how many times the body stores to it
        for node in ast.walk(func):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                assigned[node.id] = assigned.get(node.id, 0) + 1
        for name in assigned:            # a parameter the body reassigns is not the caller's value
            self.known.pop(name, None)
        for stmt in func.body:           # top-level statements, in order
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)
                    and assigned[stmt.targets[0].id] == 1):
                value = self.evaluate(stmt.value)
                if value is not _UNKNOWN:
                    self.known[stmt.targets[0].id] = value

    def evaluate(self, expr):
        """The value of ``expr`` if it depends only on known constants, else _UNKNOWN."""
        for node in ast.walk(expr):
            if not isinstance(node, _SAFE) or (isinstance(node, ast.Name) and node.id not in self.known):
                return _UNKNOWN
        try:
            return eval(compile(ast.Expression(expr), "<constants>", "eval"), {"__builtins__": {}},
                        dict(self.known))
        except Exception:                      # noqa: BLE001 -- undecidable: leave the code as is
            return _UNKNOWN

    def truth(self, expr):
        """True or False if ``expr``'s truth is decided by known constants, else _UNKNOWN. Beyond
        ``evaluate``: ``or`` with an operand known true is true, ``and`` with one known false is
        false, whatever the others (``WITH_DINITIAL or c > 0`` with WITH_DINITIAL True), where
        those others are plain expressions (``_pure``: no call whose text would vanish with
        them); ``not`` negates."""
        if isinstance(expr, ast.BoolOp):
            truths = [self.truth(v) for v in expr.values]
            decisive = isinstance(expr.op, ast.Or)          # or: one true decides; and: one false
            if decisive in truths and all(_pure(v) for v in expr.values):
                return decisive
            return _UNKNOWN if _UNKNOWN in truths or decisive in truths else not decisive
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            inner = self.truth(expr.operand)
            return inner if inner is _UNKNOWN else not inner
        value = self.evaluate(expr)
        return value if value is _UNKNOWN else bool(value)

    # -- positions --------------------------------------------------------------------------------

    def offset(self, line, col):
        return self.starts[line - 1] + len(self.lines[line - 1].encode()[:col].decode())

    def line_span(self, first, last):
        """Offsets of whole lines first..last (1-based, inclusive)."""
        return self.starts[first - 1], self.starts[last]

    # -- edits ------------------------------------------------------------------------------------

    def render(self):
        return self.render_span(0, len(self.text), 0)

    def render_span(self, start, end, dedent):
        """The text in [start, end) with every decidable construct inside it edited, then
        ``dedent`` columns removed from each line."""
        edits = []
        self._collect(self.tree, start, end, edits)
        out, pos = [], start
        for s, e, replacement in sorted(edits, key=lambda edit: edit[:2]):
            out.append(self.text[pos:s])
            out.append(replacement())
            pos = e
        out.append(self.text[pos:end])
        text = "".join(out)
        if dedent:
            text = "".join(_dedent_line(line, dedent) for line in text.splitlines(keepends=True))
        return text

    def _collect(self, node, start, end, edits):
        """Edits for the outermost decidable constructs of ``node`` lying in [start, end)."""
        for child in ast.iter_child_nodes(node):
            edit = self._edit(child)
            if edit is not None and start <= edit[0] and edit[1] <= end:
                edits.append(edit)
            else:
                self._collect(child, start, end, edits)

    def _edit(self, node):
        """(start, end, replacement) for a decidable construct, else None; ``replacement`` is a
        function (the text is rendered only where the edit applies)."""
        if isinstance(node, ast.If):
            return self._edit_if(node)
        if isinstance(node, ast.IfExp):
            value = self.truth(node.test)
            if value is _UNKNOWN:
                return None
            kept = node.body if value else node.orelse
            s, e = self._node_span(node)
            return s, e, lambda: self.render_span(*self._node_span(kept), 0)
        if isinstance(node, ast.BoolOp) and self._is_test(node) and self.truth(node) is _UNKNOWN:
            return self._edit_operands(node)
        if isinstance(node, ast.keyword) and node.arg == "latency":
            v = node.value
            if (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "latency_hint"
                    and len(v.args) == 1 and self.evaluate(v.args[0]) == 0):
                span = self._keyword_span(node)
                return None if span is None else span + (str,)
        if isinstance(node, ast.arg) and self.drop_int64 and node.annotation is not None:
            if ast.unparse(node.annotation) == "ct.IndexedWithInt64":
                s = self.offset(node.lineno, node.col_offset) + len(node.arg)
                _, e = self._node_span(node.annotation)
                if self.text[e:e + 1] != ",":
                    return s, e, str
                # Keep a comment after the comma in its column.
                rest = self.text[e + 1:self.text.find("\n", e)]
                pad = " " * (e - s) if rest.lstrip().startswith("#") else ""
                return s, e + 1, lambda: "," + pad
        return None

    def _edit_if(self, node):
        if self._is_elif_clause(node) and node not in self.heads:
            return None
        value = self.truth(node.test)
        if value is _UNKNOWN or not self._editable(node):
            return None
        first, last = self.line_span(node.lineno, node.end_lineno)
        indent = self._indent(node.lineno)
        if value:
            branch, header_line = node.body, node.lineno
        elif node.orelse and self._is_elif_clause(node.orelse[0]):
            # The rest of the chain takes this ``if``'s place: its ``elif`` becomes an ``if``.
            rest = node.orelse[0]
            self.heads.add(rest)
            s, e = self.line_span(rest.lineno, rest.end_lineno)
            return first, last, lambda: _elif_to_if(self.render_span(s, e, 0))
        elif node.orelse:
            branch, header_line = node.orelse, self._else_line(node)
        else:
            return first, last, lambda: self._nothing(node, indent)
        s, _ = self.line_span(header_line + 1, header_line + 1)
        _, e = self.line_span(branch[-1].end_lineno, branch[-1].end_lineno)
        dedent = self._indent(branch[0].lineno) - indent
        return first, last, lambda: self.render_span(s, e, dedent)

    def _is_test(self, node):
        """Whether ``node`` is the whole test of an ``if``, ``elif`` or ``a if TEST else b``
        (where only its truth counts)."""
        parent = self.parents.get(node)
        return isinstance(parent, (ast.If, ast.IfExp)) and parent.test is node

    def _edit_operands(self, node):
        """An undecided ``or`` (``and``) test without its operands known false (true), which
        change nothing: ``WITH_DINITIAL or c > 0`` with WITH_DINITIAL False reads ``c > 0``."""
        drop = not isinstance(node.op, ast.Or)              # or: drop the false; and: the true
        kept = [v for v in node.values if self.truth(v) is not drop]
        if len(kept) == len(node.values) or node.lineno != node.end_lineno:
            return None
        join = " or " if isinstance(node.op, ast.Or) else " and "

        def text():
            parts = [self.render_span(*self._node_span(v), 0) for v in kept]
            if len(kept) > 1:
                parts = [f"({t})" if isinstance(v, (ast.BoolOp, ast.IfExp, ast.NamedExpr,
                                                     ast.Lambda)) else t
                         for v, t in zip(kept, parts)]
            return join.join(parts)
        return self._node_span(node) + (text,)

    def _editable(self, node):
        """Only the plain layout is edited: a one-line test, bodies on lines of their own, no
        string spanning lines (dedenting would change it); anything else is left as it is."""
        if node.test.end_lineno != node.lineno or node.body[0].lineno == node.lineno:
            return False
        if node.orelse and not self._is_elif_clause(node.orelse[0]):
            if self._else_line(node) in (None, node.orelse[0].lineno):
                return False
        return not any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and n.end_lineno != n.lineno for n in ast.walk(node))

    def _nothing(self, node, indent):
        """What replaces a removed ``if``: nothing, or ``pass`` if the block would be empty."""
        parent = self.parents.get(node)
        block = next((getattr(parent, f) for f in ("body", "orelse", "finalbody")
                      if node in getattr(parent, f, [])), [])
        return "" if len(block) > 1 else " " * indent + "pass\n"

    def _is_elif_clause(self, node):
        """An ``If`` written as the ``elif`` of the ``if`` before it."""
        parent = self.parents.get(node)
        return (isinstance(node, ast.If) and isinstance(parent, ast.If) and parent.orelse == [node]
                and self.lines[node.lineno - 1].lstrip().startswith("elif"))

    def _else_line(self, node):
        for n in range(node.body[-1].end_lineno + 1, node.orelse[0].lineno + 1):
            if self.lines[n - 1].lstrip().startswith("else"):
                return n
        return None

    def _indent(self, line):
        text = self.lines[line - 1]
        return len(text) - len(text.lstrip(" "))

    def _node_span(self, node):
        return (self.offset(node.lineno, node.col_offset),
                self.offset(node.end_lineno, node.end_col_offset))

    def _keyword_span(self, node):
        """The keyword argument with the comma and blanks before it, or None when anything else
        (a comment, or no argument before it) lies between."""
        s, e = self._node_span(node)
        while s > 0 and self.text[s - 1] in " \t\n":
            s -= 1
        return (s - 1, e) if s > 0 and self.text[s - 1] == "," else None


def _pure(expr):
    """Whether ``expr`` is made only of names, constants and operators (no call, subscript or
    assignment): leaving it out of the text loses nothing it would do."""
    return all(isinstance(node, _SAFE) for node in ast.walk(expr))


def _elif_to_if(text):
    head, sep, rest = text.partition("\n")
    stripped = head.lstrip(" ")
    if stripped.startswith("elif"):
        head = head[:len(head) - len(stripped)] + stripped[2:]
    return head + sep + rest


_UNKNOWN = object()


def _dedent_line(line, columns):
    if not line.strip():
        return line.lstrip(" \t")          # a blank line stays a blank line
    return line[columns:] if line[:columns].isspace() else line.lstrip(" ")
