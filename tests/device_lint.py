"""A static check that every tensor the package hands a collective was made on the group's device.

NCCL takes device tensors only: a ``torch.tensor([...])`` made without a
device and handed to ``dist.all_reduce`` runs on gloo and dies on NCCL
("No backend type associated with device type cpu"), which is how
``ddpkit train`` and ``ddpkit bench`` crashed on the first GPU machine. The
CPU suite cannot see that by running the code (on gloo every tensor is on
the right device), so this reads the code instead.

For every call of a collective (``torch.distributed``'s, point-to-point
messages as ``dist.P2POp`` included, ddpkit's own in
:mod:`ddpkit.comm.allreduce`, and the aliases in
:mod:`ddpkit.runtime.compat`) it follows each argument back through the
function's assignments, ``append`` calls, list comprehensions, ``*_like``
constructors and device-keeping methods (``clone``, ``view``, ``double``,
``to(dtype)``, indexing, ...) to where the tensor was made, and reports it when

* a factory (``torch.tensor``, ``zeros``, ``ones``, ``empty``, ``full``, ``arange``,
  ``stack`` of such, ...) made it without a ``device=`` argument, or with the CPU
  spelled out (``device="cpu"``, ``torch.device("cpu")``);
* it was moved to the CPU on the way (``.cpu()``, ``.to("cpu")``, ``torch.from_numpy``).

The rule for the package follows from it: a tensor made for a collective
takes its device from :func:`ddpkit.runtime.devices.comm_device` (or from
another tensor already on the right device). A collective on a group that
is CPU-only by design (the parameter servers' gloo channel) says so on its
line with ``# cpu group: <why>``, which this check accepts.

What flows in from another function (an argument, an attribute, a return
value) is not followed: those are the engine's gradients, parameters and
buffers, on the model's device by construction.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

DIST_MODULES = {"torch.distributed", "ddpkit.comm.allreduce", "ddpkit.comm.direct", "ddpkit.runtime.compat",
                "ddpkit.collectives"}
"""Modules whose functions are collectives here (every public function of them takes tensors to reduce/move)."""
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_tensor",
    "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "P2POp", "direct_all_gather", "direct_reduce_scatter",
}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "rand", "randn",
             "randint", "randperm", "as_tensor", "scalar_tensor", "eye", "empty_strided"}
ALWAYS_CPU = {"from_numpy", "frombuffer"}
JOINS = {"stack", "cat", "concat", "concatenate", "hstack", "vstack"}
LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "clone"}
KEEPS = {"clone", "detach", "double", "float", "half", "bfloat16", "long", "int", "short", "bool", "view",
         "view_as", "reshape", "reshape_as", "flatten", "contiguous", "div_", "mul_", "add_", "sub_", "zero_",
         "fill_", "copy_", "narrow", "squeeze", "unsqueeze", "t", "abs", "neg", "expand", "repeat", "requires_grad_",
         "type_as", "__getitem__", "unflatten", "split", "chunk", "unbind"}
DTYPES = {"float", "double", "half", "bfloat16", "float16", "float32", "float64", "int", "int8", "int16", "int32",
          "int64", "uint8", "long", "bool", "complex64", "complex128", "short"}
EXEMPT = "# cpu group:"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    collective: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.collective}: {self.why}"


def _aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to a collectives module, names bound to a collective function) in this module."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in DIST_MODULES:
                    modules.add(a.asname or a.name)
                elif node.module in DIST_MODULES and a.name in COLLECTIVES:
                    functions.add(a.asname or a.name)
    return modules, functions


def _collective(call: ast.Call, modules: set[str], functions: set[str],
                wrapped: dict[str, set[int]] | None = None) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and (f.id in functions or f.id in (wrapped or {})):
        return f.id
    if isinstance(f, ast.Attribute) and f.attr in (wrapped or {}) and f.attr not in COLLECTIVES:
        return f.attr
    if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
        base = ast.unparse(f.value)
        if base in modules or base == "torch.distributed":
            return f"{base}.{f.attr}"
    return None


def _is_cpu(node: ast.expr) -> bool:
    """``"cpu"``, ``torch.device("cpu")`` and the like."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.device", "device") and node.args:
        return _is_cpu(node.args[0])
    return False


def _is_dtype(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch" and node.attr in DTYPES


class _Scope:
    """One function's (or the module's) assignments, to follow a name back to where its value was made.

    Flow-sensitive in the simple way: of the assignments before the line that
    uses a name, the last one in a block around that line hides the earlier
    ones (``t = t.to(device)`` after ``t = torch.tensor(x)`` is fine); one in a
    branch beside it (an ``if`` arm) does not.
    """

    def __init__(self, body: ast.AST) -> None:
        self.sources: dict[str, list[tuple[int, tuple[int, ...], ast.expr, bool]]] = {}
        for stmt, blocks in _statements(body):
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                for t in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    for name, value in _bind(t, stmt.value):
                        self._add(name, stmt.lineno, blocks, value, kills=True)
            for sub in _own_expressions(stmt):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) \
                        and sub.func.attr in ("append", "extend", "insert") and isinstance(sub.func.value, ast.Name):
                    for arg in sub.args[-1:]:
                        value = arg if sub.func.attr != "extend" else _element(arg)
                        if value is not None:
                            self._add(sub.func.value.id, sub.lineno, blocks, value, kills=False)

    def _add(self, name: str, line: int, blocks: tuple[int, ...], value: ast.expr, kills: bool) -> None:
        self.sources.setdefault(name, []).append((line, blocks, value, kills))

    def values(self, name: str, line: int, blocks: tuple[int, ...]) -> list[tuple[ast.expr, int, tuple[int, ...]]]:
        """What ``name`` may hold at ``line`` (in ``blocks``): each value with where it was assigned."""
        before = [s for s in self.sources.get(name, []) if s[0] < line]
        if not before:
            return [(s[2], s[0], s[1]) for s in self.sources.get(name, [])]  # a loop may carry it round
        cut = max((i for i, s in enumerate(before) if s[3] and blocks[: len(s[1])] == s[1]), default=0)
        return [(s[2], s[0], s[1]) for s in before[cut:] if not _exclusive(s[1], blocks)]

    def cpu(self, device: ast.expr, at: tuple[int, tuple[int, ...]]) -> bool:
        """Whether the device expression ``device`` (a name followed back) is the CPU."""
        if isinstance(device, ast.Name):
            return any(self.cpu(v, (line, blocks)) for v, line, blocks in self.values(device.id, *at)
                       if not (isinstance(v, ast.Name) and v.id == device.id))
        if isinstance(device, ast.IfExp):
            return self.cpu(device.body, at) or self.cpu(device.orelse, at)
        return _is_cpu(device)

    def why(self, node: ast.expr, at: tuple[int, tuple[int, ...]], seen: frozenset[str] = frozenset(),
            depth: int = 0) -> str | None:
        """Why the tensor(s) ``node`` (used at ``at``: line, blocks) are off the group's device, or None (fine
        or unknown)."""
        if depth > 12:
            return None
        follow = lambda n: self.why(n, at, seen, depth + 1)  # noqa: E731
        if isinstance(node, ast.Name):
            if node.id in seen:
                return None
            for source, line, blocks in self.values(node.id, *at):
                if (reason := self.why(source, (line, blocks), seen | {node.id}, depth + 1)) is not None:
                    return f"{node.id} = {reason}"
            return None
        if isinstance(node, (ast.List, ast.Tuple)):
            return next((r for e in node.elts if (r := follow(e)) is not None), None)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            return follow(node.elt)
        if isinstance(node, ast.Starred):
            return follow(node.value)
        if isinstance(node, ast.Subscript):
            return follow(node.value)
        if isinstance(node, ast.IfExp):
            return follow(node.body) or follow(node.orelse)
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        text = ast.unparse(node)
        if isinstance(f, ast.Attribute) and ast.unparse(f.value) == "torch":
            if f.attr in FACTORIES:
                device = next((k.value for k in node.keywords if k.arg == "device"), None)
                if device is None:
                    return f"{text} is made without device= (it lands on the CPU)"
                if self.cpu(device, at):
                    return f"{text} is made on the CPU"
                return None
            if f.attr in ALWAYS_CPU:
                return f"{text} is a CPU tensor"
            if f.attr in LIKE:
                if any(k.arg == "device" for k in node.keywords):
                    device = next(k.value for k in node.keywords if k.arg == "device")
                    return f"{text} is made on the CPU" if self.cpu(device, at) else None
                return follow(node.args[0]) if node.args else None
            if f.attr in JOINS:
                return follow(node.args[0]) if node.args else None
            return None
        if isinstance(f, ast.Attribute):
            if f.attr == "cpu":
                return f"{text} moves it to the CPU"
            if f.attr == "to":
                moved = [a for a in node.args if not _is_dtype(a)] + \
                        [k.value for k in node.keywords if k.arg == "device"]
                if any(self.cpu(m, at) for m in moved):
                    return f"{text} moves it to the CPU"
                return follow(f.value) if not moved else None
            if f.attr in KEEPS:
                return follow(f.value)
        return None


_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _statements(root: ast.AST, blocks: tuple[int, ...] = ()):
    """``(statement, blocks)`` for every statement of ``root`` outside nested functions, ``blocks`` naming the
    statement lists around it, outermost first, each as (id of the statement holding it, field)."""
    for field in ("body", "orelse", "finalbody", "handlers"):
        stmts = getattr(root, field, None)
        if not isinstance(stmts, list):
            continue
        inner = (*blocks, (id(root), field))
        for stmt in stmts:
            yield stmt, inner
            if not isinstance(stmt, _NESTED):
                yield from _statements(stmt, inner)


def _exclusive(a: tuple, b: tuple) -> bool:
    """Whether code in blocks ``a`` and in blocks ``b`` sit in two arms of one ``if`` (never both run)."""
    for x, y in zip(a, b):
        if x != y:
            return x[0] == y[0] and {x[1], y[1]} == {"body", "orelse"}
    return False


def _own_expressions(stmt: ast.stmt):
    """The expression nodes of ``stmt`` itself, not of the statements inside it."""
    stack = [c for c in ast.iter_child_nodes(stmt) if not isinstance(c, (ast.stmt, ast.excepthandler))]
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


def _walk_own(root: ast.AST):
    """The nodes of ``root`` without descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, _NESTED):
            stack.extend(ast.iter_child_nodes(node))


def _bind(target: ast.expr, value: ast.expr) -> list[tuple[str, ast.expr]]:
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            return [b for t, v in zip(target.elts, value.elts) for b in _bind(t, v)]
        return [b for t in target.elts for b in _bind(t, ast.Subscript(value=value, slice=ast.Constant(0)))]
    return []


def _element(node: ast.expr) -> ast.expr | None:
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        return node.elts[0]
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
        return node.elt
    return node


def wrappers(sources: list[str], known: dict[str, set[int]] | None = None) -> dict[str, set[int]]:
    """The package's own functions that hand an argument straight to a collective: name -> those positions.

    ``all_reduce_used_map(flags, group, step)`` calls ``dist.all_reduce(flags, ...)``: a call of it is a
    collective on its first argument, and a tensor made for it is checked as one made for the collective.
    """
    found = {name: set(positions) for name, positions in (known or {}).items()}  # (known's sets stay as they were)
    for source in sources:
        tree = ast.parse(source)
        modules, functions = _aliases(tree)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            params = [a.arg for a in fn.args.args]
            for node in _walk_own(fn):
                if isinstance(node, ast.Call) and _collective(node, modules, functions, found) is not None:
                    handed = [_base(a) for a in _tensor_args(node, found)]
                    positions = {params.index(name) for name in handed if name in params and name not in NOT_TENSORS}
                    if positions:
                        found.setdefault(fn.name, set()).update(positions)
    return found


NOT_TENSORS = {"self", "group", "process_group", "pg", "src", "dst", "op", "tag", "members", "me", "to", "frm",
               "step", "owner", "async_op"}
"""Parameter names that are never the tensors a wrapper hands on."""


def _base(node: ast.expr) -> str | None:
    """The name a tensor expression starts from through device-keeping methods (``t.contiguous().view(-1)``)."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KEEPS | {"view"}:
        node = node.func.value
    return node.id if isinstance(node, ast.Name) else None


def _tensor_args(call: ast.Call, wrapped: dict[str, set[int]]) -> list[ast.expr]:
    """The arguments of a collective that may be tensors (for one of the package's wrappers: the ones it hands on)."""
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    if name in wrapped and name not in COLLECTIVES:
        return [a for i, a in enumerate(call.args) if i in wrapped[name]]
    return list(call.args) + [k.value for k in call.keywords
                              if k.arg not in ("src", "dst", "op", "group", "async_op", "tag")]


def check_source(source: str, path: str = "<source>", wrapped: dict[str, set[int]] | None = None) -> list[Finding]:
    """Every collective in ``source`` (and call of one of ``wrapped``, see :func:`wrappers`) handed a tensor made
    off the group's device."""
    tree = ast.parse(source)
    lines = source.splitlines()
    modules, functions = _aliases(tree)
    wrapped = wrappers([source], wrapped)
    findings: list[Finding] = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope_node in scopes:
        scope = _Scope(scope_node)
        for stmt, blocks in _statements(scope_node):
            for node in _own_expressions(stmt):
                if not isinstance(node, ast.Call) or (name := _collective(node, modules, functions, wrapped)) is None:
                    continue
                if any(EXEMPT in lines[i - 1] for i in range(node.lineno, getattr(node, "end_lineno", node.lineno) + 1)):
                    continue
                for arg in _tensor_args(node, wrapped):
                    if (why := scope.why(arg, (node.lineno, blocks))) is not None:
                        findings.append(Finding(path, node.lineno, name, why))
                        break
    return sorted(findings, key=lambda f: (f.path, f.line))


@functools.cache
def package_wrappers(root: Path) -> dict[str, set[int]]:
    """:func:`wrappers` of every module under ``root`` (twice: a wrapper of a wrapper counts too); read once per
    process (1.5 s here): not to be changed by the caller."""
    sources = [path.read_text() for path in sorted(root.rglob("*.py"))]
    return wrappers(sources, wrappers(sources))


def check_tree(root: Path) -> list[Finding]:
    """:func:`check_source` over every module under ``root``."""
    wrapped = package_wrappers(root)
    found: list[Finding] = []
    for path in sorted(root.rglob("*.py")):
        found += check_source(path.read_text(), str(path.relative_to(root.parent)), wrapped)
    return found
