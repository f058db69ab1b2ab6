"""The RL core: advantages, policy losses, optimiser and the pure update step.

    from isojax.rl import LossConfig, OptimConfig, Batch, make_train_step, init_train_state
    step = make_train_step(model, LossConfig(), OptimConfig(), batch_size=B, group_size=n,
                           micro_batch_size=mb, mesh=mesh)
    state = init_train_state(model, LossConfig(), OptimConfig(), batch_size=B, mesh=mesh)
    state, metrics = step(state, batch)
"""

from isojax.rl.advantages import compute_advantages
from isojax.rl.batch import Batch, abstract_batch, validate_batch
from isojax.rl.losses import LossConfig, policy_loss
from isojax.rl.optim import OptimConfig, learning_rate, make_optimizer
from isojax.rl.state import TrainState, abstract_train_state, init_train_state
from isojax.rl.jitted import TrainStep
from isojax.rl.step import make_train_step

__all__ = ["compute_advantages", "LossConfig", "policy_loss", "OptimConfig", "learning_rate",
           "make_optimizer", "Batch", "TrainState", "TrainStep", "abstract_batch",
           "abstract_train_state", "init_train_state",
           "make_train_step", "validate_batch"]
