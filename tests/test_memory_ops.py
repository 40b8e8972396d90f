"""The memory-bound ops by name (MaxText/plan/memory_ops.py): the schedule's walk groups each memory-bound op's
seconds and bytes by its source op, one group for the same op in every layer and loop trip, and says who owns it.
On hand-written scheduled HLO (tests/test_schedule.py's round rates: HBM at 1 GB/s), and on a tiny CPU compile
whose stack-frame table names this file."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import pytest

from MaxText.plan import memory_ops, schedule, step_report
from tests.test_schedule import GPU

ARRAY_BYTES = 256 * 512 * 4  # one f32[256,512]
OURS = 'source_file="/anywhere/repo/MaxText/moe/routing.py" source_line=42'
# stack_frame_id=3: flax's frame inside upstream's norm inside upstream's train step (innermost first: 3 -> 2 -> 1).
FRAMES = [("/venv/lib/python3.12/site-packages/maxtext/train.py", 300, 0),
          ("/venv/lib/python3.12/site-packages/maxtext/layers/normalizations.py", 55, 1),
          ("/venv/lib/python3.12/site-packages/flax/linen/module.py", 700, 2)]
MODULE = f"""\
    HloModule m, is_scheduled=true

    %fused_neg (p0: f32[256,512]) -> f32[256,512] {{
      %p0 = f32[256,512]{{1,0}} parameter(0)
      ROOT %n = f32[256,512]{{1,0}} negate(%p0)
    }}

    %body (p: (s32[], f32[256,512])) -> (s32[], f32[256,512]) {{
      %p = (s32[], f32[256,512]{{1,0}}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %x = f32[256,512]{{1,0}} get-tuple-element(%p), index=1
      %one = s32[] constant(1)
      %next = s32[] add(%i, %one), metadata={{op_name="jit(train_step)/while/body/add" source_file="/venv/lib/python3.12/site-packages/jax/_src/lax/control_flow/loops.py" source_line=10}}
      %neg_fusion.3 = f32[256,512]{{1,0}} fusion(%x), kind=kLoop, calls=%fused_neg, metadata={{op_name="jit(train_step)/jvp(decoder)/while/body/layers_3/moe/neg" {OURS}}}
      %mul.7 = f32[256,512]{{1,0}} multiply(%neg_fusion.3, %neg_fusion.3), metadata={{op_name="jit(train_step)/jvp(decoder)/while/body/layers_3/norm/mul" stack_frame_id=3}}
      ROOT %t = (s32[], f32[256,512]{{1,0}}) tuple(%next, %mul.7)
    }}

    %cond (p: (s32[], f32[256,512])) -> pred[] {{
      %p = (s32[], f32[256,512]{{1,0}}) parameter(0)
      ROOT %c = pred[] constant(true)
    }}

    ENTRY %main (x: f32[256,512]) -> f32[256,512] {{
      %x = f32[256,512]{{1,0}} parameter(0)
      %zero = s32[] constant(0)
      %init = (s32[], f32[256,512]{{1,0}}) tuple(%zero, %x)
      %loop = (s32[], f32[256,512]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
      %y = f32[256,512]{{1,0}} get-tuple-element(%loop), index=1
      %neg_fusion.9 = f32[256,512]{{1,0}} fusion(%y), kind=kLoop, calls=%fused_neg, metadata={{op_name="jit(train_step)/jvp(decoder)/layers_11/moe/neg" {OURS}}}
      ROOT %copy.2 = f32[256,512]{{1,0}} copy(%neg_fusion.9)
    }}
    """


def _by_source(rows):
  return {r["source"]: r for r in rows}


def test_memory_bound_ops_group_by_source_across_loop_trips_and_layers():
  t = schedule.estimate(schedule.parse(textwrap.dedent(MODULE), FRAMES), GPU, {"fsdp": 4}, [0, 0, 0, 0])
  rows = _by_source(t.memory_ops)
  # Every memory-bound second and byte is in exactly one group.
  assert sum(r["seconds"] for r in t.memory_ops) == pytest.approx(t.memory_s)
  assert sum(r["bytes"] for r in t.memory_ops) == pytest.approx(t.counts["memory_bytes"])
  assert [r["seconds"] for r in t.memory_ops] == sorted((r["seconds"] for r in t.memory_ops), reverse=True)
  # Our negate: three loop trips (two walked, the third repeated) and the unrolled layer after the loop, one group.
  moe = rows["MaxText/moe/routing.py:42"]
  assert (moe["op"], moe["owner"], moe["ops"]) == ("jit(train_step)/jvp(decoder)/layers_N/moe/neg", "ours", 4)
  assert moe["bytes"] == pytest.approx(4 * 2 * ARRAY_BYTES) and moe["seconds"] == pytest.approx(4 * 2 * ARRAY_BYTES / 1e9)
  assert moe["example"].startswith("neg_fusion.")
  # Upstream's norm by its stack frame: the innermost frame in MaxText's code, flax's frame inside it passed over.
  norm = rows["maxtext/layers/normalizations.py:55"]
  assert (norm["owner"], norm["ops"], norm["bytes"]) == ("upstream", 3, pytest.approx(3 * 3 * ARRAY_BYTES))
  assert rows["jax/_src/lax/control_flow/loops.py:10"]["owner"] == "jax/flax"
  assert (rows[""]["op"], rows[""]["owner"]) == ("copy f32[256,512]", "xla")  # the compiler's own: by opcode and shape
  # The report keeps the groups and prints the largest under the memory-bound line.
  e = step_report.report(t, model_flops=1e9, recompute_flops=0.0)
  assert e["memory_ops"] == t.memory_ops
  printed = step_report.lines(e)
  at = next(i for i, line in enumerate(printed) if "memory-bound" in line)
  assert "source: op" in printed[at + 1] and "upstream maxtext/layers/normalizations.py:55: jit(" in printed[at + 2]
  assert "4  ours     MaxText/moe/routing.py:42: jit(train_step)/jvp(decoder)/layers_N/moe/neg" in printed[at + 3]


def test_owners_and_names():
  assert memory_ops.owner(f"{memory_ops.REPO}/tools/replan_recipes.py") == "ours"
  assert memory_ops.owner("/elsewhere/checkout/patches/moe_block.py") == "ours"
  assert memory_ops.owner("/v/lib/python3.12/site-packages/maxtext/layers/moe.py") == "upstream"
  assert memory_ops.owner("/v/lib/python3.12/site-packages/MaxText/layers/moe.py") == "upstream"
  assert memory_ops.owner("/v/lib/python3.12/site-packages/flax/nnx/module.py") == "jax/flax"
  # A venv inside the repo is still the packages'.
  assert memory_ops.short_path(f"{memory_ops.REPO}/.venv/lib/python3.12/site-packages/maxtext/a.py") == "maxtext/a.py"
  assert memory_ops.owner(f"{memory_ops.REPO}/.venv/lib/python3.12/site-packages/maxtext/a.py") == "upstream"
  assert memory_ops.owner(f"{memory_ops.REPO}/.venv/lib/python3.12/site-packages/jax/_src/numpy/lax_numpy.py") == "jax/flax"
  assert memory_ops.normalise("jit(f)/transpose(jvp(MoeBlock_0))/while/body/while/body/layers_12/dot_general") == \
      "jit(f)/transpose(jvp(MoeBlock_N))/layers_N/dot_general"


def _layer(carry, w):
  return jnp.tanh(carry @ w) * 2.0 + 1.0, None  # the line the table must name


def test_a_compiled_scan_names_this_file_through_its_stack_frames():
  """XLA's text gives only stack_frame_id: the table read off the compiled module resolves it to this file."""
  f = lambda x, ws: jax.lax.scan(_layer, x, ws)[0].sum()  # noqa: E731
  compiled = jax.jit(jax.grad(f, argnums=1)).lower(jnp.ones((8, 16)), jnp.ones((3, 16, 16))).compile()
  frames = memory_ops.stack_frames(compiled)
  t = schedule.estimate(schedule.parse(compiled.as_text(), frames), GPU, {"data": 1}, [0])
  line = _layer.__code__.co_firstlineno + 1
  ours = [r for r in t.memory_ops if r["source"] == f"tests/test_memory_ops.py:{line}"]
  assert ours and all(r["owner"] == "ours" and "while/body" not in r["op"] for r in ours)
  assert any(r["ops"] >= 3 for r in ours)  # one group for the op in each of the scan's three trips
  assert sum(r["seconds"] for r in t.memory_ops) == pytest.approx(t.memory_s)
