"""The one module that imports TRL's experimental asynchronous GRPO (TRL 1.16: `trl.experimental.async_grpo`), so
that a TRL release that moves it (1.18 moves `AsyncGRPOTrainer` into `trl` and deletes the package's submodules) is a
change here alone. `tests/test_layout.py` holds every other module of the package to these names."""

from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as async_trainer_module
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, RolloutSample


__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "AsyncRolloutWorker", "RolloutSample", "async_trainer_module"]
