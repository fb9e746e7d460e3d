"""Chat with a model in the terminal: `python -m minisgl.server --shell`.

It starts the full server stack on a free local port and talks to it over the same HTTP API as
any client, with the standard library only, so it runs on exactly what `pip install -e .`
installs. Its commands, how every reply ends and what enters the history:
docs/server.md#chat-in-the-terminal."""

import argparse
import contextlib
import http.client
import json
import socket
import sys
from collections.abc import Iterator

from minisgl.config import ServerArgs
from minisgl.models.names import served_model_name
from minisgl.runtime.launch import ServerStack
from minisgl.runtime.supervisor import StartupError

PROMPT = ">>> "
RESET_COMMAND = "/reset"
EXIT_COMMANDS = ("/exit", "/quit")
# A reply can take long on CPU; this only bounds a server that stopped answering.
REPLY_TIMEOUT_S = 600.0
SHELL_LOG_LEVEL = "warning"
# After a reply that did not end by itself (it is left out of the history).
CUT = " [cut at the token limit: not kept in the history]"
STOPPED = " [stopped: not kept in the history]"


@contextlib.contextmanager
def _post(server: ServerArgs, path: str, body: dict) -> Iterator[http.client.HTTPResponse]:
    """POST `body` as JSON and yield the response; a non-200 answer raises RuntimeError with the
    server's message. Leaving closes the connection (which aborts a streamed request)."""
    auth = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=REPLY_TIMEOUT_S)
    with contextlib.closing(conn):
        headers = {"Content-Type": "application/json", **auth}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            text = response.read().decode("utf-8", errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                text = json.loads(text)["error"]["message"]
            raise RuntimeError(text if response.status < 500 else f"HTTP {response.status}: {text}")
        yield response


def stream_reply(
    server: ServerArgs, fields: dict, messages: list[dict[str, str]]
) -> Iterator[tuple[str, str | None]]:
    """Yield the assistant's reply in pieces as the server streams them, each with the finish
    reason (None until the last). Leaving early (Ctrl-C) closes the connection, which aborts the
    request on the server. `fields`: model, sampling."""
    # --shell-max-tokens, cut to what the context window leaves after this conversation (a
    # bound past the window is an error, as in vLLM, and a short --max-model-len is common).
    with _post(server, "/tokenize", {"messages": messages}) as response:
        room = (counted := json.loads(response.read()))["max_model_len"] - counted["count"]
    if room < 1:
        raise RuntimeError(f"the conversation fills the context window; {RESET_COMMAND} clears it")
    budget = min(fields["max_tokens"], room)
    body = {**fields, "max_tokens": budget, "messages": messages, "stream": True}
    with _post(server, "/v1/chat/completions", body) as response:
        for raw in response:  # server-sent events, one line at a time (chunked decoding included)
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            for choice in event.get("choices", []):
                yield choice.get("delta", {}).get("content") or "", choice.get("finish_reason")


def chat_loop(server: ServerArgs, fields: dict) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    print(
        f"minisgl shell: chatting with {fields['model']}; a reply ends by itself or is cut at "
        f"{fields['max_tokens']} tokens. {RESET_COMMAND} clears history, /exit quits."
    )
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
        question = {"role": "user", "content": line}
        parts: list[str] = []
        finish = None
        try:
            for piece, finish in stream_reply(server, fields, [*history, question]):  # noqa: B007
                parts.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(STOPPED, end="")  # leaving the stream aborts the request server-side
        except (RuntimeError, OSError) as exc:  # OSError: the server went away
            print(f"[error] {exc}", end="")
        print(CUT if finish == "length" else "")
        if finish == "stop":  # else the question is forgotten too, keeping roles alternating
            history += [question, {"role": "assistant", "content": "".join(parts)}]


def run_shell(args: ServerArgs, ns: argparse.Namespace) -> int:
    with socket.create_server((args.host, 0)) as sock:  # a free port for the stack
        args = args.replace(port=int(sock.getsockname()[1]), log_level=SHELL_LOG_LEVEL)
    fields = {"model": served_model_name(args), **ns.shell_sampling}
    stack = ServerStack(args)
    print(f"loading {fields['model']} ...", flush=True)
    try:
        stack.start()
        stack.wait_ready()
        chat_loop(args, fields)
        return 0
    except StartupError as exc:
        print(f"server failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.shutdown()
