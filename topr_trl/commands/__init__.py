"""The `topr-trl` command line, above the library: the commands (`cli`, `evaluate`), the one argument parser and the
built-in runs' recipes (`arguments`, `recipes/`), what a run does with its output folder (`output_folders`), and the
iterations that drive generation and the trainer in turn (`iterations`). Nothing in the library imports from here
(tests/test_layout.py)."""
