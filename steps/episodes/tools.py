"""An environment's tool calls in worker processes, each call within rollout.environment.tool_timeout_s.

A `verifiers` ToolEnv calls its tools in the rollout's own process, where a tool that hangs (or blocks the event loop)
stops every episode of the shard. Here each worker loads the environment itself, as the rollout did, and runs the
calls it is sent; a call past its time limit kills its worker (a new one replaces it) and its result, the policy's to
read, says it timed out. What a tool raises reaches the environment as an error it formats for the policy, as
verifiers does.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

import verifiers as vf

from moeloop.steps.config_task import EnvironmentConfig
from moeloop.steps.errors import MoeloopError

LOAD_SECONDS = 120.0  # a worker's import of the environment, on a busy node


def serve(settings_json: str, channel: Connection) -> None:
    """A worker: load the environment, say so, then run each (tool, arguments) sent and answer its result."""
    from moeloop.steps.episodes.environment import load_environment

    environment = load_environment(EnvironmentConfig.model_validate_json(settings_json))
    channel.send("ready")
    while (call := channel.recv()) is not None:  # None: the shard is done
        name, arguments = call
        try:
            result = environment.tool_map[name](**arguments)
            if asyncio.iscoroutine(result):
                result = asyncio.run(result)
            channel.send(str(result))
        except Exception as error:  # the tool's own failure: the environment words it for the policy
            channel.send(environment.error_formatter(error))


class ToolWorkers:
    """`environment.call_tool` for a ToolEnv, through up to `processes` workers (`install`), each started when a call
    finds none idle (a shard whose policy calls no tool starts none); `close()` ends them."""

    def __init__(self, settings: EnvironmentConfig, processes: int):
        self.settings, self.processes = settings, processes
        self.context = multiprocessing.get_context("spawn")  # no fork of a process holding an engine and threads
        self.idle: queue.Queue = queue.Queue()
        self.workers: list[tuple[Any, Connection]] = []
        self.slots = 0  # workers started, or to be started in a killed one's place
        self.starting = threading.Lock()

    def take(self) -> tuple[Any, Connection]:
        """An idle worker; else a new one while fewer than `processes` were started; else the next to be idle. A
        killed worker leaves None in the queue: whoever takes it starts its replacement."""
        try:
            worker = self.idle.get_nowait()
        except queue.Empty:
            with self.starting:
                if self.slots < self.processes:
                    self.slots += 1
                    return self.start()
            worker = self.idle.get()
        return self.start() if worker is None else worker

    def start(self) -> tuple[Any, Connection]:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=serve, args=(self.settings.model_dump_json(), theirs), daemon=True)
        process.start()
        theirs.close()
        if not ours.poll(LOAD_SECONDS):
            process.kill()
            raise MoeloopError(f"rollout.environment {self.settings.name!r}: a tool worker did not load it in time")
        try:
            ours.recv()
        except EOFError:
            raise MoeloopError(f"rollout.environment {self.settings.name!r}: a tool worker failed to load it") from None
        self.workers.append((process, ours))
        return process, ours

    def install(self, environment: Any) -> None:
        """Route the environment's tool calls through the workers."""
        environment.call_tool = self.call_tool

    async def call_tool(self, tool_name: str, tool_args: dict, tool_call_id: str, **kwargs: Any) -> vf.ToolMessage:
        content = await asyncio.get_running_loop().run_in_executor(None, self.call, tool_name, tool_args)
        return vf.ToolMessage(role="tool", content=content, tool_call_id=tool_call_id)

    def call(self, name: str, arguments: dict) -> str:
        """The tool's result (or the environment's wording of its error, or why it has none) for the policy."""
        worker = self.take()
        process, channel = worker
        try:
            channel.send((name, arguments))
            if channel.poll(self.settings.tool_timeout_s):
                content = channel.recv()
                self.idle.put(worker)
                return content
            why = f"tool {name} did not answer within {self.settings.tool_timeout_s:g} s"
        except (EOFError, OSError):  # the tool ended its worker (os._exit, a crash)
            why = f"tool {name} ended its process"
        process.kill()
        process.join()
        channel.close()
        self.workers.remove(worker)
        self.idle.put(None)  # its place: the next call starts another
        return why

    def close(self) -> None:
        """Each worker told to end (a killed one leaves its semaphores to the resource tracker), else killed."""
        for process, channel in self.workers:
            try:
                channel.send(None)
            except OSError:
                pass
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
            channel.close()
        self.workers.clear()
