"""One sampling step over a real vocabulary: top-p against a plain draw and a sort.

    python bench/sample_token.py                  # 512 rows x 151,936 (Qwen) logits
    python bench/sample_token.py --rows 64 --vocab 128256

Times `isojax.rollout.decode.sample_token` (jitted, best of --repeats after a
compiling call) on random logits for a plain draw, top-k 50, top-p 0.95 and
top-k 50 + top-p 0.95, and, as the reference for top-p, the same draw after a
full descending sort of every row (what top-p costs when the nucleus is found by
sorting). Prints seconds per step and each one's ratio to the plain draw. A
benchmark, not a test: nothing is asserted.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from isojax.rollout import decode  # noqa: E402


def sorted_top_p(logits_BxV, u_B, top_p):
  """The reference: sort each row, keep the prefix whose mass before is below top_p."""
  ids_BxV = jnp.argsort(-logits_BxV, axis=-1)
  cand_BxV = jnp.take_along_axis(logits_BxV, ids_BxV, axis=-1)
  probs_BxV = jax.nn.softmax(cand_BxV, axis=-1)
  cand_BxV = jnp.where(jnp.cumsum(probs_BxV, axis=-1) - probs_BxV < top_p, cand_BxV, -jnp.inf)
  idx_B, lse_B = decode._inverse_cdf(cand_BxV, u_B)  # pylint: disable=protected-access
  logp_B = jnp.take_along_axis(cand_BxV, idx_B[:, None], axis=-1)[:, 0] - lse_B
  return jnp.take_along_axis(ids_BxV, idx_B[:, None], axis=-1)[:, 0], logp_B


def best_seconds(fn, *args, repeats):
  jax.block_until_ready(fn(*args))  # compiles
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return min(times)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=512)
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  logits = jax.random.normal(jax.random.key(0), (args.rows, args.vocab)) * 3
  u = 1.0 - jax.random.uniform(jax.random.key(1), (args.rows,))
  print(f"{jax.default_backend()}: {args.rows} rows x {args.vocab} logits, temperature 1")
  cases = {"plain": (0, False), "top-k 50": (50, False), "top-p 0.95": (0, True),
           "top-k 50 + top-p 0.95": (50, True)}
  plain = None
  for name, (top_k, use_top_p) in cases.items():
    s = decode.Static(max_tokens=1, greedy=False, top_k=top_k, use_top_p=use_top_p)
    fn = jax.jit(lambda l, u, s=s: decode.sample_token(l, u, 1.0, 0.95, s))
    sec = best_seconds(fn, logits, u, repeats=args.repeats)
    plain = plain or sec
    print(f"  {name:<24s} {sec:8.4f} s  {sec / plain:7.1f}x plain")
  sec = best_seconds(jax.jit(lambda l, u: sorted_top_p(l, u, 0.95)), logits, u,
                     repeats=args.repeats)
  print(f"  {'top-p 0.95 by a sort':<24s} {sec:8.4f} s  {sec / plain:7.1f}x plain")


if __name__ == "__main__":
  main()
