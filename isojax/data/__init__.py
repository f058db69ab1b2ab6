"""Problems, rewards, difficulty splits and the epoch loader.

    from isojax.data import synthetic_splits, EpochLoader, exact_match
    train, val = synthetic_splits(1024, 256, seed=0)
    loader = EpochLoader(train, batch_size=16, seed=0)
    batch = loader.next_batch()            # 16 Problems; loader.state_dict() resumes

Nothing here imports JAX; samplers are passed in where samples are needed.
"""

from isojax.data.loader import (AllRetiredError, EpochLoader, LoaderPosition,
                                TooFewActiveError, epoch_permutation, group_pass_rates,
                                next_indices)
from isojax.data.rewards import (REWARD_FNS, MathVerifier, MathVerifierPool, exact_match,
                                 get_reward_fn, math_verify_reward)
from isojax.data.sources import (Fields, Problem, encode_prompts, load_datasets_dir,
                                 load_jsonl, load_parquet, load_problems, problems_digest,
                                 write_jsonl)
from isojax.data.splits import (SPLIT_RANGES, indices_in_range, mixture_indices,
                                split_indices)
from isojax.data.synthetic import (DEFAULT_DIGITS, DEFAULT_FAMILIES, FAMILIES, VOCAB,
                                   synthetic_problems, synthetic_splits)

__all__ = [
    "AllRetiredError", "EpochLoader", "LoaderPosition", "TooFewActiveError",
    "epoch_permutation", "group_pass_rates", "next_indices",
    "REWARD_FNS", "MathVerifier", "MathVerifierPool", "exact_match", "get_reward_fn",
    "math_verify_reward",
    "Fields", "Problem", "encode_prompts", "load_datasets_dir", "load_jsonl",
    "load_parquet", "load_problems", "problems_digest", "write_jsonl",
    "SPLIT_RANGES", "indices_in_range", "mixture_indices", "split_indices",
    "DEFAULT_DIGITS", "DEFAULT_FAMILIES", "FAMILIES", "VOCAB", "synthetic_problems",
    "synthetic_splits",
]
