"""The `topr-trl` command line, above the library, and its commands as Python calls.

Each command parses its arguments once into dataclasses and runs on them, as TRL's scripts do
(`main(script_args, training_args, model_args)` behind a parser):

    from topr_trl.commands import parse_command, train

    script_args, training_args, model_args = parse_command("train", ["--task", "reasoning", "--max_steps", "5"])
    summary = train(script_args, training_args, model_args)

The modules: `cli` (the console script: parse, then dispatch), `arguments` and `recipes/` (the one parser, the
commands' dataclasses and the built-in runs' defaults), `runs` (what train, generate and iterate do with parsed
arguments), `evaluate`, `iterations` (generation and the trainer in turn), `output_folders` (the run folder's lock
and checks), `interruption` (Ctrl-C), `external_services` (the Hub, trackers, a vLLM server) and `curves` (curves.png).
Nothing in the library imports from here (tests/test_layout.py).
"""

from .arguments import (
    GenerateScriptArguments,
    Invocation,
    IterateScriptArguments,
    TrainScriptArguments,
    parse_command,
    parse_command_line,
)
from .runs import generate, iterate, train


__all__ = [
    "GenerateScriptArguments",
    "Invocation",
    "IterateScriptArguments",
    "TrainScriptArguments",
    "generate",
    "iterate",
    "parse_command",
    "parse_command_line",
    "train",
]
