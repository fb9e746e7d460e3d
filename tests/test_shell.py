"""The terminal chat, `python -m minisgl.server --shell`: every reply ends, and only replies that
ended by themselves enter the history (issue 42)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

from minisgl import shell
from minisgl.config import ServerArgs
from minisgl.server import SHELL_MAX_TOKENS
from tests.server_utils import STARTUP_TIMEOUT_S, require_default_model

# Ten ordinary questions: facts, a greeting, lists, a short poem, arithmetic. Without the
# repetition guard the bundled model loops on the first, the poem and the days of the week.
QUESTIONS = (
    "What is the capital of France?",
    "Hello! How are you today?",
    "List three fruits.",
    "Write a short poem about the sea.",
    "What is 12 plus 7?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Name the days of the week.",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
)
# What one reply of at most SHELL_MAX_TOKENS may take on 2 busy CPU cores (the stated bound is
# in tokens; this only keeps a hung shell from hanging the test).
REPLY_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 60.0
READ_CHUNK_BYTES = 4096
# Terminal control sequences readline writes (bracketed paste on and off, ...).
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def test_only_replies_that_ended_enter_the_history(monkeypatch, capsys):
    """A reply cut at the bound, stopped by Ctrl-C, or failed leaves its question out too."""
    replies = [
        [("Paris.", None), ("", "stop")],
        [("la la la", None), ("", "length")],
        [("half", None), KeyboardInterrupt()],
        [RuntimeError("the server went away")],
        [("Fine.", "stop")],
    ]
    sent: list[list[str]] = []

    def stream_reply(server, fields, messages):
        sent.append([m["content"] for m in messages])
        for item in replies.pop(0):
            if isinstance(item, BaseException):
                raise item
            yield item

    lines = iter(["q1", "q2", "q3", "q4", "q5", "/exit"])
    monkeypatch.setattr(shell, "stream_reply", stream_reply)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    shell.chat_loop(ServerArgs(), {"model": "m", "max_tokens": 8})
    kept = ["q1", "Paris."]
    assert sent == [["q1"], [*kept, "q2"], [*kept, "q3"], [*kept, "q4"], [*kept, "q5"]]
    out = capsys.readouterr().out
    assert "cut at 8 tokens" in out  # the bound, stated
    assert out.count(shell.CUT) == 1 and out.count(shell.STOPPED) == 1, out
    assert "[error] the server went away" in out


class Terminal:
    """A child process on a pseudo-terminal, read with bounded, event-driven waits."""

    def __init__(self, argv: list[str]) -> None:
        self.fd, child_fd = os.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=child_fd, stdout=child_fd, stderr=child_fd, start_new_session=True
        )
        os.close(child_fd)
        self.seen = ""

    def read_until(self, marker: str, timeout_s: float) -> str:
        """The text up to and including the next `marker`; fails after `timeout_s`."""
        deadline_s = time.monotonic() + timeout_s
        while (at := self.seen.find(marker)) < 0:
            left_s = deadline_s - time.monotonic()
            assert left_s > 0, f"no {marker!r} in {timeout_s} s; got:\n{self.seen[-3000:]}"
            if select.select([self.fd], [], [], left_s)[0]:
                try:
                    data = os.read(self.fd, READ_CHUNK_BYTES)
                except OSError:  # the child closed the terminal
                    data = b""
                assert data, f"the shell exited ({self.proc.poll()}):\n{self.seen[-3000:]}"
                self.seen += ESCAPES.sub("", data.decode("utf-8", errors="replace"))
        text, self.seen = self.seen[: at + len(marker)], self.seen[at + len(marker) :]
        return text

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


@pytest.mark.timeout(STARTUP_TIMEOUT_S + len(QUESTIONS) * REPLY_TIMEOUT_S + EXIT_TIMEOUT_S)
def test_ten_questions_each_get_a_reply_that_ends():
    require_default_model()
    terminal = Terminal([sys.executable, "-m", "minisgl.server", "--shell"])
    try:
        banner = terminal.read_until(shell.PROMPT, STARTUP_TIMEOUT_S)
        assert f"cut at {SHELL_MAX_TOKENS} tokens" in banner, banner
        for question in QUESTIONS:
            terminal.type(question)
            echoed = terminal.read_until(question, REPLY_TIMEOUT_S)
            reply = terminal.read_until(shell.PROMPT, REPLY_TIMEOUT_S).removesuffix(shell.PROMPT)
            assert reply.strip(), (echoed, reply)
            assert "[cut" not in reply and "[error]" not in reply, (question, reply)
        terminal.type("/exit")
        assert terminal.proc.wait(timeout=EXIT_TIMEOUT_S) == 0, terminal.seen
    finally:
        terminal.close()
