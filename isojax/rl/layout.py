"""Padding follows real tokens: micro-batches of similar length, trimmed to a bucket.

A batch is [B, T] with T = prompt width + max completion tokens, but completions
vary in length, so most rows are mostly padding. Inside the jitted step (one
compile, static shapes) the update therefore

  1. left-aligns every row (its first real token moves to column 0; the pads in
     front of the prompt move behind the completion). Positions come from the
     attention-mask cumsum and attention is causal, so every real token's
     logits are unchanged, and the loss mask, sampler log-probs and loss
     weights move with their tokens;
  2. sorts rows by real length, so a micro-batch holds rows of similar length
     (advantages and aggregation weights are computed before, on the batch in
     its prompt-major group order, and permuted with the rows);
  3. runs each micro-batch at the smallest of a few static lengths (buckets)
     that holds its longest row, chosen with ``lax.switch``: each bucket is
     compiled once, FLOPs follow the real tokens.

Every loss term is a weighted sum over rows and positions whose weights are 0
on padding, so the gradient is that of the padded layout (tests compare).
"""

import math
from typing import Sequence

import jax
import jax.numpy as jnp

__all__ = ["DEFAULT_BUCKETS", "BUCKET_MULTIPLE", "bucket_lengths", "left_align",
           "sort_by_length"]

DEFAULT_BUCKETS = 4
# Bucket lengths are multiples of this (matmul tiles, attention blocks); a batch
# narrower than one multiple runs at its full width, untrimmed.
BUCKET_MULTIPLE = 128


def bucket_lengths(seq_len: int, buckets: int | Sequence[int] = DEFAULT_BUCKETS,
                   multiple: int = BUCKET_MULTIPLE) -> tuple[int, ...]:
  """The static lengths micro-batches are trimmed to, ascending, ending at seq_len.

  Args:
    seq_len: T of the batch.
    buckets: a count k (lengths ceil(j T / k) for j = 1..k, rounded up to
      ``multiple``) or explicit lengths (those < seq_len are kept).
    multiple: rounding for a count.
  """
  if isinstance(buckets, int):
    if buckets < 1:
      raise ValueError(f"length_buckets={buckets} must be >= 1")
    lengths = {min(seq_len, multiple * math.ceil(math.ceil(seq_len * j / buckets) / multiple))
               for j in range(1, buckets + 1)}
  else:
    bad = [x for x in buckets if int(x) < 1]
    if bad:
      raise ValueError(f"length_buckets={tuple(buckets)}: lengths must be >= 1")
    lengths = {int(x) for x in buckets if int(x) < seq_len}
  return tuple(sorted(lengths | {seq_len}))


def left_align(rows, attn_BxT):
  """Rotates each row of every [B, T] leaf of ``rows`` so its first real token is at 0.

  Returns (rows, length_B) with length_B the span from the first to the last
  real token (0 for a row without one). Leaves that are not [B, T] are kept.
  """
  B, T = attn_BxT.shape
  real_BxT = attn_BxT > 0
  first_B = jnp.argmax(real_BxT, axis=1)
  last_B = T - 1 - jnp.argmax(real_BxT[:, ::-1], axis=1)
  length_B = jnp.where(real_BxT.any(axis=1), last_B - first_B + 1, 0)
  src_BxT = (jnp.arange(T)[None, :] + first_B[:, None]) % T

  def one(x):
    if x.ndim != 2 or x.shape != (B, T):
      return x
    return jnp.take_along_axis(x, src_BxT, axis=1)

  return jax.tree.map(one, rows), length_B


def sort_by_length(rows, length_B):
  """Rows of every leaf (leading axis B) in ascending ``length_B`` order, and the lengths."""
  order_B = jnp.argsort(length_B, stable=True)
  return jax.tree.map(lambda x: jnp.take(x, order_B, axis=0), rows), length_B[order_B]
