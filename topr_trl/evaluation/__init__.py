"""Measuring what training buys: answer checking and rewards (`rewards`), pass@k / maj@k and bootstrap errors
(`metrics`), benchmark loaders (`benchmarks`: GSM8K, MATH, MATH-500, local files), the evaluation runner with its
plots (`runner`, `topr-trl evaluate`), evaluation during training (`callbacks`), and the built-in tasks with their
tiny model (`arithmetic`, `reasoning`, `tiny`)."""
