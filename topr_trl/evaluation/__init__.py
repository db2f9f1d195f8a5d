"""Measuring what training buys: answer checking and rewards (`rewards`), pass@k / maj@k and bootstrap errors
(`metrics`), benchmark loaders (`benchmarks`: GSM8K, MATH, MATH-500), the evaluation runner with its plots
(`runner`: `evaluate_model`), and evaluation during training (`callbacks`). The tasks measured are
`topr_trl.tasks`'; the `topr-trl evaluate` command is `topr_trl.commands.evaluate`."""
