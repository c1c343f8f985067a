"""What `horizon agent` shows while it works: thinking (dimmed), answer text, tool calls and their
results as they happen, one line of usage per step (rich for colour; plain text when piped)."""

from __future__ import annotations

from typing import Any


class AgentPrinter:
    """An `on_event` callback for Agent: prints each event as it arrives."""

    def __init__(self, console=None, result_chars: int = 2000):
        from rich.console import Console

        self.console = console or Console(highlight=False, soft_wrap=True)
        self.result_chars = result_chars
        self.mode: str | None = None

    def _switch(self, mode: str | None) -> None:
        if self.mode != mode and self.mode is not None:
            if self.mode == "call":
                self.console.print(")", style="cyan", end="", markup=False)
            self.console.print()
        self.mode = mode

    def note(self, text: str) -> None:
        self._switch(None)
        self.console.print(text, style="dim", markup=False)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        out = self.console.print
        if kind == "step":
            self._switch(None)
            choice = f", tool choice {data['tool_choice']}" if data.get("tool_choice") else ""
            out(f"── step {data['step'] + 1} (thinking {data['tier'] or 'off'}{choice})", style="bold", markup=False)
        elif kind == "thinking":
            if self.mode != "thinking":
                self._switch("thinking")
                out("thinking: ", style="dim italic", end="", markup=False)
            out(data["text"], style="dim", end="", markup=False)
        elif kind == "text":
            self._switch("text")
            out(data["text"], end="", markup=False)
        elif kind == "tool_call":
            self._switch("call")
            out(f"call {data['name']}(", style="cyan", end="", markup=False)
        elif kind == "tool_args":
            out(data["text"], style="cyan", end="", markup=False)
        elif kind == "turn":
            self._switch(None)
            u = data["usage"]
            out(f"[{data['finish_reason']}; {u['completion_tokens']} tokens ({u['reasoning_tokens']} thinking), "
                f"{u['cached_tokens']}/{u['prompt_tokens']} prompt tokens from cache, {data['elapsed_s']:.2f} s]",
                style="dim", markup=False)
        elif kind == "tool_result":
            self._switch(None)
            text = data["content"]
            if len(text) > self.result_chars:
                text = text[: self.result_chars] + f" … ({len(data['content'])} characters)"
            out(f"→ {data['name']}: {text}", style="red" if data["is_error"] else "yellow", markup=False)
        elif kind == "error":
            self._switch(None)
            out(f"error: {data['message']}", style="bold red", markup=False)
        elif kind == "done":
            self._switch(None)
            u = data["usage"]
            out(f"done: {data['stop_reason']} after {data['steps']} step(s); {u['completion_tokens']} completion "
                f"tokens ({u['reasoning_tokens']} thinking), {u['cached_tokens']} prompt tokens from cache",
                style="bold", markup=False)
