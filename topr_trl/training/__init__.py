"""What the trainers are built from, below them: what `TOPRTrainer` and the asynchronous trainer share
(`shared`), GRPO's loss around the policy term (`grpo_mirror`, a labelled copy), TOPR's metrics
(`policy_metrics`) and resuming through transformers' renamed weights (`checkpoint_weights`)."""
