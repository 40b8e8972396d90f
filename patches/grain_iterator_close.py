"""Seam: maxtext.input_pipeline.multihost_dataloading._terminate_iterator_workers (maxtext 0.2.5).

Upstream closes its data iterators in two steps, each call site the same pair
(MultiHostDataLoadIterator.close, RemoteIteratorWrapper.close): `_close_iterator(it)`,
which calls grain's own `close()` and so stops the iterator's worker processes and
threads, then `_terminate_iterator_workers(it)`, which looks for leftover workers on
`it`, `it._iterator` and `it._parent`. It asks `hasattr(it, "_parent")`, and on the
iterator at the top of a grain pipeline (a prefetch iterator: no parent iterator)
grain's `DatasetIterator._parent` raises AssertionError, which hasattr does not
catch. So every real-data run ended with an "Exception ignored in ... __del__"
traceback on stderr, when the garbage collector closed the iterator at exit.

The replacement lets that one AssertionError end the second step: grain's close has
already run, and the rest of upstream's close (the dataloader, orphaned processes)
then runs as written.

`close_open_iterators` closes upstream's live iterators when training returns, not at
exit. At exit, multiprocessing's finalizers run by priority: a Queue's own (10) sends
its feeder thread the sentinel, and that thread closes the queue's pipe, before grain's
`_close_if_alive` (1) drains the same queue. A resumed run has put into the prefetch
iterator's set-state queue, so its feeder thread exists, and whichever thread won printed
`OSError: handle is closed` from the finalizer (CI's slow tier; tests/test_real_data.py
makes the loss certain).
"""

from __future__ import annotations

from patches._seam import Seam

SEAM = Seam(
    name="grain_iterator_close",
    module="maxtext.input_pipeline.multihost_dataloading",
    attr="_terminate_iterator_workers",
    sha256="31afd808d198eebb",
)


def wrap(original):
  def _terminate_iterator_workers(obj):
    try:
      original(obj)
    except AssertionError:
      pass  # grain's _parent on an iterator without one; _close_iterator(obj) has stopped its workers

  _terminate_iterator_workers.__wrapped__ = original
  return _terminate_iterator_workers


def close_open_iterators() -> None:
  """Closes every live upstream data iterator (upstream's registries) through upstream's own close."""
  import sys  # pylint: disable=import-outside-toplevel

  module = sys.modules.get(SEAM.module)
  if module is None:
    return  # upstream's data loading never ran
  for iterator in [*module._GLOBAL_MULTIHOST_ITERATORS, *module._GLOBAL_REMOTE_ITERATORS]:  # pylint: disable=protected-access
    try:
      iterator.close()  # grain's close is idempotent: the finalizers' later calls find no process
    except Exception:  # pylint: disable=broad-exception-caught
      pass  # what __del__ at exit would have ignored; a training error in flight must surface, not this


def wanted(fork) -> bool:  # pylint: disable=unused-argument
  return True  # dataset_type is upstream's key; the patch is inert for the synthetic data
