"""Sampling completions: the one generation loop and vLLM engine builder (`completions`), the colocated
engine's weight sync on a CPU (`vllm_colocate`) and a vLLM server in its own process (`vllm_server`)."""
