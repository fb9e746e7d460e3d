"""`python -m minisgl.server [flags]`: the OpenAI-compatible server; `--shell` chats instead;
`--dp N` runs N replicas behind the SGLang Model Gateway."""

from __future__ import annotations

import sys

from minisgl.config import check_address, data_parallel_args, parse_server_args


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C (or chat, with --shell); returns the process exit code."""
    args, namespace = parse_server_args(argv)
    if namespace.shell:
        from minisgl.shell import run_shell

        return run_shell(args, namespace)
    dp = data_parallel_args(namespace)
    try:  # in the first second, not after the model has loaded
        check_address(args.host, args.port, dp.dp_size + (dp.dp_size > 1))
    except OSError as exc:
        sys.exit(f"python -m minisgl.server: error: {exc}")
    from minisgl.runtime.launch import ServerStack, run_until_stopped

    if dp.dp_size > 1:
        from minisgl.runtime.dp import DataParallelStack

        return run_until_stopped(DataParallelStack(args, dp))
    return run_until_stopped(ServerStack(args))


if __name__ == "__main__":
    sys.exit(main())
