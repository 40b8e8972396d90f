"""One upstream seam: a named attribute of an upstream module that we replace.

A seam refuses to patch unless the installed maxtext is the version it was
written for *and* the target's source still hashes to what we read there, so a
silent upstream change can never be papered over. Applying twice is a no-op;
`undo` restores the original object (tests use it).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

UPSTREAM_VERSION = "0.2.5"


class UpstreamMismatch(RuntimeError):
  """The installed upstream is not the one a patch was written for."""


def installed_package_version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def installed_maxtext_version() -> str:
  return installed_package_version("maxtext")


def source_sha256(obj: Any) -> str:
  """Short hash of an object's source: what we compare against upstream 0.2.5."""
  return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def _resolve(owner: Any, dotted: str) -> tuple[Any, str]:
  """'Class.method' under a module -> (Class, 'method')."""
  *path, attr = dotted.split(".")
  for part in path:
    owner = getattr(owner, part)
  return owner, attr


@dataclass
class Seam:
  """`module:attr` in upstream, with the hash of its 0.2.5 source.

  Attributes:
    name: our name for the seam, used in messages.
    module: upstream module path, e.g. "maxtext.kernels.megablox".
    attr: attribute path inside it, e.g. "gmm" or "MetricLogger.write_metrics".
    sha256: `source_sha256` of the target in maxtext UPSTREAM_VERSION; None for
      targets with no Python source (then only the version is checked).
    version: the version of `package` the seam was written for.
    package: the distribution whose version is checked: maxtext, or jax for a seam inside jax that
      maxtext's pin does not decide (patches/cudnn_mla_vmap.py).
  """

  name: str
  module: str
  attr: str
  sha256: str | None
  version: str = UPSTREAM_VERSION
  package: str = "maxtext"
  _original: Any = field(default=None, init=False, repr=False)
  _replacement: Any = field(default=None, init=False, repr=False)

  def target(self) -> Any:
    owner, attr = _resolve(importlib.import_module(self.module), self.attr)
    return getattr(owner, attr)

  def check(self, installed_version: str | None = None) -> None:
    """Raises UpstreamMismatch, naming both versions, if the target moved."""
    have = installed_version or installed_package_version(self.package)
    where = f"{self.module}.{self.attr}"
    pkg = self.package
    if have != self.version:
      raise UpstreamMismatch(
          f"patch '{self.name}' targets {pkg} {self.version} ({where}), but {pkg} {have} is installed; "
          f"install {pkg}=={self.version} (see requirements/lock.txt) or port the patch"
      )
    if self.sha256 is None or self.applied:  # applied: checked then; the attribute is now ours
      return
    try:
      got = source_sha256(self.target())
    except (AttributeError, ImportError, OSError, TypeError) as e:
      raise UpstreamMismatch(
          f"patch '{self.name}' targets {where} in {pkg} {self.version}, but it cannot be read in the "
          f"installed {pkg} {have}: {e}"
      ) from e
    if got != self.sha256:
      raise UpstreamMismatch(
          f"patch '{self.name}': {where} differs from {pkg} {self.version}'s (source hash {got}, "
          f"expected {self.sha256}) in the installed {pkg} {have}; re-read the seam before patching"
      )

  @property
  def applied(self) -> bool:
    return self._replacement is not None

  def apply(self, make_replacement: Callable[[Any], Any]) -> None:
    """Checks the target, then installs make_replacement(original). Idempotent."""
    if self.applied:
      return
    self.check()
    owner, attr = _resolve(importlib.import_module(self.module), self.attr)
    self._original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    self._replacement = make_replacement(getattr(owner, attr))
    setattr(owner, attr, self._replacement)

  def undo(self) -> None:
    if not self.applied:
      return
    owner, attr = _resolve(importlib.import_module(self.module), self.attr)
    setattr(owner, attr, self._original)
    self._original = self._replacement = None


def apply_module(module: Any, fork: Any = None, hooks: Any = None) -> None:
  """Applies one seam module: its own `apply(fork, hooks)` where it has one, else the default, which replaces its
  SEAM's target by `module.wrap(original)`. A module writes only what differs from the default."""
  if hasattr(module, "apply"):
    module.apply(fork, hooks)
  else:
    module.SEAM.apply(module.wrap)


def undo_module(module: Any) -> None:
  """Restores upstream: the module's own `undo()` where it has one (it resets state of its own), else SEAM.undo()."""
  if hasattr(module, "undo"):
    module.undo()
  else:
    module.SEAM.undo()
