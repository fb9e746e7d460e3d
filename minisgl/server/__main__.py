"""`python -m minisgl.server [flags]`: the OpenAI-compatible server; `--shell` chats instead."""

from __future__ import annotations

import sys

from minisgl.config import parse_server_args


def main(argv: list[str] | None = None) -> int:
    args, namespace = parse_server_args(argv)
    if namespace.shell:
        from minisgl.shell import run_shell

        return run_shell(args)
    from minisgl.server.launch import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
