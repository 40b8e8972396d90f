"""Seam: maxtext.utils.maxtext_utils.calculate_tflops_training_per_device (maxtext 0.2.5), quiet unless `verbose=true`.

Upstream's metric logger computes the model FLOPs of a step once, before the first step, with `log=True`
(common/metric_logger.py ~423), which print()s three lines on stdout ("Per train step:", "Total TFLOPs: ...",
"split as ...% learnable weight flops ...") between our compile line and the first [progress] line; a bare print,
so no logging level reaches it. Here the call is made with `log=False`: the same figures (they feed TFLOP/s/device
and MFU), not printed. The metric logger looks the function up on the module at call time, so the seam is that
module attribute.
"""

from __future__ import annotations

from patches._seam import Seam

SEAM = Seam(
    name="quiet_tflops",
    module="maxtext.utils.maxtext_utils",
    attr="calculate_tflops_training_per_device",
    sha256="7d0207d6e4677c05",
)


def wrap(original):
  def calculate_tflops_training_per_device(config, log=True):  # pylint: disable=unused-argument
    return original(config, log=False)

  calculate_tflops_training_per_device.__wrapped__ = original
  return calculate_tflops_training_per_device


def wanted(fork) -> bool:
  return not getattr(fork, "verbose", False)
