"""The decoder process: large HTTP bodies are decoded here, outside the gateway's process.

pydantic holds the GIL for all of a decode, and a body of a hundred thousand small JSON values takes
about a second however it is spent: on a thread it still stalls the gateway's event loop (every
stream's next write) for that second, and its peak memory stays in the gateway's heap. So one child
process (``python -m gateway.http.decoder``) decodes them, one at a time, and hands back the model
with the fields Loom ignores dropped (``compact_extras``), so what crosses back is small. It is
replaced after ``DECODES_PER_PROCESS`` bodies (its heap's high-water mark goes with it) and whenever
it fails.

The wire between them is a pipe: ``<u32 name length><name><u64 body length><body>`` in, and
``<u64 length><pickle of ("ok", model) or ("error", GatewayError)>`` out. Pickles only ever come from
the child this process started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from pydantic import BaseModel

from gateway.errors import ErrorKind, GatewayError

DECODES_PER_PROCESS = 200


class DecoderProcess:
    """The gateway's side: one child at a time, restarted as needed; calls are served in order."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._served = 0
        self._lock = threading.Lock()
        # One thread waits on the pipe, so the event loop never does.
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-decoder")

    async def decode(self, model: type[BaseModel], raw: bytes) -> Any:
        loop = asyncio.get_running_loop()
        kind, value = await loop.run_in_executor(self._io, self._call, model.__name__, raw)
        if kind == "error":
            raise value
        return value

    def _call(self, name: str, raw: bytes) -> tuple[str, Any]:
        with self._lock:
            child = self._running()
            try:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(struct.pack("<I", len(name)) + name.encode() + struct.pack("<Q", len(raw)))
                child.stdin.write(raw)
                child.stdin.flush()
                (size,) = struct.unpack("<Q", _read_exactly(child.stdout, 8))
                answer: tuple[str, Any] = pickle.loads(_read_exactly(child.stdout, size))
            except (OSError, EOFError, struct.error, pickle.UnpicklingError):
                self._stop()  # it died (out of memory?): a new one serves the next body
                return "error", GatewayError(
                    ErrorKind.UNAVAILABLE, "the request body could not be decoded; retry it"
                )
            self._served += 1
            if self._served >= DECODES_PER_PROCESS:
                self._stop()
            return answer

    def _running(self) -> subprocess.Popen[bytes]:
        if self._child is None or self._child.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._child = subprocess.Popen(
                [sys.executable, "-m", "gateway.http.decoder"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            self._served = 0
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()
            child.kill()
            child.wait()

    def close(self) -> None:
        with self._lock:
            self._stop()
        self._io.shutdown(wait=False)


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("the decoder process ended")
    return data


def _serve() -> None:
    """The child's loop: decode each body it is sent until its input ends."""
    from gateway.http.body import decode_now
    from gateway.http.schema import ChatCompletionRequest, CompletionRequest

    models: dict[str, type[BaseModel]] = {m.__name__: m for m in (ChatCompletionRequest, CompletionRequest)}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            return
        (n,) = struct.unpack("<I", head)
        name = _read_exactly(stdin, n).decode()
        (size,) = struct.unpack("<Q", _read_exactly(stdin, 8))
        raw = _read_exactly(stdin, size)
        try:
            answer: tuple[str, Any] = ("ok", decode_now(models[name], raw))
        except GatewayError as err:
            answer = ("error", err)
        out = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(struct.pack("<Q", len(out)) + out)
        stdout.flush()


if __name__ == "__main__":
    _serve()
