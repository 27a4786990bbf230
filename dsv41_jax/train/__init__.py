"""Fine-tuning: losses, optimisers, the jitted train step, data and the training loop.

* ``TrainConfig`` — the hyper-parameters (frozen, validated; saved with every checkpoint).
* ``make_train_step(config, train_config, mesh=None)`` -> ``TrainStep``: ``init_state(params)``,
  ``step(state, batch, lr) -> (state, metrics)`` (pure, jitted, sharded over ``mesh`` by the logical-axis rules).
* ``train(config, train_config, data, ckpt_dir=..., ...)`` — the loop behind ``dsv41 train``.
* ``dsv41_jax.train.data`` — documents -> tokens -> packed rows -> batches (deterministic, resumable).
* ``dsv41_jax.train.loss`` — cross-entropy, noaux bias update, balance loss, indexer KL.
"""

from dsv41_jax.train.config import TrainConfig, TrainConfigError, TrainWarning
from dsv41_jax.train.optimizer import build_optimizer, lr_at
from dsv41_jax.train.step import TrainError, TrainStep, make_train_step
from dsv41_jax.train.trainer import TrainResult, train

__all__ = ["TrainConfig", "TrainConfigError", "TrainWarning", "build_optimizer", "lr_at", "TrainError", "TrainStep",
           "make_train_step", "TrainResult", "train"]
