"""``pagedkv chat`` in a pseudo-terminal: two turns (the second finds the first in the prefix
cache), ``/stats``, ``/reset``, ``/exit``; and a session driven in-process, whose streamed reply is
the model's greedy completion of the conversation."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

from pagedkv_testing.tiny_model import write_tiny_model

PROMPT = ">>> "


class Terminal:
    """A child process on a pseudo-terminal, read until an expected text appears."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.execvpe(argv[0], argv, {**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
        self.seen = ""

    def expect(self, text: str, timeout: float = 180.0) -> str:
        """Everything read up to and including the next ``text``; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} after {timeout} s; the terminal shows:\n{self.seen[-3000:]}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child is gone
                    chunk = b""
                assert chunk, f"the program ended before {text!r}:\n{self.seen[-3000:]}"
                self.seen += chunk.decode(errors="replace").replace("\r\n", "\n")
        head, _, self.seen = self.seen.partition(text)
        return head

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 4096)  # keep the pipe drained
            except OSError:
                pass
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError("the chat did not exit")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("chat") / "model")


def test_chat_in_a_terminal(tiny: Path) -> None:
    term = Terminal([sys.executable, "-m", "pagedkv.cli", "chat", "--model", str(tiny), "--max-tokens", "6",
                     "--temperature", "0", "--block-size", "4", "--num-kv-blocks", "64"])
    try:
        banner = term.expect(PROMPT)
        assert f"pagedkv chat with {tiny.name}" in banner and "/reset" in banner
        term.send("the quick brown fox")
        first = term.expect(PROMPT)
        assert first.startswith("the quick brown fox\n")  # the terminal echoes the line typed
        reply = first.split("\n", 1)[1].rstrip("\n")
        assert reply  # six tokens of a random model, on one line
        term.send("hello world")
        term.expect(PROMPT)
        term.send("/stats")
        stats = term.expect(PROMPT)
        assert "conversation: 2 turn(s), 4 message(s)" in stats
        cached = int(re.search(r"its prompt: \d+ tokens, (\d+) of them cached", stats).group(1))
        assert cached >= 4  # the first turn's full blocks, found again
        assert re.search(r"KV cache: \d+/64 blocks in use \(4 tokens each\)", stats)
        term.send("/reset")
        assert "(conversation cleared)" in term.expect(PROMPT)
        term.send("/stats")
        after = term.expect(PROMPT)
        assert "conversation: 0 turn(s), 0 message(s)" in after and "last reply" not in after
        term.send("/nope")
        assert "unknown command /nope" in term.expect(PROMPT)
        term.send("/exit")
        assert term.wait() == 0
    except BaseException:
        try:
            os.kill(term.pid, 9)
        except ProcessLookupError:
            pass
        raise


def test_a_session_streams_the_greedy_reply(tiny: Path) -> None:
    """The reply printed is the model's greedy completion of the rendered conversation, and the
    second turn's prompt holds the first exchange."""
    from pagedkv.chat_cli import ChatSession, Conversation
    from pagedkv.engine import LLMEngine
    from pagedkv.sampling_params import SamplingParams

    engine = LLMEngine.from_options(str(tiny), block_size=4, num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        session = ChatSession(engine, params, Conversation(system="be brief"))
        out = io.StringIO()
        assert session.run(io.StringIO("hello\nworld\n/exit\n"), out) == 0
        lines = out.getvalue().split(PROMPT)
        replies = [lines[1].rstrip("\n"), lines[2].rstrip("\n")]
        conv = session.conv.messages
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
        assert [conv[1]["content"], conv[3]["content"]] == replies
        expected_prompt = engine.tokenizer.encode_chat(
            [{"role": "system", "content": "be brief"}, *conv[:3]], add_generation_prompt=True)
        engine.add_request("check", expected_prompt, params)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
        assert done[0].outputs[0].text == replies[1]
        assert session.conv.last is not None and session.conv.last.tokens == 5
    finally:
        engine.close()


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv import __version__
    from pagedkv.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0 and capsys.readouterr().out == f"pagedkv {__version__}\n"
