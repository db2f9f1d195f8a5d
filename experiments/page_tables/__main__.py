"""`python -m experiments.page_tables [--write | --check]`: see the package's docstring."""

from __future__ import annotations

import argparse
import sys

from experiments.page_tables import TABLES, differences, marked, relative, write


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.page_tables", description="The pages' tables, from their evidence files."
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="regenerate every marked table in the pages")
    action.add_argument("--check", action="store_true", help="list what differs from the evidence; exit 1 if any")
    args = parser.parse_args()
    if args.write:
        changed = write()
        print("rewrote: " + (", ".join(relative(page) for page in changed) or "nothing (every table was current)"))
    if args.write or args.check:  # after --write, what a table cannot fix (a number typed into prose) is still reported
        found = differences()
        for difference in found:
            print(difference, end="\n\n")
        matched = "every table matches its evidence, and no checked page quotes a number by hand"
        print(f"{len(found)} difference(s)" if found else matched)
        return 1 if found else 0
    for name, make in TABLES.items():
        print(marked(name, make()), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
