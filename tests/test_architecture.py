"""The shape of the package: no import cycle, flags only in the launchers, long modules say
why, and docs/architecture.dot draws the real imports.

Rules (checked on the source with ``ast``, nothing is imported):

1. **No import cycle** among ``tf_dpnsgd`` modules, counting the imports that run
   when a module is imported: module level, inside top-level ``if``/``try``/
   ``with`` blocks and class bodies; not inside functions, ``if TYPE_CHECKING:``
   or ``if __name__ == "__main__":``. ``import a.b.c`` and ``from a.b import c``
   depend on the module ``a.b.c`` (or on ``a.b`` when ``c`` is a name in it),
   and also on each package on the way (``a.b``: its ``__init__`` runs first)
   unless that package contains the importing module (a package's own
   ``__init__`` importing its submodules, which import each other, is the
   usual facade, not a cycle). A function-level import (e.g. the lazy alias in
   :mod:`tf_dpnsgd.tuning`) is not an edge: it runs after both modules exist.
2. **Flags only in launchers**: outside ``tf_dpnsgd.launch`` no module imports
   ``absl.flags``.
3. **Long modules say why**: a module of more than :data:`MAX_LINES` lines
   states the reason in the first :data:`REASON_LINES` lines of its docstring,
   in a sentence with the word "long" or "lines" (e.g. "This module is long
   (about 600 lines): ..."). :data:`EXEMPT` lists the modules that do not yet,
   each with the reason; an exemption that is no longer needed fails the test,
   so the list cannot rot.
4. **The diagram is the import graph**: the solid arrows of
   ``docs/architecture.dot`` are exactly rule 1's imports between the
   package's first-level modules and subpackages (one node each).
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tf_dpnsgd")
PACKAGE = "tf_dpnsgd"
MAX_LINES = 450
REASON_LINES = 12
REASON = re.compile(r"\b(long|lines)\b", re.IGNORECASE)

# Modules over MAX_LINES whose docstring does not (yet) say why; path -> why exempt.
EXEMPT = {}


def _modules() -> dict:
  """``{dotted name: path}`` of every ``.py`` file under the package."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
      if rel[-1] == "__init__":
        rel = rel[:-1]
      out[".".join(rel)] = path
  return out


MODULES = _modules()


def _is_package(module: str) -> bool:
  return MODULES.get(module, "").endswith("__init__.py")


def _skipped_if(node: ast.If) -> bool:
  test = ast.unparse(node.test)
  return "TYPE_CHECKING" in test or "__name__" in test


def _import_time_nodes(body):
  """The statements of ``body`` that run when the module is imported."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    if isinstance(node, ast.If):
      if not _skipped_if(node):
        yield from _import_time_nodes(node.body)
        yield from _import_time_nodes(node.orelse)
      continue
    if isinstance(node, ast.Try):
      for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
        yield from _import_time_nodes(block)
      continue
    if isinstance(node, (ast.With, ast.ClassDef)):
      yield from _import_time_nodes(node.body)
      continue
    yield node


def _imported(module: str, tree: ast.Module) -> set:
  """Dotted names imported at import time (any package, relative imports resolved)."""
  names = set()
  for node in _import_time_nodes(tree.body):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if _is_package(module) else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module
      for alias in node.names:
        full = f"{source}.{alias.name}"
        names.add(full if full in MODULES else source)
  return names


def _edges(module: str, imported: str) -> set:
  """The package modules that importing ``imported`` from ``module`` runs (rule 1)."""
  if imported not in MODULES:
    return set()
  parts = imported.split(".")
  targets = {imported}
  for i in range(2, len(parts)):  # packages on the way, below the root package
    package = ".".join(parts[:i])
    if not (module == package or module.startswith(package + ".")):
      targets.add(package)
  targets.discard(module)
  return targets


def import_graph() -> dict:
  graph = {}
  for module, path in MODULES.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    graph[module] = set()
    for name in _imported(module, tree):
      graph[module] |= _edges(module, name)
  return graph


def find_cycle(graph: dict):
  """One cycle as a list of modules, or None (iterative depth-first search)."""
  state = {}  # 1: on the current path, 2: done
  for start in sorted(graph):
    if start in state:
      continue
    path, stack = [start], [iter(sorted(graph[start]))]
    state[start] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif nxt not in state:
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph.get(nxt, ()))))
  return None


def test_the_scan_sees_the_known_edges():
  graph = import_graph()
  assert len(graph) > 40
  assert "tf_dpnsgd.accounting.validation" in graph["tf_dpnsgd.noise"]
  assert "tf_dpnsgd.accounting" in graph["tf_dpnsgd.noise"]          # its __init__ runs first
  assert "tf_dpnsgd.callbacks" in graph["tf_dpnsgd.plan"]
  assert "tf_dpnsgd.plan" not in graph["tf_dpnsgd.callbacks"]         # data flows one way
  assert "tf_dpnsgd.sweeps" not in graph["tf_dpnsgd.tuning"]          # lazy alias only
  assert "tf_dpnsgd.accounting" not in graph["tf_dpnsgd.accounting.rdp"]  # own package
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_flags_are_read_only_in_launchers():
  offenders = []
  for module, path in MODULES.items():
    if module == f"{PACKAGE}.launch" or module.startswith(f"{PACKAGE}.launch."):
      continue
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    for node in _import_time_nodes(tree.body):
      if isinstance(node, ast.Import) and any(a.name == "absl.flags" for a in node.names):
        offenders.append(module)
      if isinstance(node, ast.ImportFrom) and node.module == "absl" and any(
          a.name == "flags" for a in node.names):
        offenders.append(module)
  assert not offenders, f"absl.flags imported outside tf_dpnsgd.launch: {offenders}"


def _states_why_long(path: str) -> bool:
  with open(path, encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
  return any(REASON.search(line) for line in doc.splitlines()[:REASON_LINES])


def _line_count(path: str) -> int:
  with open(path, encoding="utf-8") as f:
    return sum(1 for _ in f)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_long_modules_say_why(module):
  path = MODULES[module]
  rel = os.path.relpath(path, os.path.dirname(ROOT)).replace(os.sep, "/")
  long_without_reason = _line_count(path) > MAX_LINES and not _states_why_long(path)
  if rel in EXEMPT:
    assert long_without_reason, f"{rel} no longer needs its exemption: remove it from EXEMPT."
    pytest.skip(f"{rel}: exempt ({EXEMPT[rel]})")
  assert not long_without_reason, (
      f"{rel} has {_line_count(path)} lines (> {MAX_LINES}): split it, or say why it is long "
      f"in the first {REASON_LINES} lines of its docstring (a sentence with 'long' or 'lines').")


DIAGRAM = os.path.join(os.path.dirname(ROOT), "docs", "architecture.dot")
_ARROW = re.compile(r"^\s*(\w+)\s*->\s*(\{[^}]*\}|\w+)\s*(\[[^\]]*\])?\s*;", re.MULTILINE)


def node_of(module: str):
  """The diagram's node of a module: its first-level name under the package (``None``
  for the root package's ``__init__``, the facade that imports everything)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def module_level_graph() -> set:
  """``{(a, b)}``: some module of node ``a`` imports one of node ``b`` (rule 1's edges)."""
  edges = set()
  for module, targets in import_graph().items():
    for target in targets:
      a, b = node_of(module), node_of(target)
      if a and b and a != b:
        edges.add((a, b))
  return edges


def diagram_imports() -> set:
  """The solid arrows of docs/architecture.dot (dashed ones are the flows)."""
  with open(DIAGRAM, encoding="utf-8") as f:
    text = f.read()
  solid, dashed = set(), set()
  style_dashed = False
  for line in text.splitlines():
    if line.strip().startswith("edge ["):
      style_dashed = "dashed" in line
    for a, targets, attrs in _ARROW.findall(line):
      bucket = dashed if style_dashed or "dashed" in (attrs or "") else solid
      for b in targets.strip("{}").split():
        bucket.add((a, b))
  return solid


def test_diagram_arrows_are_the_imports():
  """docs/architecture.dot draws each import between nodes once, and nothing else solid."""
  actual, drawn = module_level_graph(), diagram_imports()
  assert not actual - drawn, f"imports missing from docs/architecture.dot: {sorted(actual - drawn)}"
  assert not drawn - actual, f"arrows in docs/architecture.dot that no import makes: " \
                             f"{sorted(drawn - actual)}"


def test_exemptions_exist():
  for rel in EXEMPT:
    assert os.path.exists(os.path.join(os.path.dirname(ROOT), rel)), rel
