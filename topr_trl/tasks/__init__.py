"""What a run trains on and is measured by: the built-in tasks with their tiny model (`arithmetic`, `reasoning`,
`tiny`, the shipped weights in `prebuilt/`), reward functions by name (`user_rewards`), the tasks the commands know
(`registry`: one `register_task` per task), and the choice and loading of a run's task, prompts, rewards and
built-in model (`loading`). Measuring itself (answer checking, pass@k, the
evaluation runner) is `topr_trl.evaluation`'s."""
