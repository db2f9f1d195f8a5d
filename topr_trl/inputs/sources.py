"""Where a model or dataset named on the command line or in code comes from: checked before anything loads (a local
path that does not exist fails at once in one line, and a Hub id with the Hub out of reach fails at once instead of
after minutes of retries), and data loaded from it by one loader, `load_data_source`, on top of `datasets`' own
reading of files and folders: prompts, benchmarks and offline datasets alike."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import overload
from urllib.parse import urlparse

import pyarrow.parquet
from accelerate import PartialState
from datasets import DatasetDict, load_dataset, load_from_disk
from huggingface_hub import constants, try_to_load_from_cache

from ..runtime.distributed import say
from .packaged_models import PACKAGED_MODELS, ModelSourceError, is_gguf_file, packaged_file


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
"""The local data files `load_data_source` reads, by suffix, with the `datasets` builder that reads them."""

SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")
"""What `datasets` reads as split names in a folder of data files."""

TEXT_COLUMNS = ("prompt", "completion")
"""Columns that stay text in a CSV file: a completion "3" is not the number 3, and an empty one is ""."""


def looks_like_local_path(name: str) -> bool:
    """A name that can only be a path: `./x`, `../x`, `/x`, `~/x`, or more than one `/` (a Hub id is `owner/name`
    or a bare `name`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def looks_like_local_data(name: str) -> bool:
    """A data source that can only be local: a name that can only be a path, or a data file's name."""
    return looks_like_local_path(name) or Path(name).suffix.lower() in LOCAL_FORMATS


def hub_unreachable_reason() -> str | None:
    """Why the Hub cannot be asked for a model or dataset (offline mode, or no connection within 3 s), or None."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=3).close()
    except OSError:
        return f"{endpoint.hostname} cannot be reached"
    return None


# the files one of transformers' tokenizers loads from (fast, BPE, WordPiece, SentencePiece)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)

# the files transformers (and PEFT, for an adapter folder) load weights from, a sharded checkpoint by its index
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


@overload
def resolve_model_source(name: str, what: str = ..., convert: bool = ..., ask_hub: bool = ...) -> str: ...
@overload
def resolve_model_source(name: None, what: str = ..., convert: bool = ..., ask_hub: bool = ...) -> None: ...
def resolve_model_source(
    name: str | None, what: str = "model", convert: bool = True, ask_hub: bool = True
) -> str | None:
    """What to load for the model `name`, failing at once, in one line, on one that cannot load:

    - a local model folder: itself (one without config.json fails);
    - a `.gguf` file: its trainable float32 folder, converted once and cached (`topr_trl.inputs.packaged_models`);
    - a Hub id in the local Hugging Face cache, or with the Hub reachable: itself, as transformers loads it;
    - a Hub id that a package ships (`PACKAGED_MODELS`) with the Hub out of reach: the packaged copy's trainable
      folder, said in one line;
    - anything else: a one-line exit (a path that does not exist, a Hub id that cannot be asked for).

    `convert=False` checks without converting (returning `name` where it would convert); `ask_hub=False` takes a Hub
    id as it is."""
    if name is None:
        return None
    path = Path(name).expanduser()
    if is_gguf_file(name):
        if not path.is_file():
            raise ModelSourceError(f"{what} file {name} does not exist")
        if not convert:
            return name
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
        return str(_converted(path, f"{path.stem}-{key}"))
    if path.exists():
        if not path.is_dir() or not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise SystemExit(
                f"topr-trl: {name} is not a model folder (no config.json in it): give the folder a "
                "model was saved to with save_pretrained, a .gguf file, or a Hub id"
            )
        if (path / "config.json").is_file() and not any((path / f).is_file() for f in TOKENIZER_FILES):
            # transformers would build a one-token tokenizer from the config alone, and generation would fail later
            raise SystemExit(
                f"topr-trl: {what} folder {name} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                "save the tokenizer beside the model (tokenizer.save_pretrained(folder))"
            )
        if not any((path / f).is_file() for f in WEIGHT_FILES):
            # transformers would stop at loading with a traceback; a dry run would call the folder valid
            raise SystemExit(
                f"topr-trl: {what} folder {name} has no weights (none of {', '.join(WEIGHT_FILES[:4])}): save "
                "them beside its config.json (model.save_pretrained(folder)), or give a .gguf file or a Hub id"
            )
        return name
    if looks_like_local_path(name):
        raise SystemExit(f"topr-trl: {what} folder {name} does not exist")

    if not ask_hub or isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name
    reason = hub_unreachable_reason()
    if reason is None:
        return name
    if name in PACKAGED_MODELS:
        if not convert:
            packaged_file(name)  # installed, or one line saying how
            return name
        packaged = PACKAGED_MODELS[name]
        folder = _converted(packaged_file(name), name.replace("/", "--"), packaged.sha256)
        say(f"the Hub cannot be reached ({reason}): using {packaged.what} of {name}, cached at {folder}")
        return str(folder)
    raise SystemExit(
        f"topr-trl: {name} is not a local folder, and the Hub cannot be asked for it ({reason}); "
        f"give the path of a {what} folder or .gguf file, or a Hub id with the Hub reachable"
        + (f" (packaged for use without the Hub: {', '.join(PACKAGED_MODELS)})" if PACKAGED_MODELS else "")
    )


def needs_resolving(model) -> bool:
    """Whether a trainer's `model` argument names a GGUF file or a packaged Hub id, which `resolve_model_source` may
    turn into a folder (any other name is left to transformers, as GRPOTrainer leaves it)."""
    return isinstance(model, str) and (is_gguf_file(model) or model in PACKAGED_MODELS)


def _converted(source: Path, cache_name: str, sha256: str | None = None) -> Path:
    """`trainable_folder`, converted by the main process first under `accelerate launch` (the others reuse it)."""
    from .gguf_conversion import trainable_folder  # noqa: PLC0415 - the converter loads only when a file is converted

    with PartialState().main_process_first():
        return trainable_folder(source, cache_name, sha256, say=say)


def check_data_source(name: str | None, flag: str) -> None:
    """Fail at once on a data path that does not exist (a name that can only be a path, or one with a data file's
    suffix); Hub ids are left to the loader."""
    if name is None or Path(name).expanduser().exists():
        return
    if looks_like_local_data(name):
        raise SystemExit(f"topr-trl: {flag} {name}: no such file or folder")


# ---------------------------------------------------------------------------------------------------------
# Loading data
# ---------------------------------------------------------------------------------------------------------


def split_of_file(path: Path) -> str:
    """`test.jsonl` -> `test`; `train-00000-of-00001.parquet` -> `train`."""
    return re.split(r"[-.]", Path(path).name, maxsplit=1)[0]


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `save_to_disk` (a Dataset or a DatasetDict)."""
    return any((Path(path) / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json"))


def load_data_source(
    source,
    split: str,
    config: str | None = None,
    cache_dir: str | None = None,
    *,
    what: str = "dataset",
    one_split: str | None = None,
):
    """The `split` of `source`, as a `datasets.Dataset`:

    - a `{split: file or files}` mapping;
    - a Hub dataset id (`datasets.load_dataset(source, config, split=split)`);
    - a `save_to_disk` folder: a Dataset as it is, or the `split` (or the only split) of a DatasetDict;
    - a `.json`/`.jsonl`/`.csv`/`.parquet` file;
    - a folder of such files (under `config/` first when that folder exists), searched through: files named after
      their split up to their first `-` or `.` (`train.jsonl` and `test.jsonl`, `test-00000-of-00001.parquet`) are
      the splits, as `datasets` reads a folder (a downloaded copy of a Hub dataset repository reads as the Hub's);
      a folder with no file named after a split is one split.

    A single file, or a folder with no file named after a split, holds one split: `one_split` when it is given (any
    other split is refused), else whichever split is asked for (the file the user pointed at is the data). A CSV
    file keeps `TEXT_COLUMNS` as text. A name that can only be a path (`looks_like_local_data`) is never sent to
    the Hub. `what` names the data in messages. Raises FileNotFoundError for a path that does not exist or a Hub
    id that could not be loaded (saying what to do without the Hub), ValueError for a file or folder that holds
    nothing loadable, mixes formats or lacks `split` (naming the splits there are), and for a local data file that
    is empty, holds no rows, is not UTF-8 or not JSON (naming the file and the line: `check_data_file`)."""
    text = str(source)
    if not isinstance(source, Mapping) and not Path(text).expanduser().exists() and not looks_like_local_data(text):
        return _load_from_hub(text, split, config, cache_dir, what)
    if not isinstance(source, Mapping) and is_saved_dataset(Path(text).expanduser()):
        return _require_rows(_load_saved(Path(text).expanduser(), split), text, what)
    files, label = local_data_files(source, split, config, what=what, one_split=one_split)
    return _load_files(files, split, cache_dir, label, what)


def check_local_data(
    source, split: str, config: str | None = None, *, what: str = "dataset", one_split: str | None = None
) -> None:
    """What `load_data_source` would refuse about local data files, found without loading them (for a dry run):
    a missing split, a file that is empty, holds no rows, is not UTF-8 or not JSON. A Hub id and a save_to_disk
    folder are not looked into."""
    text = str(source)
    if not isinstance(source, Mapping):
        path = Path(text).expanduser()
        if (not path.exists() and not looks_like_local_data(text)) or is_saved_dataset(path):
            return
    files, _ = local_data_files(source, split, config, what=what, one_split=one_split)
    for path in files:
        check_data_file(path, what)


def local_data_files(
    source, split: str, config: str | None = None, *, what: str = "dataset", one_split: str | None = None
) -> tuple[list[Path], str]:
    """The local data files `load_data_source` reads for the `split` of `source` (a `{split: files}` mapping, a data
    file or a folder of them), and how to name them in messages; the errors are `load_data_source`'s."""
    if isinstance(source, Mapping):
        if split not in source:
            raise ValueError(f"unknown split {split!r}: the given files have splits {sorted(source)}")
        chosen = source[split]
        files = [Path(chosen)] if isinstance(chosen, (str, Path)) else [Path(file) for file in chosen]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"no such data file: {str(path)!r}")
        return files, str(chosen)
    text = str(source)
    path = Path(text).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no such data file or folder: {text!r}")
    if path.is_file():
        if path.suffix.lower() not in LOCAL_FORMATS:
            raise ValueError(
                f"{text!r} holds no {what}: unsupported local data file (use a "
                f"{'/'.join(LOCAL_FORMATS)} file, a folder of them, a save_to_disk folder or a Hub id)"
            )
        files, single = [path], "one file"
    else:
        root = path / config if config and (path / config).is_dir() else path
        files = sorted(file for file in root.rglob("*") if file.is_file() and file.suffix.lower() in LOCAL_FORMATS)
        if not files:
            raise ValueError(
                f"{text!r} holds no {what}: no {'/'.join(LOCAL_FORMATS)} files in it, and it is no save_to_disk folder"
            )
        named = {split_of_file(file) for file in files} & {*SPLIT_NAMES, split}
        single = None if named else "a folder of files not named after splits"
        if named:
            files = [file for file in files if split_of_file(file) == split]
            if not files:
                raise ValueError(
                    f"unknown split {split!r}: {what} {text!r} has no {split!r} split; its files are "
                    f"named after the splits {sorted(named)}"
                )
    if single and one_split is not None and split != one_split:
        raise ValueError(
            f"{what} {text!r} is {single}, which holds one split, {one_split!r}: it has no {split!r} "
            f"split (name files after their split, e.g. {one_split}.jsonl and {split}.jsonl)"
        )
    return files, text


def _load_from_hub(name: str, split: str, config: str | None, cache_dir: str | None, what: str):
    try:
        return load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as error:  # the Hub's errors rarely say what to do offline, and span many lines
        reason = (str(error).splitlines() or [""])[0][:200]
        raise FileNotFoundError(
            f"{what} {name!r} is no local file or folder, and its split {split!r}"
            + (f" (config {config!r})" if config else "")
            + f" could not be loaded from the Hub ({type(error).__name__}: {reason}); without Hub access, pass a "
            "local .json/.jsonl/.csv/.parquet file (or a folder of them) or a save_to_disk folder"
        ) from error


def _load_files(files: Sequence[Path], split: str, cache_dir: str | None, source: str, what: str = "dataset"):
    formats = {LOCAL_FORMATS.get(path.suffix.lower()) for path in files}
    if None in formats:
        unsupported = next(path for path in files if path.suffix.lower() not in LOCAL_FORMATS)
        raise ValueError(
            f"unsupported local data file {str(unsupported)!r}: use one of {sorted(LOCAL_FORMATS)} "
            "(or a Hub dataset id)"
        )
    if len(formats) > 1:
        raise ValueError(
            f"{source!r} mixes data file formats {sorted(formats)} in split {split!r}: keep one format per split"
        )
    # `datasets` names neither the file nor the line of what it cannot read, and reads bytes that are not UTF-8
    # into strings that fail only when a row is used, steps into training: checked here first.
    for path in files:
        check_data_file(path, what)
    builder = formats.pop()
    options = {"converters": dict.fromkeys(TEXT_COLUMNS, str)} if builder == "csv" else {}
    try:
        dataset = load_dataset(
            builder, data_files={split: [str(path) for path in files]}, split=split, cache_dir=cache_dir, **options
        )
    except Exception as error:  # what the checks above do not catch; the cause holds the reason, in many lines
        cause = error
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        reason = (str(cause).splitlines() or [type(cause).__name__])[0][:300]
        where = str(files[0]) if len(files) == 1 else f"the {builder} files of {source}"
        raise ValueError(f"{where}: cannot be read as {what} ({type(cause).__name__}: {reason})") from error
    present = [column for column in TEXT_COLUMNS if column in dataset.column_names]
    if builder == "csv" and present:  # an empty cell reads as None
        dataset = dataset.map(lambda row: {column: row[column] or "" for column in present}, desc="reading text")
    return _require_rows(dataset, source, what)


def _require_rows(dataset, source: str, what: str):
    if len(dataset) == 0:
        raise ValueError(f"{source}: the {what} has no rows; it needs at least one")
    return dataset


def check_data_file(path: Path, what: str = "dataset") -> None:
    """Fail, naming the file (and the line, 1-based), on a local data file that cannot give rows: an empty file, a
    text file that is not UTF-8, a JSON file that does not parse or whose rows are not JSON objects, a file with no
    rows. Reads the whole file (a Parquet file: its footer only)."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); the {what} needs at least one row")
    suffix = path.suffix.lower()
    if LOCAL_FORMATS.get(suffix) == "parquet":
        try:
            rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
        except Exception as error:  # pyarrow's reasons are one line: passed on with the file's name
            raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
    elif LOCAL_FORMATS.get(suffix) == "csv":
        rows = _csv_rows(path)
    else:
        rows = _json_rows(path)
    if rows == 0:
        raise ValueError(f"{path}: the file holds no rows; the {what} needs at least one row")


def _utf8(path: Path, data: bytes, first_line: int = 1) -> str:
    """`data` (the file's text from line `first_line`) decoded, or a ValueError naming the line of the first byte
    that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data.count(b"\n", 0, error.start)
        column = error.start - data.rfind(b"\n", 0, error.start)
        raise ValueError(
            f"{path} line {line}: byte 0x{data[error.start]:02x} at column {column} is not UTF-8; "
            "save the file as UTF-8"
        ) from None


def _text_lines(path: Path):
    """(line number, text) of each line of `path`, 1-based, checked to be UTF-8 (a leading byte-order mark
    dropped)."""
    with path.open("rb") as file:
        for number, raw in enumerate(file, 1):
            text = _utf8(path, raw, number)
            yield number, text.removeprefix("\ufeff") if number == 1 else text


def _csv_rows(path: Path) -> int:
    records = csv.reader(text for _, text in _text_lines(path))
    next(records, None)  # the header
    return sum(1 for record in records if any(cell.strip() for cell in record))


def _json_rows(path: Path) -> int:
    """Rows of a JSON file as `datasets` reads one: JSON lines (an object per line), else one JSON document (a list
    of objects, or an object of columns)."""
    rows = 0
    for number, text in _text_lines(path):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            if rows == 0:  # not JSON lines: one document over several lines
                break
            raise ValueError(
                f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno}); write "
                "one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            if rows == 0 and isinstance(row, list):  # a document that is a list on one line
                break
            raise ValueError(
                f"{path} line {number}: not a JSON object ({type(row).__name__}); write one object "
                'per line, e.g. {"prompt": "..."}'
            ) from None
        rows += 1
    else:
        return rows
    try:
        document = json.loads(_utf8(path, path.read_bytes()).removeprefix("\ufeff"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} line {error.lineno}: not valid JSON ({error.msg} at column {error.colno}); "
            "write one JSON object per line, or one list of objects"
        ) from None
    if isinstance(document, list):
        if any(not isinstance(row, dict) for row in document):
            raise ValueError(
                f"{path}: a list whose items are not all JSON objects; write one object per row, "
                'e.g. [{"prompt": "..."}]'
            )
        return len(document)
    if isinstance(document, dict):  # columns: {"prompt": [...], ...}
        return max((len(column) for column in document.values() if isinstance(column, list)), default=1)
    raise ValueError(f"{path}: holds a JSON {type(document).__name__}, not rows; write one JSON object per line")


def _load_saved(path: Path, split: str):
    """A folder written by `save_to_disk`: a Dataset as it is, or the `split` (or the only split) of a DatasetDict."""
    saved = load_from_disk(str(path))
    if not isinstance(saved, DatasetDict):
        return saved
    if split not in saved and len(saved) != 1:
        raise ValueError(f"unknown split {split!r}: {str(path)!r} holds splits {sorted(saved)}")
    return saved[split] if split in saved else next(iter(saved.values()))
