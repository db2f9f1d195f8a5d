"""Offline TOPR (the paper's Algorithm 1): sample from mu once, label, store, train on what was stored, iterate.

    generation    generate_offline_dataset, load_offline_dataset, load_offline_source
    rollout       sampling with mu's log-probs (transformers or a vLLM engine), the behaviour `rollout_func`
    composition   compose (uniform, positives_only, anna_karenina, target_proportion), proportion_of_positives
    schema        what TOPRTrainer checks and tokenizes at construction; stored_reward
    group_order   GroupShuffleSampler, the replay order (whole prompt groups)
    held_out      the user's held-out prompts and the mean reward measured on them

Iterations (mu_i = pi_{i-1}) drive these with the trainer, so they sit above it: `topr_trl.commands.iterations`.

The names below are importable from `topr_trl.offline` itself; each is loaded from its module on first use, so that
importing one (the trainer imports `schema` and `group_order`) does not import generation or vLLM code.
"""

from importlib import import_module


_EXPORTS = {
    "generation": ("generate_offline_dataset", "load_offline_dataset", "load_offline_source"),
    "rollout": ("make_behaviour_rollout", "sample_with_logps", "sample_with_logps_vllm"),
    "composition": ("COMPOSITIONS", "compose", "proportion_of_positives"),
    "schema": (
        "OFFLINE_COLUMNS",
        "stored_reward",
        "check_offline_columns",
        "check_reward_values",
        "RewardReturnError",
        "completion_token_ids",
        "checked_eval_datasets",
        "checked_reward_function",
        "is_offline_dataset",
        "needs_whole_groups",
        "tokenize_offline_dataset",
        "validate_offline_dataset",
        "with_prompt_index",
    ),
    "group_order": ("GroupShuffleSampler",),
    "held_out": ("load_test_prompts", "reward_evaluator"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
