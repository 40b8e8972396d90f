"""The package's import graph has no circles: every `import`/`from ... import` of a MaxText or patches module,
top-level or inside a function, is an edge. A circle means two modules that cannot be read (or loaded) one
before the other; the planner and the FP8 kernels each had one before they became packages."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("MaxText", "patches")


def _module_name(path: Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
  paths = [p for root in ROOTS for p in (REPO / root).rglob("*.py")]
  modules = {_module_name(p): p for p in paths}
  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
          base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
      else:
        continue
      edges |= {t for t in targets if t in modules and t != name}
    graph[name] = edges
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_graph_sees_the_packages_edges():
  graph = _graph()  # the check below proves nothing if the parser saw no edges
  assert "MaxText.plan.planner" in graph["MaxText.plan.search"]
  assert "MaxText.moe.gmm.mgpu.fp8_tgmm" in graph["MaxText.moe.gmm.mgpu.fp8"]


def test_no_import_circles():
  assert _cycles(_graph()) == []


def test_a_circle_is_found():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Which package may import which: data flows down, from the entry points through the run's life to configuration,
# checkpoints, the seams (patches) and the MoE pieces. The MoE block and the planner never import the run's life, and
# the run never imports the planner: the GPUs' facts both read (MaxText.hardware) sit below both and import neither.
# An entry point (MaxText.train, MaxText.export_hf, MaxText.import_hf, the planner's __main__) may import anything.
MAY_IMPORT = {
    "MaxText.hardware": set(),
    "MaxText.console": set(),
    "MaxText.moe": set(),
    "MaxText.accumulate": set(),  # gradient accumulation's schedules: jax only; the seam that uses them is above
    "MaxText.attention": {"MaxText.moe"},  # beside the MoE pieces: their varying-axes typing and TE release
    "MaxText.config": {"MaxText.console", "MaxText.moe", "patches"},
    "MaxText.checkpoints": {"MaxText.config", "MaxText.console"},
    # The seams raise the config's one-line error (MaxText.config.keys alone, which imports nothing of ours), and
    # read and write our checkpoint records around upstream's saves and restores.
    "patches": {"MaxText.config.keys", "MaxText.checkpoints", "MaxText.console", "MaxText.moe", "MaxText.attention"},
    "MaxText.plan": {"MaxText.config", "MaxText.checkpoints", "MaxText.console", "MaxText.hardware", "MaxText.moe",
                     "patches"},
    "MaxText.hf": {"MaxText.config", "MaxText.checkpoints", "MaxText.console", "MaxText.moe", "patches"},
    "MaxText.run": {"MaxText.config", "MaxText.checkpoints", "MaxText.console", "MaxText.hardware", "MaxText.moe",
                    "patches"},
}
ENTRY_POINTS = {"MaxText.train", "MaxText.export_hf", "MaxText.import_hf", "MaxText.plan.__main__"}


def _package(module: str) -> str:
  """The layer a module belongs to: its package under MaxText, or patches; the module itself for a flat one."""
  parts = module.split(".")
  return "patches" if parts[0] == "patches" else ".".join(parts[:2]) if len(parts) > 2 else module


def _allowed(importer: str, imported: str) -> bool:
  if importer in ENTRY_POINTS or _package(importer) == _package(imported) or imported == "MaxText":
    return True
  allowed = MAY_IMPORT[_package(importer)]
  return _package(imported) in allowed or any(imported == a or imported.startswith(a + ".") for a in allowed)


def test_maxtext_has_no_flat_module_but_the_entry_points_and_the_hardware_facts_and_every_package_has_a_layer():
  flat = {p.stem for p in (REPO / "MaxText").glob("*.py")}
  assert flat == {"__init__", "train", "export_hf", "import_hf", "hardware"}
  packages = {f"MaxText.{p.parent.name}" for p in (REPO / "MaxText").glob("*/__init__.py")}
  assert packages == set(MAY_IMPORT) - {"patches", "MaxText.hardware"}


def test_each_package_imports_only_the_layers_below_it():
  graph = _graph()
  wrong = sorted(f"{a} -> {b}" for a, edges in graph.items() for b in edges if not _allowed(a, b))
  assert wrong == []


def test_the_layering_check_catches_an_upward_import():
  """The rule above fails where it should: the planner importing the run's life, a seam the config's loader."""
  assert not _allowed("MaxText.plan.planner", "MaxText.run.main")
  assert not _allowed("MaxText.moe.block", "MaxText.run.lifecycle")
  assert not _allowed("patches.routed_moe", "MaxText.config.loader")
  assert _allowed("patches.routed_moe", "MaxText.config.keys")
  assert not _allowed("MaxText.run.loop", "MaxText.plan.planner")  # the run reads the GPUs' facts, not the planner
  assert not _allowed("MaxText.hardware", "MaxText.plan.planner")
  assert not _allowed("MaxText.hardware", "MaxText.run.loop")
  assert _allowed("MaxText.run.loop", "MaxText.hardware")
  assert _allowed("MaxText.plan.schedule", "MaxText.hardware")
