"""The trainer's side of the gloo weight path: TRL's `VLLMClient` and `VLLMGeneration`, with gloo in place of NCCL.

TRL's server mode connects in `VLLMGeneration._init_vllm` (its client's `init_communicator` opens an NCCL group,
refusing any device but CUDA) and pushes weights in `VLLMClient.update_named_params` (an NCCL broadcast while the
server's `/update_weights` receives). `GlooVLLMClient` overrides exactly those two, plus the secret on its requests;
generation, prefix-cache resets and the parameter walk (PEFT merge, ZeRO-3 and FSDP gathers) stay TRL's.
`GlooServerGeneration` builds that client, checks the server serves the model being trained, and turns a lost server
into one line naming its address. `TOPRTrainer` uses it when the server runs this package's engine (`BACKEND`), as
`topr-trl vllm-serve` does without a GPU (`server_weight_backend` asks the server).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import requests
from trl import GRPOConfig
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from . import BACKEND, SECRET_ENV
from .transport import broadcast_bytes, open_group


SYNC_TIMEOUT_S = 300.0
"""How long one step of the weight path (the rendezvous, one tensor) may wait for the server before the run stops:
long enough for a server busy generating a batch on a CPU, short of a hang."""

# What `GRPOTrainer.__init__` passes to `VLLMGeneration` (trl 1.16, trl/trainer/grpo_trainer.py), rebuilt by
# `server_generation_arguments` for the server mode it cannot build on a CPU; tests/test_vllm_server.py holds this
# list to TRL's source.
GRPO_VLLM_GENERATION_ARGUMENTS = (
    "model",
    "accelerator",
    "processing_class",
    "mode",
    "structured_outputs_regex",
    "server_base_url",
    "server_host",
    "server_port",
    "group_port",
    "server_timeout",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_length",
    "max_num_seqs",
    "enable_sleep_mode",
    "model_impl",
    "trust_remote_code",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_completion_length",
    "logprobs",
    "generation_kwargs",
)


RESUME_ON_A_NEW_SERVER = "restart it, then continue the run with --resume_from_checkpoint true"


class ServerLost(ConnectionError):
    """The vLLM server stopped answering, or failed, under a run: one line naming its address."""


def server_url(args) -> str:
    """The server a GRPOConfig names, as TRL resolves it (`vllm_server_base_url`, else host and port)."""
    return (args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}").rstrip("/")


def secret_headers() -> dict[str, str]:
    secret = os.environ.get(SECRET_ENV, "")
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def server_weight_backend(url: str, timeout_s: float) -> str | None:
    """The weight-transfer backend the server at `url` runs (`BACKEND`, "nccl", ...; None without one), waiting up to
    `timeout_s` for it to answer. One line when it cannot tell: unreachable, not in dev mode, or a secret refused."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = requests.get(
                f"{url}/server_info", params={"config_format": "json"}, headers=secret_headers(), timeout=30
            )
            break
        except requests.RequestException as error:
            if time.monotonic() >= deadline:
                raise ServerLost(
                    f"the vLLM server at {url} cannot be reached ({type(error).__name__}) after "
                    f"{timeout_s:.0f} s: start it with `topr-trl vllm-serve --model MODEL`"
                ) from None
            time.sleep(2)
    if response.status_code == 401:
        raise ServerLost(
            f"the vLLM server at {url} refused this trainer: it requires a secret; set {SECRET_ENV} to the server's"
        )
    if response.status_code == 404:
        raise ServerLost(
            f"the vLLM server at {url} has no weight path (its dev-mode routes are off): start it with "
            "`topr-trl vllm-serve`"
        )
    response.raise_for_status()
    config = response.json()["vllm_config"].get("weight_transfer_config") or {}
    return config.get("backend")


def local_address_towards(host: str) -> str:
    """The address of this machine on the route to `host` (127.0.0.1 for a server on this machine): where the server
    reaches the rendezvous the trainer hosts."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


class GlooVLLMClient(VLLMClient):
    """TRL's client for a server running `BACKEND`: the same generation and cache calls; the weight group is gloo
    (TCP, any device) with every step bounded by `sync_timeout_s`; requests carry the server's secret when
    `SECRET_ENV` is set. The weight-path requests are sent once, never retried (TRL's session retries a 500, and a
    repeated `/update_weights` would wait for tensors no one sends)."""

    def __init__(self, *args, sync_timeout_s: float = SYNC_TIMEOUT_S, **kwargs):
        self.sync_timeout_s = sync_timeout_s
        self.group = None
        super().__init__(*args, **kwargs)

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        # the first call `VLLMClient.__init__` makes after creating its session: the secret goes on before any
        # guarded request
        self.session.headers.update(secret_headers())
        return super().check_server(total_timeout, retry_interval)

    def _post_once(self, route: str, payload: dict) -> dict:
        response = requests.post(
            f"{self.base_url}{route}", json=payload, headers=secret_headers(), timeout=self.sync_timeout_s
        )
        if response.status_code != 200:
            raise ServerLost(
                f"the vLLM server at {self.base_url} refused {route}: {response.status_code} "
                f"{' '.join(response.text.split())[:500]}"
            )
        return response.json() if response.content else {}

    def _alongside(self, route: str, payload: dict, work) -> None:
        """POST `route` (which blocks on the server until the group's other side acts) while `work()` runs here; raise
        the server's error first, as it says why the transport broke."""
        outcome: dict = {}

        def post():
            try:
                outcome["reply"] = self._post_once(route, payload)
            except Exception as error:  # noqa: BLE001 - carried to the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        try:
            work()
        except Exception as error:
            thread.join(timeout=10)  # the server's reason, if it has one
            if isinstance(outcome.get("error"), ServerLost):
                raise outcome["error"] from error
            raise ServerLost(
                f"the weight path to the vLLM server at {self.base_url} broke: {' '.join(str(error).split())[:300]}"
            ) from error
        thread.join(timeout=self.sync_timeout_s)
        if thread.is_alive():
            raise ServerLost(
                f"the vLLM server at {self.base_url} did not answer {route} within {self.sync_timeout_s:.0f} s"
            )
        if "error" in outcome:
            raise outcome["error"]

    def init_communicator(self, device=None):
        """Join the server's workers in a gloo group, as rank 0 hosting the rendezvous on `group_port`
        (`rendezvous_port`: GRPOConfig's default port, taken by another trainer on this machine, gives way to a free
        one; the server is told which)."""
        world_size = self.get_world_size() + 1
        address = local_address_towards(self.host)
        self.group_port = rendezvous_port(self.group_port)
        init_info = {
            "master_address": address,
            "master_port": self.group_port,
            "world_size": world_size,
            "rank_offset": 1,
            "timeout_s": self.sync_timeout_s,
        }

        def join():
            self.group = open_group(address, self.group_port, world_size, 0, self.sync_timeout_s)

        self._alongside("/init_weight_transfer_engine", {"init_info": init_info}, join)

    def update_named_params(self, metadata, named_params):
        """Announce the tensors (`metadata`: name, dtype, shape), broadcast each as it is produced, then let the
        server finish its reload (and re-pack a tied output layer)."""
        names, dtype_names, shapes = (list(column) for column in zip(*metadata, strict=True))

        def send():
            for (name, tensor), expected in zip(named_params, names, strict=True):
                if name != expected:
                    raise RuntimeError(f"tensor {name!r} came where {expected!r} was announced")
                broadcast_bytes(self.group, tensor.detach().to("cpu"))

        if not self._updating_weights:
            self._post_once("/start_weight_update", {})
        self._alongside(
            "/update_weights", {"update_info": {"names": names, "dtype_names": dtype_names, "shapes": shapes}}, send
        )
        if not self._updating_weights:
            self._post_once("/finish_weight_update", {})

    def _start_weight_update(self):
        self._post_once("/start_weight_update", {})

    def _finish_weight_update(self):
        self._post_once("/finish_weight_update", {})

    def close_communicator(self):
        self.group = None


# GRPOConfig's `vllm_group_port`: the port every trainer asks for unless told otherwise
DEFAULT_GROUP_PORT = next(f.default for f in dataclasses.fields(GRPOConfig) if f.name == "vllm_group_port")


def is_free_port(port: int) -> bool:
    """Whether a rendezvous could listen on `port` on this machine now."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_port(port: int | None) -> int:
    """The port the trainer hosts the weight path's rendezvous on: `port` when it is free; a free one when `port` is
    None, or GRPOConfig's default held by another process (a second trainer on this machine, or a first one still
    alive in a notebook); a `port` chosen by the user and in use is refused in one line."""
    if port is not None and is_free_port(port):
        return port
    if port is not None and port != DEFAULT_GROUP_PORT:
        raise ValueError(
            f"vllm_group_port {port} is in use on this machine (another trainer's weight path?): set "
            f"vllm_group_port to a free port, or leave it at its default ({DEFAULT_GROUP_PORT}), which "
            "gives way to a free port when taken"
        )
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
)


def check_serves(client: GlooVLLMClient, model) -> None:
    """Refuse, in one line, a server started on another model than the trainer's: the fields that fix the weights'
    names and shapes must agree (a fine-tuned copy of the same architecture is the same model to the weight path).
    The server's worker says what it serves (`engine.WeightSyncWorkerExtension.topr_served_model`)."""
    served = client._post_once("/collective_rpc", {"method": "topr_served_model"})["results"][0]
    trained = model.config.get_text_config().to_dict()
    differ = [
        f"{key} {served['config'][key]} (server) vs {trained[key]} (trainer)"
        for key in SHAPE_FIELDS
        if key in served["config"] and key in trained and served["config"][key] != trained[key]
    ]
    if differ:
        raise ValueError(
            f"the vLLM server at {client.base_url} serves {served['model']}, not the model being "
            f"trained ({'; '.join(differ)}): start it with `topr-trl vllm-serve --model` the trained "
            "model"
        )


class GlooServerGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` in server mode against a server running `BACKEND`."""

    def _init_vllm(self):
        if self.mode != "server":
            return super()._init_vllm()
        if self.accelerator.is_main_process:
            url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            try:
                self.vllm_client = GlooVLLMClient(
                    base_url=url, group_port=self.group_port, connection_timeout=self.server_timeout
                )
            except requests.RequestException as error:
                raise ServerLost(f"the vLLM server at {url} failed: {type(error).__name__}") from error
            check_serves(self.vllm_client, self.model)
            self.vllm_client.init_communicator()
        self.accelerator.wait_for_everyone()

    def _server_call(self, call, *args, **kwargs):
        """`call`, with a lost server said in one line that tells how to go on: whichever side noticed first (an
        HTTP request, or the gloo transport mid-push), the run resumes from its last checkpoint on a new server."""
        url = getattr(getattr(self, "vllm_client", None), "base_url", "the server")
        try:
            return call(*args, **kwargs)
        except requests.RequestException as error:
            raise ServerLost(
                f"the vLLM server at {url} stopped answering ({type(error).__name__}): {RESUME_ON_A_NEW_SERVER}"
            ) from None
        except ServerLost as error:
            raise ServerLost(f"{error}: {RESUME_ON_A_NEW_SERVER}") from None

    def sync_weights(self):
        return self._server_call(super().sync_weights)

    def generate(self, *args, **kwargs):
        return self._server_call(super().generate, *args, **kwargs)


def server_generation_arguments(trainer, args) -> dict:
    """The arguments `GRPOTrainer.__init__` gives `VLLMGeneration` (`GRPO_VLLM_GENERATION_ARGUMENTS`), from the same
    trainer attributes and config fields."""
    arguments = dict(
        model=trainer.model,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        mode=args.vllm_mode,
        structured_outputs_regex=args.vllm_structured_outputs_regex,
        server_base_url=args.vllm_server_base_url,
        server_host=args.vllm_server_host,
        server_port=args.vllm_server_port,
        group_port=args.vllm_group_port,
        server_timeout=args.vllm_server_timeout,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length,
        logprobs=0,
        generation_kwargs=args.generation_kwargs,
    )
    assert tuple(arguments) == GRPO_VLLM_GENERATION_ARGUMENTS
    return arguments


def uses_gloo_server(args) -> bool:
    """Whether a trainer with `args` generates on a server running this package's weight path (asks the server)."""
    if not (getattr(args, "use_vllm", False) and args.vllm_mode == "server"):
        return False
    return server_weight_backend(server_url(args), args.vllm_server_timeout) == BACKEND


class GlooWeightTransfer:
    """TRL's `WeightTransferProtocol` (what `AsyncGRPOTrainer` and `AsyncTOPRTrainer` call around each weight sync)
    over this package's gloo path, for a server running `BACKEND`: the asynchronous counterpart of TRL's NCCL
    `WeightTransferClient`. Requests in flight are paused with their KV cleared (`/pause?mode=keep`), the weights
    pushed, the prefix cache reset, and generation resumed: every token is sampled by exactly one weight version,
    the one in place when it was sampled (the requests paused mid-way continue with the new weights, recomputed)."""

    def __init__(self, url: str, group_port: int | None = None, sync_timeout_s: float = SYNC_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.group_port = group_port
        self.sync_timeout_s = sync_timeout_s
        self.client: GlooVLLMClient | None = None

    def init_weight_transfer(self) -> None:
        try:
            self.client = GlooVLLMClient(
                base_url=self.url,
                group_port=self.group_port,
                connection_timeout=self.sync_timeout_s,
                sync_timeout_s=self.sync_timeout_s,
            )
        except requests.RequestException as error:
            raise ServerLost(f"the vLLM server at {self.url} failed: {type(error).__name__}") from error
        self.client.init_communicator()

    def pause(self) -> None:
        self.client._post_once("/pause?mode=keep", {})

    def send_weights(self, iterator) -> None:
        """Announce, then broadcast, the tensors `iterator` yields (TRL's walk: names as vLLM loads them). The names
        and shapes must be announced before the first byte moves, so the walk is listed first: references to the
        parameters (no copy), or the gathered tensors under FSDP."""
        named = list(iterator)
        metadata = [(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)) for name, tensor in named]
        try:
            self.client.update_named_params(metadata, iter(named))
            self.client.reset_prefix_cache()
        except requests.RequestException as error:
            raise ServerLost(
                f"the vLLM server at {self.url} stopped answering ({type(error).__name__}) during a weight sync"
            ) from None

    def resume(self) -> None:
        self.client._post_once("/resume", {})

    def destroy(self) -> None:
        if self.client is not None:
            self.client.close_communicator()
        self.client = None
