"""The documents a user follows: every relative link lands on a file and heading that exist, and every training
command they print names a config that runs (a model file under configs/models/ alone stops with "hardware is
not set")."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from MaxText import config as fork_config
from MaxText.config import parallelism

DOCUMENTS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# `scripts/train.sh CONFIG`, `python -m MaxText.train [--dry-run|--print-config] CONFIG`
TRAIN_COMMAND = re.compile(r"(?:scripts/train\.sh|-m MaxText\.train)(?: --dry-run| --print-config)? (configs/[\w./<>-]+\.yml)")
FAMILIES = ("deepseek3", "deepseek2", "kimi-k2", "qwen3-moe", "mixtral", "gpt-oss", "llama4")


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces as -."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
  return {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links():
  for doc in DOCUMENTS:
    for target in LINK.findall(doc.read_text()):
      if not re.match(r"[a-z]+:", target):
        yield doc, target


def test_every_relative_link_lands_on_a_file_and_heading():
  bad = []
  for doc, target in _links():
    file, _, anchor = target.partition("#")
    dest = (doc.parent / file).resolve() if file else doc
    if not dest.exists():
      bad.append(f"{doc.name}: {target} (no such file)")
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      bad.append(f"{doc.name}: {target} (no such heading)")
  assert not bad, bad


def test_the_link_check_sees_a_missing_heading():
  assert "before-booking-a-671b-run-remat-and-offload" in _anchors(REPO / "docs/cluster.md")
  assert "no-such-heading" not in _anchors(REPO / "docs/cluster.md")
  assert _slug("DeepSeek-V3's router (`moe_router: deepseek_v3`)") == "deepseek-v3s-router-moe_router-deepseek_v3"


def _commanded_configs() -> dict[str, str]:
  """Each config a document's train command names (`<family>` expanded) -> the document."""
  found = {}
  for doc in DOCUMENTS:
    for path in TRAIN_COMMAND.findall(doc.read_text()):
      for expanded in ([path.replace("<family>", f) for f in FAMILIES] if "<family>" in path else [path]):
        found.setdefault(expanded, doc.name)
  return found


def test_every_train_command_in_the_documents_names_a_config_that_runs():
  configs = _commanded_configs()
  assert {f"configs/{f}-tiny.yml" for f in FAMILIES} <= set(configs)  # README's family command, expanded
  for path, doc in configs.items():
    assert (REPO / path).is_file(), (doc, path)
    run = fork_config.load([str(REPO / path)])
    parallelism.check_hardware(run.upstream, run.explicit)  # raises for a model file alone


def test_a_model_file_alone_is_what_the_command_check_refuses():
  run = fork_config.load([str(REPO / "configs/models/qwen3-moe-tiny.yml")])
  with pytest.raises(parallelism.LaunchError, match="hardware is not set"):
    parallelism.check_hardware(run.upstream, run.explicit)


def test_the_families_page_names_each_familys_three_configs():
  text = (REPO / "docs/families.md").read_text()
  for family in FAMILIES:
    tiny, proxy = f"configs/{family}-tiny.yml", f"configs/bench/{family}-proxy-1xh200.yml"
    if family == "deepseek3":
      proxy = "configs/bench/proxy-1xh200.yml"
    assert tiny in text and proxy in text, family
    assert (REPO / tiny).is_file() and (REPO / proxy).is_file(), family
  for recipe in sorted((REPO / "configs/recipes").glob("*-8xh100.yml")):
    assert f"configs/recipes/{recipe.name}" in text, recipe.name


def test_troubleshooting_explains_every_exit_code():
  from MaxText.config import command_line  # pylint: disable=import-outside-toplevel

  codes = sorted({v for k, v in vars(command_line).items() if k.startswith("EXIT_") and isinstance(v, int)})
  assert codes == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 75, 130]
  for doc in ("README.md", "docs/troubleshooting.md", "docs/cluster.md"):
    text = (REPO / doc).read_text()
    for code in codes:
      assert re.search(rf"^\| {code} \| \S", text, re.M), (doc, code)


def test_the_trainer_and_the_planner_share_only_their_common_codes():
  """A code means one thing across `python -m MaxText.train` and `python -m MaxText.plan`: 9 meant "data exhausted"
  to the one and "the plan's account is violated" to the other; the trainer's data exhausted is 11 now. Both
  tables say so."""
  from MaxText.config import command_line  # pylint: disable=import-outside-toplevel
  from MaxText.plan import __main__ as plan_cli  # pylint: disable=import-outside-toplevel

  shared = set(command_line.EXIT_CODES) & set(plan_cli.EXIT_CODES)
  assert shared == {command_line.EXIT_OK, command_line.EXIT_ERROR, command_line.EXIT_CONFIG, command_line.EXIT_ABORTED}
  assert command_line.EXIT_DATA_EXHAUSTED == 11 and plan_cli.EXIT_INVARIANT == 9
  planner = (REPO / "docs" / "planner.md").read_text()
  trouble = (REPO / "docs" / "troubleshooting.md").read_text()
  assert re.search(r"^\| 9 \| planned, but the one account .* is violated", planner, re.M)
  assert "9 (planned, but the\nplan's account is violated" in trouble
  assert re.search(r"^\| 11 \| the grain data ran out", trouble, re.M)


def test_every_tool_is_named_with_its_command_in_the_tools_readme():
  """tools/ holds what the docs run: each script appears in tools/README.md in a command that runs it."""
  readme = (REPO / "tools" / "README.md").read_text()
  scripts = [p.relative_to(REPO / "tools") for p in (REPO / "tools").rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts]
  helpers = {"te_offline/repack_wheel.py", "te_offline/prune_fatbin.py"}  # called by te_offline/build.sh
  for script in scripts:
    if str(script) in helpers:
      assert str(script.name) in (REPO / "tools" / "te_offline" / "build.sh").read_text()
      continue
    assert re.search(rf"`(?:[A-Z_]+=\S+ )*(?:python3|bash|source) tools/{re.escape(str(script))}\b", readme), script


def test_the_front_pages_stay_short():
  """README.md and BENCHMARKS.md are read first, whole: detail goes to a docs/ page (or to git history), not here."""
  for name, limit in (("README.md", 300), ("BENCHMARKS.md", 400)):
    lines = len((REPO / name).read_text().splitlines())
    assert lines <= limit, f"{name} has {lines} lines, over {limit}: move detail to the docs/ page that owns it"
