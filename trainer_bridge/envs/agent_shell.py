"""A multi-turn tool-using agent (mini-swe-agent's shape) that talks to the agent gateway with
the ``openai`` client: the episode's trajectory id is its gateway session, the model calls a
``bash`` tool against a small in-memory repository, and the episode ends with an answer or after
``max_turns``. The trainer reads the token-exact trajectory (ids, loss mask, rollout logprobs,
route, routed experts) from the gateway, not from the chat text.

    episode = ShellAgentEpisode(gateway_url, "traj-7", TASKS[0])
    reward = episode.run()
    record = episode.trajectory()      # GET /sessions/traj-7/trajectory
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

import httpx

BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the repository (ls, cat, grep).",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}
SYSTEM = ("You are a software agent. Use the bash tool to inspect the repository, then answer "
          "with the requested value and nothing else.")


@dataclass(frozen=True)
class AgentTask:
    question: str
    files: dict[str, str]
    answer: str


TASKS = [AgentTask("What is the version in setup.cfg?",
                   {"setup.cfg": "[metadata]\nversion = 4.1.7\n", "README": "see setup.cfg"},
                   "4.1.7"),
         AgentTask("Which function does main.py call first?",
                   {"main.py": "def main():\n    load()\n    run()\n"}, "load")]


def run_bash(files: dict[str, str], command: str) -> str:
    """The sandbox: a read-only repository held in memory; nothing runs on the host."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        return f"bash: {e}"
    if not argv:
        return ""
    cmd, args = argv[0], argv[1:]
    if cmd == "ls":
        return "\n".join(sorted(files))
    if cmd == "cat":
        return "\n".join(files.get(a, f"cat: {a}: No such file or directory") for a in args)
    if cmd == "grep" and len(args) >= 2:
        return "\n".join(f"{f}:{line}" for f in args[1:] for line in files.get(f, "").splitlines()
                         if args[0] in line)
    return f"bash: {cmd}: command not found"


@dataclass
class ShellAgentEpisode:
    gateway_url: str
    session_id: str
    task: AgentTask
    max_turns: int = 6
    max_tokens: int = 256
    temperature: float = 1.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: int = 0

    def run(self) -> float:
        """Play the episode; the reward is 1.0 for the right answer, else 0.0."""
        import openai

        client = openai.OpenAI(base_url=f"{self.gateway_url}/sessions/{self.session_id}/v1",
                               api_key="unused", max_retries=0)
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": self.task.question}]
        for _ in range(self.max_turns):
            reply = client.chat.completions.create(
                model="policy", messages=self.messages, tools=[BASH_TOOL],
                max_tokens=self.max_tokens, temperature=self.temperature).choices[0].message
            self.messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return float(self.task.answer in (reply.content or ""))
            for call in reply.tool_calls:
                self.tool_calls += 1
                try:
                    command = json.loads(call.function.arguments).get("command", "")
                except (json.JSONDecodeError, AttributeError):
                    command = ""
                output = run_bash(self.task.files, command) if call.function.name == "bash" \
                    else f"unknown tool {call.function.name}"
                self.messages.append({"role": "tool", "tool_call_id": call.id,
                                      "content": output})
        return 0.0

    def trajectory(self) -> dict[str, Any]:
        r = httpx.get(f"{self.gateway_url}/sessions/{self.session_id}/trajectory", timeout=30)
        r.raise_for_status()
        return r.json()
