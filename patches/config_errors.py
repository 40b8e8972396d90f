"""Seam: maxtext.configs.pyconfig._handle_config_exception (maxtext 0.2.5).

Upstream reacts to a config error by logging a banner, writing
/dev/termination-log (outside the run directory; as root it creates that
file) and calling sys.exit(2) outside pytest. Every caller re-raises right
after it returns, so a handler that does nothing lets the exception reach
MaxText/run/main.py, which prints one line naming the key and exits 2.
"""

from __future__ import annotations

from patches._seam import Seam

SEAM = Seam(
    name="config_errors",
    module="maxtext.configs.pyconfig",
    attr="_handle_config_exception",
    sha256="2ef1a11761a64e77",
)


def wrap(original):
  def _handle_config_exception(e):  # pylint: disable=unused-argument
    return None  # the caller's `raise e` carries the error to our entry point

  _handle_config_exception.__wrapped__ = original
  return _handle_config_exception


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True
