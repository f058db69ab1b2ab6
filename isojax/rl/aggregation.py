"""How per-token loss terms are averaged: aggregation weights for a whole batch.

Aggregation is expressed as per-token weights ``w_BxT`` with ``loss = sum(w * x)``.
The weights depend only on the loss mask and on which groups are kept, so they
are computed once for a whole batch and then sliced into micro-batches: summing
the micro-batch losses gives exactly the whole-batch loss (``token_mean``
divides by the *batch's* token count, not each micro-batch's).

Which groups are zero-variance comes in as per-group flags
(``isojax.rl.advantages.zero_variance_groups``, the rule's one definition).
Rollouts are grouped contiguously by prompt (``group_size`` rollouts each).
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["AGGREGATIONS", "ZERO_VAR_FILTERS", "TokenWeights", "token_weights"]


def _row_counts(m_BxT):
  return m_BxT.sum(axis=1)


def _agg_token_mean(m_BxT, group_size):
  del group_size
  return m_BxT / jnp.maximum(m_BxT.sum(), 1.0)


def _agg_seq_mean_token_mean(m_BxT, group_size):
  del group_size
  len_B = _row_counts(m_BxT)
  num_seqs = jnp.maximum((len_B > 0).sum(), 1)
  return m_BxT / jnp.maximum(len_B, 1.0)[:, None] / num_seqs


def _agg_seq_mean_token_sum(m_BxT, group_size):
  del group_size
  num_seqs = jnp.maximum((_row_counts(m_BxT) > 0).sum(), 1)
  return m_BxT / num_seqs


def _agg_prompt_mean(m_BxT, group_size):
  if group_size is None:
    raise ValueError("agg='prompt_mean' needs group_size (rollouts per prompt)")
  tokens_Bp = _row_counts(m_BxT).reshape(-1, group_size).sum(axis=1)
  num_prompts = jnp.maximum((tokens_Bp > 0).sum(), 1)
  per_row_B = jnp.repeat(jnp.maximum(tokens_Bp, 1.0), group_size)
  return m_BxT / per_row_B[:, None] / num_prompts


# name -> fn(mask_BxT of kept tokens, group_size) -> weights w_BxT; sequences
# (or prompts) with no kept tokens do not count in the denominators.
AGGREGATIONS: dict[str, Callable] = {
    "token_mean": _agg_token_mean,
    "seq_mean_token_mean": _agg_seq_mean_token_mean,
    "seq_mean_token_sum": _agg_seq_mean_token_sum,
    "prompt_mean": _agg_prompt_mean,
}

# name -> (drop zero-variance groups from the pg term?, from the regularisers?)
ZERO_VAR_FILTERS: dict[str, tuple[bool, bool]] = {
    "off": (False, False),
    "all": (True, True),
    "regularizers": (False, True),
}


class TokenWeights(NamedTuple):
  """Whole-batch aggregation weights; slice rows for a micro-batch."""

  pg_BxT: jax.Array  # policy-gradient term
  reg_BxT: jax.Array  # KL and entropy terms
  diag_BxT: jax.Array  # plain token mean over all trained tokens (metrics)


def token_weights(mask_BxT, cfg, *, group_size=None, zero_var_Bp=None) -> TokenWeights:
  """Aggregation weights for a whole batch.

  Args:
    mask_BxT: 1 on trained tokens.
    cfg: anything with ``agg`` and ``zero_var_filter`` (a ``LossConfig``).
    group_size: rollouts per prompt; needed for ``prompt_mean`` and filtering.
    zero_var_Bp: bool per group, ``advantages.zero_variance_groups``; needed
      when ``cfg.zero_var_filter`` is not "off".
  """
  mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
  agg = AGGREGATIONS[cfg.agg]
  filter_pg, filter_reg = ZERO_VAR_FILTERS[cfg.zero_var_filter]
  full_BxT = agg(mask_BxT, group_size)
  if filter_pg or filter_reg:
    if group_size is None or zero_var_Bp is None:
      raise ValueError(f"zero_var_filter={cfg.zero_var_filter!r} needs group_size and "
                       "zero_var_Bp (advantages.zero_variance_groups)")
    keep_B = ~jnp.repeat(jnp.asarray(zero_var_Bp, bool), group_size)
    kept_BxT = agg(mask_BxT * keep_B[:, None], group_size)
  diag_BxT = _agg_token_mean(mask_BxT, group_size)
  return TokenWeights(pg_BxT=kept_BxT if filter_pg else full_BxT,
                      reg_BxT=kept_BxT if filter_reg else full_BxT,
                      diag_BxT=diag_BxT)
