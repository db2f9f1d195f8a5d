"""What a run reads, checked before anything loads: model and data sources (`sources`), GGUF models made
trainable (`packaged_models`) and prompts tokenized as GRPOTrainer does (`prompts`)."""
