"""Splits generated text into reasoning (`<think>…</think>`) and content, as it streams.

The model thinks first or not at all: output that opens with `<think>` (after whitespace) is
reasoning up to `</think>`, the rest is content. When the prompt's generation prompt already
opened `<think>` (templates that force thinking), output starts as reasoning. Reasoning that
never closes (the choice hit its length) stays reasoning. Tags later in the content are text.
A tag may arrive split across tokens: a possible partial tag is held back until the next
piece decides it. Whitespace around the tags is kept, so streamed pieces concatenate to the
non-streamed fields.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest tail of `buf` that begins `tag` (0: none): text to hold back."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, prompt_opened_think: bool = False):
        self.state = "reasoning" if prompt_opened_think else "start"
        self._held = ""

    @staticmethod
    def prompt_opens_think(generation_prompt: str) -> bool:
        return generation_prompt.rfind(START) > generation_prompt.rfind(END)

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds."""
        buf, self._held = self._held + text, ""
        if self.state == "start":
            body = buf.lstrip()
            if body.startswith(START):
                self.state = "reasoning"
                buf = body[len(START):]
            elif START.startswith(body):  # nothing but whitespace and maybe part of the tag yet
                self._held = buf
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = buf.find(END)
            if end < 0:
                keep = partial_tag_len(buf, END)
                self._held = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            self.state = "content"
            return buf[:end], buf[end + len(END):]
        return "", buf

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.state == "reasoning" else ("", held)
