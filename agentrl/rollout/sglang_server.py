"""The SGLang engine over HTTP: a server at a given URL, or one launched here on 127.0.0.1.

The same protocol as the in-process engine, through SGLang's routes: /generate (input_ids in,
output_ids and logprobs out), /update_weights_from_tensor or /update_weights_from_disk, /flush_cache,
/release_memory_occupation, /resume_memory_occupation, /health_generate and /server_info (read once
at connect: the longest prompt the scheduler accepts, and whether the server can release its
memory; one without --enable-memory-saver answers a release with 200 and frees nothing, which gets
a warning at the first release). Every request has a timeout; one that cannot reach the server is
retried with backoff (one that timed out waiting for its answer is not: it may still be running
there), and if it still fails the error names the URL, the route and the cause (and the launched
server's exit code and log tail): a dead server stops the run instead of hanging it.

Weights go by where the server is and where the tensors are (`weight_transfer="auto"`):
- CUDA tensors, loopback server: /update_weights_from_tensor with pickled CUDA IPC handles, as
  SGLang's own HTTP client sends them, each naming its GPU by UUID (no copy; the server must see
  the same GPUs, in any order).
- CPU tensors, loopback server: /update_weights_from_disk from safetensors shards in a temporary
  directory. Handles cannot work here (a CPU tensor's handle is a file descriptor only the sender's
  own child processes can receive), and the bytes in the JSON body are slow: base64 plus SGLang's
  parsing took 56 s for SmolLM2's 538 MB on a 2-core CPU, the disk 2.6 s.
- a server on another host: /update_weights_from_tensor by value (a plain pickle, base64, which
  SGLang's restricted unpickler accepts), bucket by bucket, in buckets of update_bucket_bytes /
  tp_size since the body repeats the bytes for every tensor-parallel rank.
With handles, every rank gets a pickle of its own, as SGLang's Engine sends them.

This module does not import sglang: sglang_launch.py starts `python -m sglang.launch_server` as a
subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import io
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Literal, TypeVar
from urllib.parse import urlparse

import httpx
import torch
from safetensors.torch import save_file

from agentrl.rollout.sglang_engine import (IDLE_TIMEOUT_S, ReleasedRegions, check_score_args, empty_torch_cache,
                                           prompt_logprobs, sampling_dict, to_completion, weight_buckets)
from agentrl.rollout.sglang_launch import launch_server, log_tail, stop_server
from agentrl.tools.loader import url_shown
from agentrl.types import Completion, SamplingParams

T = TypeVar("T")
RETRIES = 3  # attempts for a request that cannot reach the server, all within one timeout_s
CONNECT_TIMEOUT_S = 10.0  # a host that never answers the connection (gone dark) is retried after this
# Only a request that never reached the server is sent again: one that timed out waiting for its
# answer may still be running there, and three more waits of timeout_s would hide a hung server.
UNREACHED = (httpx.ConnectError, httpx.ConnectTimeout)
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _prepended(first: T, rest: Iterator[T]) -> Iterator[T]:
    """`first`, then `rest`, holding no reference to `first` once it is handed out (itertools.chain
    keeps its arguments until it is exhausted: a whole bucket of weights, for the whole update)."""
    held = [first]
    del first
    yield held.pop()
    yield from rest


async def _closed_at_loop_end(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """Suspended until its event loop shuts its async generators down, then closes `client` there."""
    try:
        yield
    finally:
        await client.aclose()


def _timeout(seconds: float) -> httpx.Timeout:
    """What is left of a request's timeout_s, of which a connection attempt gets at most
    CONNECT_TIMEOUT_S: the retries of a host that never answers fit in one timeout_s."""
    seconds = max(seconds, 0.001)
    return httpx.Timeout(seconds, connect=min(CONNECT_TIMEOUT_S, seconds))


def _retry(error: httpx.TransportError, attempt: int, retries: int, deadline: float) -> bool:
    """Whether a failed request is sent again: it never reached the server, attempts are left, and
    so is time after the backoff."""
    return (isinstance(error, UNREACHED) and attempt < retries - 1
            and time.monotonic() + 0.5 * 2**attempt < deadline)


# Where torch's reduction of a CUDA tensor puts the index of the tensor's device (reduce_tensor's
# arguments to rebuild_cuda_tensor); SGLang's own sender replaces it at the same place.
_HANDLE_DEVICE_ARG = 6


def _reduce_naming_the_gpu(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """torch's reduction of a tensor, with a CUDA tensor's device given by its GPU's UUID instead of
    this process's index for it. A device index means another device in a server started with
    another CUDA_VISIBLE_DEVICES; SGLang's scheduler maps a UUID to its own index for that GPU (and
    names the UUID when it cannot see that GPU), as it does for its own sender's handles."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[_HANDLE_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_HANDLE_DEVICE_ARG]).uuid)
        args = (*args[:_HANDLE_DEVICE_ARG], uuid, *args[_HANDLE_DEVICE_ARG + 1:])
    return rebuild, args


def serialize_bucket(bucket: list[tuple[str, torch.Tensor]], by_handle: bool) -> str:
    """base64 of a pickle SGLang's scheduler unpickles: CUDA IPC handles, or the tensors' bytes."""
    buffer = io.BytesIO()
    if by_handle:
        importlib.import_module("torch.multiprocessing")  # registers torch's handle reductions with ForkingPickler
        from multiprocessing.reduction import ForkingPickler

        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = pickler.dispatch_table[torch.nn.Parameter] = _reduce_naming_the_gpu
        pickler.dump(bucket)
    else:
        pickle.dump([(name, t.cpu()) for name, t in bucket], buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SGLangServerEngine:
    """An SGLang HTTP server behind the Engine protocol."""

    def __init__(self, url: str | None, args: dict[str, Any], update_bucket_bytes: int = 512 * 2**20,
                 timeout_s: float = 600.0, weight_transfer: Literal["auto", "disk", "tensor"] = "auto"):
        self.process: subprocess.Popen | None = None
        self.log_path: str | None = None
        if url is None:
            self.process, url, self.log_path = launch_server(args, timeout_s)
        self.url = url.rstrip("/")
        self.shown = url_shown(self.url)  # what messages show: no password or query string
        # A loopback server is never reached through a proxy of the environment's (HTTP_PROXY with
        # NO_PROXY=localhost sends 127.0.0.1 to the proxy); a remote one may need it.
        self._trust_env = urlparse(self.url).hostname not in LOOPBACK
        self.tp_size = int(args.get("tp_size", 1))
        self.update_bucket_bytes = update_bucket_bytes
        self.timeout_s = timeout_s
        self.weight_transfer = weight_transfer
        self._weights_dir: Path | None = None
        self.weight_version = 0
        self.stats = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._regions = ReleasedRegions()
        self._client = httpx.Client(base_url=self.url, timeout=timeout_s, trust_env=self._trust_env)
        self._clients: dict[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, AsyncIterator[None]]] = {}
        self._clients_lock = threading.Lock()  # loops in several threads may ask for theirs (_async_client)
        self._warned_no_saver = False
        try:
            self.check_health()
            self.server_info = self._read_server_info()
        except BaseException:  # a server launched above is stopped, not left to the process's exit
            self.close()
            raise
        # The longest prompt the scheduler accepts (a longer one is aborted), as the server reports it.
        self.max_req_input_len: int | None = self.server_info.get("max_req_input_len")
        # Each of the server's tensor-parallel ranks reads its own payload of a weight update: a given
        # server's own count decides, not the recipe's (a rank without one fails and stops the server).
        self.tp_size = int(self.server_info.get("tp_size") or self.tp_size)

    def _failure(self, route: str, cause: str) -> RuntimeError:
        where = f"SGLang server at {self.shown}: {route} failed ({cause})"
        if self.process is not None and self.process.poll() is not None:
            where += f"; the server exited with code {self.process.returncode}, log {self.log_path}: " \
                     f"{log_tail(self.log_path)}"
        return RuntimeError(where)

    def _parsed(self, route: str, response: httpx.Response, parse: Callable[[Any], T]) -> T:
        """`parse` of a 200's JSON body. Another answer (a proxy's error page, another service on the
        port) fails naming the URL, the route and the body, not with a bare JSON or key error."""
        try:
            return parse(response.json())
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise self._failure(route, f"HTTP 200 with an unexpected body ({type(e).__name__}: {e}): "
                                       f"{response.text.strip()[:300]}") from None

    def _post(self, route: str, body: dict[str, Any] | None = None, retries: int = RETRIES,
              params: dict[str, Any] | None = None) -> httpx.Response:
        return self._send("POST", route, body or {}, retries, params=params)

    def _send(self, method: str, route: str, body: dict[str, Any] | None, retries: int = RETRIES,
              timeout: float | None = None, params: dict[str, Any] | None = None) -> httpx.Response:
        deadline = time.monotonic() + (timeout or self.timeout_s)
        for attempt in range(retries):
            try:
                response = self._client.request(method, route, json=body, params=params,
                                                timeout=_timeout(deadline - time.monotonic()))
                break
            except httpx.TransportError as e:  # not reachable, or no answer within the timeout
                if not _retry(e, attempt, retries, deadline):
                    raise self._failure(f"{method} {route}", f"{type(e).__name__}: {e}") from None
                time.sleep(0.5 * 2**attempt)
        if response.status_code != 200:
            raise self._failure(f"{method} {route}", f"HTTP {response.status_code}: {response.text.strip()[:300]}")
        return response

    def check_health(self) -> None:
        """One token through the scheduler (/health_generate); raises naming the URL when it is down."""
        self._send("GET", "/health_generate", None, timeout=min(self.timeout_s, 60.0))

    def _read_server_info(self) -> dict[str, Any]:
        """/server_info: the server's arguments and its scheduler's limits. A server that does not
        answer it with them (a router in front of several servers) gets a warning, and the checks
        that read it (the prompt limit, the memory saver) are skipped."""
        route = "GET /server_info"
        try:
            info = self._send("GET", "/server_info", None, timeout=min(self.timeout_s, 60.0)).json()
        except (RuntimeError, ValueError) as e:
            info, cause = None, str(e)
        else:
            cause = "its answer is not a JSON object"
        if not isinstance(info, dict):
            print(f"agentrl: warning: SGLang server at {self.shown}: {route} failed ({cause}); the checks of its "
                  "prompt limit and memory saver are skipped", file=sys.stderr)
            return {}
        return info

    async def _async_client(self) -> httpx.AsyncClient:
        """This event loop's client (each rollout has a loop of its own; loops in other threads may
        use the engine meanwhile), closed in its loop at the loop's end: it lives in an async
        generator, which asyncio.run (and run_with_daemon_threads) closes before the loop. Left
        unclosed, every rollout's connections stayed open for as long as the engine lived."""
        loop = asyncio.get_running_loop()
        with self._clients_lock:
            for gone in [other for other in self._clients if other.is_closed()]:
                del self._clients[gone]  # closed by its loop's end (without asyncio.run's: by the GC)
            entry = self._clients.get(loop)
            fresh = entry is None
            if fresh:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
                client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits,
                                           trust_env=self._trust_env)
                entry = self._clients[loop] = (client, _closed_at_loop_end(client))
        if fresh:  # no await before this: no other request of this loop sees the client unstarted
            await anext(entry[1])  # the running loop now holds it among its async generators
        return entry[0]

    def _close_async_clients(self) -> None:
        """Close the clients whose loops have not ended: on their own loop, never under a request
        of another loop's (a loop running elsewhere gets the close to run itself)."""
        with self._clients_lock:
            entries, self._clients = list(self._clients.items()), {}
        for loop, (_, lifetime) in entries:
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(lifetime.aclose(), loop)  # type: ignore[attr-defined]
            elif not loop.is_closed():
                try:
                    loop.run_until_complete(lifetime.aclose())  # type: ignore[attr-defined]
                except RuntimeError:  # another loop runs in this thread: the GC closes its sockets
                    pass

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        if not token_ids:
            raise ValueError("generate needs at least one prompt token")
        version = self.weight_version
        body = {"input_ids": list(token_ids), "sampling_params": sampling_dict(sampling), "return_logprob": True}
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(RETRIES):
            try:
                client = await self._async_client()
                response = await client.post("/generate", json=body, timeout=_timeout(deadline - time.monotonic()))
                break
            except httpx.TransportError as e:
                if not _retry(e, attempt, RETRIES, deadline):
                    raise self._failure("POST /generate", f"{type(e).__name__}: {e}") from None
                await asyncio.sleep(0.5 * 2**attempt)
        if response.status_code != 200:
            raise self._failure("POST /generate", f"HTTP {response.status_code}: {response.text.strip()[:300]}")
        completion, meta = self._parsed("POST /generate", response, lambda out: (
            to_completion(out, version, sampling.stop_token_ids), out["meta_info"]))
        for key, value in (("requests", 1), ("generated_tokens", len(completion.token_ids)),
                           ("prompt_tokens", meta.get("prompt_tokens") or 0),
                           ("cached_tokens", meta.get("cached_tokens") or 0)):
            self.stats[key] += int(value)
        return completion

    def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        check_score_args(token_ids, start, temperature)
        response = self._post("/generate", {"input_ids": list(token_ids), "sampling_params": {"max_new_tokens": 0},
                                            "return_logprob": True, "logprob_start_len": start - 1})
        return self._parsed("POST /generate", response, lambda out: prompt_logprobs(out, token_ids, start))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush_cache: bool = True) -> None:
        tensors = iter(named_tensors)
        first = next(tensors, None)
        if first is not None:
            on_cpu = not first[1].is_cuda
            tensors = _prepended(first, tensors)
            del first  # freed once sent, as every other tensor is
            loopback = urlparse(self.url).hostname in LOOPBACK
            if self.weight_transfer == "disk" or (self.weight_transfer == "auto" and loopback and on_cpu):
                self._update_from_disk(weight_buckets(tensors, self.update_bucket_bytes))
            else:
                # By value, the body carries the bucket's bytes once per rank: a bucket of
                # update_bucket_bytes / tp_size keeps each request within update_bucket_bytes.
                by_value = not loopback or on_cpu
                size = max(1, self.update_bucket_bytes // self.tp_size) if by_value else self.update_bucket_bytes
                for bucket in weight_buckets(tensors, size):
                    by_handle = loopback and all(t.is_cuda for _, t in bucket)
                    self._post("/update_weights_from_tensor", {"serialized_named_tensors": self._per_rank(
                        bucket, by_handle), "flush_cache": False})
        if flush_cache:
            self.flush_cache()
        self.weight_version = version

    def _per_rank(self, bucket: list[tuple[str, torch.Tensor]], by_handle: bool) -> list[str]:
        """One payload per tensor-parallel rank, each rank reading its own (SGLang's tp_worker).
        Handles are pickled once per rank, as SGLang's Engine does: a rank that opened another
        rank's copy of a CUDA IPC handle would upset the sender's count of who still uses the
        memory. Bytes by value are the same for every rank: pickled once."""
        if by_handle:
            return [serialize_bucket(bucket, by_handle=True) for _ in range(self.tp_size)]
        return [serialize_bucket(bucket, by_handle=False)] * self.tp_size

    def flush_cache(self) -> None:
        """Empty the prefix cache once the scheduler is idle (one loop after its last output)."""
        self._post("/flush_cache", params={"timeout": IDLE_TIMEOUT_S})

    def _update_from_disk(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
        """One safetensors shard per bucket in a fresh directory, loaded by the server in one call.

        The directory stays until the next update replaces it: SGLang keeps it as its model path.
        """
        directory = Path(tempfile.mkdtemp(prefix="agentrl-weights-"))
        # Tied tensors (one tensor, two names) in one shard are written once: safetensors refuses
        # shared memory. Across shards a tie is written under both names: a tensor seen in an earlier
        # bucket may be gone, and a fresh one (a merged LoRA weight, a gathered shard) may have
        # taken its address, so an address alone does not make a tie there.
        try:
            for i, bucket in enumerate(buckets):
                shard: dict[str, torch.Tensor] = {}
                seen: set[tuple] = set()
                for name, t in bucket:
                    key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
                    if key not in seen:
                        seen.add(key)
                        shard[name] = t.contiguous()
                if shard:
                    save_file(shard, str(directory / f"model-{i:05d}.safetensors"))
        except BaseException:  # a full disk, a failed gather: nothing was sent, nothing is kept
            shutil.rmtree(directory, ignore_errors=True)
            raise
        try:
            self._post("/update_weights_from_disk", {"model_path": str(directory), "flush_cache": False})
        finally:
            if self._weights_dir is not None:
                shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = directory

    def release_memory(self) -> None:
        regions = self._regions.to_release()
        info = self.server_info
        if regions and info.get("enable_memory_saver") is False and info.get("device", "cuda") != "cpu" \
                and not self._warned_no_saver:
            # SGLang answers the release with 200 and frees nothing. A warning, not an error: a
            # server given by URL may well run on GPUs of its own, where nothing needs releasing.
            self._warned_no_saver = True
            key = "engine.sglang.url" if self.process is None else "engine.sglang.extra_args.enable_memory_saver"
            print(f"agentrl: warning: the SGLang server at {self.shown} ({key}) runs without --enable-memory-saver, "
                  "so it keeps its GPU memory while the trainer runs; if it shares GPUs with the trainer, start "
                  "it with --enable-memory-saver", file=sys.stderr)
        if regions:  # not retried: SGLang refuses to release a region twice
            self.flush_cache()  # SGLang's scheduler dies on a release before it is idle
            self._post("/release_memory_occupation", {"tags": regions}, retries=1)
            self._regions.released.update(regions)

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        regions = self._regions.to_resume(tags)
        if regions:
            if urlparse(self.url).hostname in LOOPBACK:  # perhaps on this process's GPUs
                empty_torch_cache()
            self._post("/resume_memory_occupation", {"tags": regions}, retries=1)
            self._regions.released.difference_update(regions)

    def close(self) -> None:
        self._client.close()
        self._close_async_clients()
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
        if self.process is not None:
            stop_server(self.process)
