"""Print the list-valued options (nargs '+' / '*' or several) of the engine installed in this
interpreter's environment, as ``src/tailserve/engines/known/ENGINE-VERSION-lists.txt`` holds them.

    .peers/vllm/bin/python scripts/known_list_options.py vllm     > .../vllm-0.32.0-lists.txt
    .peers/sglang/bin/python scripts/known_list_options.py sglang > .../sglang-0.5.23-lists.txt
"""

import argparse
import sys


def parser_of(engine: str) -> argparse.ArgumentParser:
    if engine == "vllm":
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return make_arg_parser(FlexibleArgumentParser())
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def main() -> None:
    found = set()
    for action in parser_of(sys.argv[1])._actions:
        if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
            found.update(o for o in action.option_strings if o.startswith("--"))
    print("\n".join(sorted(found)))


if __name__ == "__main__":
    main()
