"""L2 norm of a bf16 pytree shaped like the proxy's parameters (7.36B): upstream's l2norm_pytree vs alternatives.

    python3 tools/bench_l2norm.py     # on the GPU; prints ms, TB/s and the norm of each

Run on the H200 at commit efee304 (2026-12-01; BENCHMARKS.md "End to end on one H200", the gradient norm's row),
as a scratch script of the same code.
"""
import statistics, time
import jax, jax.numpy as jnp

bf = jnp.bfloat16
shapes = [(3, 32, 7168, 2048), (3, 32, 7168, 2048), (3, 32, 2048, 7168),  # routed experts (scanned)
          (129280, 7168), (7168, 129280),                                  # embedding, output head
          (4, 7168, 1536), (4, 1536, 128, 192), (4, 7168, 576), (4, 512, 128, 256), (4, 128, 128, 7168),  # MLA
          (3, 7168, 2048), (3, 7168, 2048), (3, 2048, 7168),            # shared expert
          (1, 7168, 18432), (1, 7168, 18432), (1, 18432, 7168), (3, 7168, 32), (4, 7168), (4, 1536)]
key = jax.random.key(0)
tree = [jax.random.normal(jax.random.fold_in(key, i), s, bf) for i, s in enumerate(shapes)]
n = sum(x.size for x in tree)
print(f"{n / 1e9:.2f}B elements, {2 * n / 1e9:.1f} GB")

def upstream(t):
  return jnp.sqrt(jax.tree_util.tree_reduce(lambda x, y: x + jnp.sum(jnp.square(y)), t, initializer=0.0))
def f32_sum(t):
  return jnp.sqrt(sum(jnp.sum(jnp.square(y.astype(jnp.float32))) for y in t))
def rows(t):
  return jnp.sqrt(sum(jnp.sum(jnp.sum(jnp.square(y.astype(jnp.float32)).reshape(-1, y.shape[-1]), axis=-1)) for y in t))
def chunks(t):  # [R, 2^k] with a fixed inner 4096-wide row: a row reduction then a column sum
  out = 0.0
  for y in t:
    v = y.reshape(-1)
    m = v.size // 4096 * 4096
    out = out + jnp.sum(jnp.sum(jnp.square(v[:m].reshape(-1, 4096).astype(jnp.float32)), axis=1)) + jnp.sum(jnp.square(v[m:].astype(jnp.float32)))
  return jnp.sqrt(out)
def vdot(t):
  return jnp.sqrt(sum(jnp.vdot(y.reshape(-1), y.reshape(-1), preferred_element_type=jnp.float32) for y in t))

ref = None
for name, f in (("upstream", upstream), ("f32_sum", f32_sum), ("rows", rows), ("chunks", chunks), ("vdot", vdot)):
  g = jax.jit(f)
  try:
    r = float(g(tree)); times = []
    for _ in range(10):
      t0 = time.perf_counter(); jax.block_until_ready(g(tree)); times.append(time.perf_counter() - t0)
  except Exception as e:  # noqa
    print(f"{name:10s} failed: {str(e)[:200]}"); continue
  ref = ref or r
  ms = statistics.median(times) * 1e3
  print(f"{name:10s} {ms:7.2f} ms  {2 * n / ms / 1e9:6.2f} TB/s  norm {r:.6g} (rel {abs(r - ref) / ref:.1e})")
