"""Where a model or dataset named on the command line comes from, checked before anything loads: a local path that
does not exist fails at once in one line, and a Hub id with the Hub out of reach fails at once instead of after
minutes of retries."""

from __future__ import annotations

from pathlib import Path


def looks_like_local_path(name: str) -> bool:
    """A name that can only be a path: `./x`, `../x`, `/x`, `~/x`, or more than one `/` (a Hub id is `owner/name`
    or a bare `name`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def hub_unreachable_reason() -> str | None:
    """Why the Hub cannot be asked for a model or dataset (offline mode, or no connection within 3 s), or None."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError:
        return f"{endpoint.hostname} cannot be reached"
    return None


def check_model_source(name: str | None, what: str = "model", dry_run: bool = False) -> None:
    """Fail at once, in one line, on a model that cannot load: a local path that does not exist or holds no model,
    or a name that is neither a local folder, nor in the local Hugging Face cache, nor reachable on the Hub (not
    asked in a dry run, which validates a recipe, Hub ids included, on a machine that may not reach the Hub)."""
    if name is None:
        return
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise SystemExit(f"topr-trl: {name} is not a model folder (no config.json in it): give the folder a "
                             "model was saved to with save_pretrained, or a Hub id")
        return
    if looks_like_local_path(name):
        raise SystemExit(f"topr-trl: {what} folder {name} does not exist")
    from huggingface_hub import try_to_load_from_cache

    if dry_run or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    reason = hub_unreachable_reason()
    if reason is not None:
        raise SystemExit(f"topr-trl: {name} is not a local folder, and the Hub cannot be asked for it ({reason}); "
                         f"give the path of a {what} folder, or a Hub id with the Hub reachable")


def check_data_source(name: str | None, flag: str) -> None:
    """Fail at once on a data path that does not exist (a name that can only be a path, or one with a data file's
    suffix); Hub ids are left to the loader."""
    from .evaluation.benchmarks import LOCAL_FORMATS

    if name is None or Path(name).expanduser().exists():
        return
    if looks_like_local_path(name) or Path(name).suffix.lower() in LOCAL_FORMATS:
        raise SystemExit(f"topr-trl: {flag} {name}: no such file or folder")
