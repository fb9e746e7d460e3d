"""Chat with a model in the terminal: `python -m minisgl.shell` (or `minisgl.server --shell`).

It starts the full server stack on a free local port and talks to it over the same HTTP API as
any client, streaming the reply as it is generated. Commands: /reset clears the history, /exit
quits (so do Ctrl-D and Ctrl-C at the prompt; Ctrl-C during a reply stops that reply).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from collections.abc import Iterator

import httpx

from minisgl.config import ServerArgs, parse_server_args
from minisgl.server.launch import ServerStack, StackError
from minisgl.server.model_names import served_model_name

PROMPT = ">>> "
RESET_COMMAND = "/reset"
EXIT_COMMANDS = ("/exit", "/quit")
# A reply can take long on CPU; this only bounds a server that stopped answering.
REPLY_TIMEOUT_S = 600.0
SHELL_LOG_LEVEL = "warning"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stream_reply(client: httpx.Client, model: str, messages: list[dict[str, str]]) -> Iterator[str]:
    """Yield the assistant's reply in pieces, as the server streams them."""
    body = {"model": model, "messages": messages, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(response.json().get("error", {}).get("message", response.text))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    yield content


def chat_loop(client: httpx.Client, model: str) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    print(f"minisgl shell: chatting with {model}. {RESET_COMMAND} clears history, /exit quits.")
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not line:
            continue
        if line in EXIT_COMMANDS:
            return
        if line == RESET_COMMAND:
            history.clear()
            print("(history cleared)")
            continue
        history.append({"role": "user", "content": line})
        parts: list[str] = []
        try:
            for piece in stream_reply(client, model, history):
                parts.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")  # leaving the stream aborts the request server-side
        except RuntimeError as exc:
            print(f"[error] {exc}", end="")
        print()
        if parts:
            history.append({"role": "assistant", "content": "".join(parts)})
        else:
            history.pop()  # no reply: forget the question too, keeping roles alternating


def run_shell(args: ServerArgs) -> int:
    args = args.replace(port=_free_port(args.host), log_level=SHELL_LOG_LEVEL)
    stack = ServerStack(args)
    print(f"loading {served_model_name(args)} ...", flush=True)
    try:
        stack.start()
        stack.wait_ready()
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=stack.url, headers=headers, timeout=REPLY_TIMEOUT_S) as client:
            chat_loop(client, served_model_name(args))
        return 0
    except StackError as exc:
        print(f"server failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.shutdown()


def main(argv: list[str] | None = None) -> int:
    args, _ = parse_server_args(argv)
    return run_shell(args)


if __name__ == "__main__":
    sys.exit(main())
