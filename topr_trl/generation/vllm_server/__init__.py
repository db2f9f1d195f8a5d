"""A vLLM server in its own process whose weights follow the trainer's, without NCCL: over a gloo process group (TCP),
so it works on a CPU, across machines, and on GPU boxes where NCCL between trainer and server is not an option.

Every piece sits on a supported extension point; nothing installed is patched:

- `engine.py`, in the server's worker process: a weight-transfer engine registered with vLLM
  (`WeightTransferEngineFactory`) under `BACKEND`, imported there by `--worker-extension-cls`;
- `auth.py`, in the server's HTTP process: an ASGI middleware (`--middleware`) that refuses the weight path without
  the secret;
- `transport.py`, on both sides: the gloo group, bounded by a timeout, and how tensors cross it;
- `client.py`, in the trainer: TRL's `VLLMClient` and `VLLMGeneration` with the gloo transport in place of NCCL;
- `command.py`, the command line: `topr-trl vllm-serve`, TRL's `vllm-serve` flags, the server started with all of
  the above.

The protocol is vLLM's own weight-transfer API (the dev-mode routes `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`), which TRL's client already drives for NCCL.
"""

import sys


BACKEND = "topr_gloo"
"""The name the gloo engine is registered under in the server (`--weight-transfer-config '{"backend": "topr_gloo"}'`);
a trainer reads it back from the server's `/server_info` to choose its side of the transport."""

SECRET_ENV = "TOPR_TRL_VLLM_SERVER_SECRET"
"""The environment variable holding the secret a server listening beyond 127.0.0.1 requires on its weight path (and
every other route but /health); the trainer sends it from the same variable. Never printed or logged."""


def log_line(message: str) -> None:
    """One line on the server's standard error (its log), whatever logging set-up vLLM and uvicorn made: their
    configuration disables loggers created before it, which this package's server-side modules are."""
    print(f"topr-trl vllm-serve: {message}", file=sys.stderr, flush=True)  # noqa: T201 - the server's log
