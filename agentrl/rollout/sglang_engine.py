"""The SGLang rollout engine: the Engine protocol over `sglang.Engine` in this process, or over HTTP.

Token ids in and out: SGLang runs with `skip_tokenizer_init`, so the episode loop's ids, masks and
logprobs are exactly what the engine sampled (stop tokens kept, one logprob per new id). SGLang also
stops at the model's own EOS ids, which the loop's stop ids normally include. The returned logprobs
are those of the temperature-scaled distribution (unscaled when greedy), as the trainer recomputes.

In process, sglang.Engine runs its scheduler as child processes and drives them from an asyncio
loop. That loop must outlive each rollout's own event loop and also serve the trainer's
synchronous calls (weight updates, memory release), so it runs in a daemon thread here, and the
Engine's synchronous methods are pointed at that thread. Weights go over in buckets of
`update_bucket_bytes` (as shared-memory or CUDA IPC handles, never pickled by value), then one
cache flush. Memory is released as SGLang's tagged regions; the driver takes back "weights" before
a weight update and "kv_cache" only after it.

Before the engine starts, and again once it runs, rollout.max_context_tokens is checked against the
longest prompt SGLang accepts (it aborts longer ones: an episode near the limit would end in an
error instead of finish "length").

This is the only module that imports sglang, always inside a function. The HTTP client is in
sglang_server.py and shares the request building and response parsing below. Neither is used by
the transformers engine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import uuid
from typing import Any, Coroutine, Iterable, Iterator

import torch

from agentrl.config import RecipeConfig, SGLangConfig
from agentrl.errors import ConfigError, Terminated
from agentrl.hardware import choose_dtype, cpu_bf16_support
from agentrl.models import local_model_path
from agentrl.rollout.engine import Engine
from agentrl.types import Completion, SamplingParams

MEMORY_TAGS = ("weights", "kv_cache")
IDLE_TIMEOUT_S = 60.0  # how long a flush may wait for SGLang's scheduler to finish its last batch
# SGLang's regions behind each tag; CUDA graphs are scratch like the KV cache and come back with it.
_SGLANG_REGIONS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
# SGLang's scheduler aborts a prompt of max_req_input_len = min(context_len - 1, max_total_tokens - 1) - 5
# tokens or more (tp_worker.get_worker_info), and an episode's prompt reaches max_context_tokens - 1.
CONTEXT_MARGIN = 6
# Where SGLang reads a model's context length (get_context_length), in its order.
_CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                        "max_position_embeddings")


def server_args(model_path: str, device: str, dtype: str, seed: int, s: SGLangConfig) -> dict[str, Any]:
    """sglang ServerArgs fields for an engine (in-process keywords, or `--flags` of launch_server)."""
    where = torch.device(device)
    cpu = where.type == "cpu"
    args: dict[str, Any] = {
        "model_path": model_path, "device": where.type, "dtype": dtype, "random_seed": seed,
        "tp_size": s.tp_size, "mem_fraction_static": s.mem_fraction, "skip_tokenizer_init": True,
        "enable_memory_saver": not cpu,  # GPU-only: on CPU the scheduler dies looking for libcuda
        "log_level": "warning"}
    if where.index is not None:  # cuda:1 → SGLang's first GPU is 1
        args["base_gpu_id"] = where.index
    if s.max_total_tokens is not None:
        args["max_total_tokens"] = s.max_total_tokens
    backend = s.attention_backend or ("torch_native" if cpu else None)
    if backend is not None:
        args["attention_backend"] = backend
    if cpu:
        args["disable_overlap_schedule"] = True  # overlap needs a device stream to hide the CPU work behind
    return {**args, **s.extra_args}


def sglang_uses_amx() -> bool:
    """Whether SGLang on this CPU computes with its AMX kernels: as SGLang decides it, where the CPU
    has AMX and the installed sgl_kernel is its CPU build (which has convert_weight_packed; the
    CUDA build of a GPU machine, whose CPU may have AMX too, has not)."""
    if not cpu_bf16_support()["amx"] or importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        import sgl_kernel  # noqa: F401 (registers its torch ops)
    except Exception:  # a broken build: SGLang then takes torch's ops, as it does on its own check
        return False
    return hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def check_cpu_engine(config: RecipeConfig, training: bool, amx: bool | None = None) -> None:
    """What SGLang cannot do on a CPU where it computes with its AMX kernels (`amx`: probed when
    None), as a ConfigError before it starts. Those kernels take bfloat16 only: its RMSNorm kernel
    has no float32 version, and a float32 engine's scheduler died at its first forward pass
    ("rmsnorm_kernel" not implemented for 'Float'). And SGLang packs its linear layers' weights
    for them as it loads the model, which its weight updates do not do again: an engine updated
    with its own weights, from tensors, answered garbage, and one updated from disk kept its
    linear layers as they were. So a training run, which syncs weights after every step, cannot
    use it there; rollouts and evaluations can."""
    if torch.device(config.engine.device).type != "cpu" or not (sglang_uses_amx() if amx is None else amx):
        return
    if config.model.dtype == "float32":
        raise ConfigError("model.dtype 'float32': SGLang on this CPU (it has AMX) computes with its AMX kernels, "
                          "which take bfloat16 only (its scheduler stops at the first float32 forward pass); set "
                          "model.dtype to bfloat16 or auto, or use engine.name hf")
    if training:
        raise ConfigError("engine.name 'sglang' on this CPU (it has AMX): SGLang packs its weights for its AMX "
                          "kernels when it loads the model, and its weight updates do not pack them again (an "
                          "engine updated with its own weights answered garbage), so a training run cannot sync "
                          "its weights to it; train with engine.name hf, or with SGLang on a GPU")


def engine_dtype(config: RecipeConfig) -> str:
    """The dtype SGLang runs the model in (model.dtype): bfloat16 where SGLang computes with its AMX
    kernels (check_cpu_engine; no probe for 'auto': float32 is no choice there), else model.dtype
    as the trainer resolves it."""
    if torch.device(config.engine.device).type == "cpu" and sglang_uses_amx():
        check_cpu_engine(config, training=False, amx=True)
        return "bfloat16"
    return choose_dtype(config.model.dtype, config.engine.device).dtype


def model_context_length(model_path: str) -> int | None:
    """The context length SGLang derives from the model's config (its get_context_length: the first
    length key, times a rope scaling factor unless the config gives the original length); None when
    the config cannot be read here (the engine's own limit is checked once it runs)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path).get_text_config()
    except (OSError, ValueError, KeyError):
        return None
    rope = getattr(config, "rope_scaling", None) or {}
    factor = 1 if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3" \
        else rope.get("factor", 1)
    for key in _CONTEXT_LENGTH_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(factor * value)
    return 2048  # SGLang's default when the config names none


def check_context(config: RecipeConfig, args: dict[str, Any]) -> None:
    """Before SGLang starts: rollout.max_context_tokens within what it serves with `args`, from its
    context_length (given in extra_args, or the model's) and max_total_tokens (when given)."""
    s = config.engine.sglang
    limits = []
    if args.get("context_length") is not None:
        limits.append((int(args["context_length"]), "engine.sglang.extra_args.context_length"))
    else:
        derived = model_context_length(args["model_path"])
        if derived is not None:
            limits.append((derived, f"the context length of model.path '{config.model.path}'"))
    if args.get("max_total_tokens") is not None:
        key = "engine.sglang.extra_args.max_total_tokens" if "max_total_tokens" in s.extra_args \
            else "engine.sglang.max_total_tokens"
        limits.append((int(args["max_total_tokens"]), key))
    if limits:
        tokens, source = min(limits)
        _check_prompt_limit(config, tokens - CONTEXT_MARGIN, f"{source} ({tokens}) - {CONTEXT_MARGIN}")


def check_served_context(config: RecipeConfig, max_req_input_len: int | None) -> None:
    """Once SGLang runs: rollout.max_context_tokens within the prompt limit its scheduler reports
    (its KV cache, sized from engine.sglang.mem_fraction, may hold fewer tokens than the context)."""
    if max_req_input_len is None:
        return
    s = config.engine.sglang
    sizes = f"the server's at engine.sglang.url '{s.url}'" if s.mode == "server" and s.url is not None \
        else "engine.sglang.mem_fraction or engine.sglang.max_total_tokens"
    _check_prompt_limit(config, int(max_req_input_len), f"the engine's max_req_input_len: the smaller of its context "
                        f"length and its KV-cache tokens ({sizes}), less 6")


def _check_prompt_limit(config: RecipeConfig, limit: int, why: str) -> None:
    n = config.rollout.max_context_tokens
    if n > limit:  # the episode's last prompts would end in SGLang's error instead of finish "length"
        raise ConfigError(f"rollout.max_context_tokens ({n}) is more than SGLang serves: it refuses a prompt of "
                          f"{limit} tokens or more ({why}), and an episode's prompt reaches "
                          f"rollout.max_context_tokens - 1; set rollout.max_context_tokens to {limit} or less")


def sampling_dict(sampling: SamplingParams) -> dict[str, Any]:
    """SGLang sampling_params; temperature 0 is greedy in SGLang too. SGLang samples with a request's
    seed only when it runs with enable_deterministic_inference (engine.sglang.extra_args)."""
    seed = {} if sampling.seed is None else {"sampling_seed": sampling.seed}
    return {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "stop_token_ids": list(sampling.stop_token_ids), **seed}


def to_completion(out: dict[str, Any], version: int, stop_token_ids: tuple[int, ...]) -> Completion:
    """A generate result (output_ids + meta_info) → Completion, checking that logprobs align.

    A turn whose last token is one of its stop ids finished "stop", whatever SGLang called it: older
    releases (their `Req.check_finished`) test the length budget before the stop tokens and report
    "length" for a turn whose end-of-turn token fell on its last allowed position, and the episode
    would then take a finished tool call for a cut-off one (a given server may be such a release)."""
    meta = out["meta_info"]
    reason = meta["finish_reason"] or {}
    if reason.get("type") not in ("stop", "length"):
        raise RuntimeError(f"SGLang ended the request with {reason!r}")
    ids = list(out["output_ids"])
    logprobs = meta["output_token_logprobs"]
    if [entry[1] for entry in logprobs] != ids:
        raise RuntimeError(f"SGLang returned {len(logprobs)} logprobs that do not match its {len(ids)} new ids")
    finish = "stop" if ids and ids[-1] in stop_token_ids else reason["type"]
    return Completion(ids, [float(entry[0]) for entry in logprobs], finish, version)


def prompt_logprobs(out: dict[str, Any], token_ids: list[int], start: int) -> list[float]:
    """input_token_logprobs of a request with logprob_start_len = start - 1, for token_ids[start:]."""
    entries = out["meta_info"]["input_token_logprobs"][-(len(token_ids) - start):]
    if [e[1] for e in entries] != token_ids[start:] or any(e[0] is None for e in entries):
        raise RuntimeError(f"SGLang returned no prompt logprobs for positions {start}..{len(token_ids) - 1}")
    return [float(e[0]) for e in entries]


def check_score_args(token_ids: list[int], start: int, temperature: float) -> None:
    if not 1 <= start < len(token_ids):
        raise ValueError(f"score: start must be in [1, {len(token_ids)}), got {start}")
    if temperature not in (0.0, 1.0):  # SGLang reports prompt logprobs of the unscaled distribution
        raise ValueError(f"score: the SGLang engine scores at temperature 1 (or 0) only, got {temperature}")


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most bucket_bytes (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += tensor.nbytes
    if bucket:
        yield bucket


class ReleasedRegions:
    """SGLang regions currently released. SGLang fails on resuming a region it never released."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def to_release(self) -> list[str]:
        return [r for tag in MEMORY_TAGS for r in _SGLANG_REGIONS[tag] if r not in self.released]

    def to_resume(self, tags: tuple[str, ...] | None) -> list[str]:
        unknown = set(tags or ()) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"resume_memory: unknown tags {sorted(unknown)}; expected {', '.join(MEMORY_TAGS)}")
        wanted = MEMORY_TAGS if tags is None else [t for t in MEMORY_TAGS if t in tags]
        return [r for tag in wanted for r in _SGLANG_REGIONS[tag] if r in self.released]


def empty_torch_cache() -> None:
    """Give the memory PyTorch's caching allocator holds but no tensor uses (the trainer's freed
    activations and gradients) back to the driver before SGLang maps its regions again: SGLang's
    allocations cannot use that cache, and a resume that runs out of memory kills its scheduler.
    Every device's cache, the engine's included; nothing when this process never used CUDA."""
    torch.cuda.empty_cache()


class _LoopThread:
    """An asyncio loop in a daemon thread; `run_until_complete` is what sglang.Engine calls on its loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-engine-loop", daemon=True)
        self.thread.start()

    def run_until_complete(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _shared(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor copied once into shared memory, so the trainer's own storage is never moved there."""
    if tensor.device.type != "cpu":
        return tensor.contiguous()  # CUDA tensors travel as IPC handles, without a copy
    out = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    return out.copy_(tensor)


def scheduler_failed(signum: int, frame: object) -> None:
    """sglang.Engine's SIGQUIT handler in this process. SGLang's scheduler and detokenizer processes
    send their parent SIGQUIT when they fail, and SGLang's own handler then SIGKILLs the parent with
    its children: a training run vanished at once, without an error line and without its clean-up
    (finished episodes, metrics, launched tool servers). Raised as Ctrl-C is (a KeyboardInterrupt,
    which no episode's or plug-in's error handling takes for its own failure), it ends the run the
    same way, and `close` then stops what is left of SGLang. Module level: ServerArgs, which holds
    it, is pickled for SGLang's child processes."""
    raise Terminated(signum, "SGLang's scheduler processes send it when one of them fails; "
                             "the log above says why")


class SGLangEngine:
    """sglang.Engine in this process (its scheduler in child processes) behind the Engine protocol."""

    def __init__(self, args: dict[str, Any], update_bucket_bytes: int = 512 * 2**20):
        if args.get("device") == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read when sglang is imported
        import sglang

        self.update_bucket_bytes = update_bucket_bytes
        self.weight_version = 0
        self.stats = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
        self._regions = ReleasedRegions()
        self._engine = sglang.Engine(**{"custom_sigquit_handler": scheduler_failed, **args})
        self._thread = _LoopThread()
        self._engine.loop = self._thread  # its synchronous calls now run on the thread's loop
        # The longest prompt the scheduler accepts (a longer one is aborted), as the scheduler reported it.
        self.max_req_input_len: int | None = getattr(self._engine.tokenizer_manager, "max_req_input_len", None)

    async def generate(self, token_ids: list[int], sampling: SamplingParams) -> Completion:
        if not token_ids:
            raise ValueError("generate needs at least one prompt token")
        version, rid = self.weight_version, uuid.uuid4().hex
        request = asyncio.run_coroutine_threadsafe(self._engine.async_generate(
            input_ids=list(token_ids), sampling_params=sampling_dict(sampling), return_logprob=True, rid=rid),
            self._thread.loop)
        try:  # shielded: cancelling SGLang's own task only forgets the request, the scheduler decodes on
            out = await asyncio.shield(asyncio.wrap_future(request))
        except asyncio.CancelledError:  # the caller left (an HTTP client hung up): stop its decoding
            self._thread.loop.call_soon_threadsafe(self._engine.tokenizer_manager.abort_request, rid)
            raise
        completion = to_completion(out, version, sampling.stop_token_ids)
        self._count(out["meta_info"], len(completion.token_ids))
        return completion

    async def _submit(self, coro: Coroutine) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._thread.loop))

    def _count(self, meta: dict[str, Any], new_tokens: int) -> None:
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += new_tokens
        self.stats["prompt_tokens"] += int(meta.get("prompt_tokens") or 0)
        self.stats["cached_tokens"] += int(meta.get("cached_tokens") or 0)

    def score(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(token t | tokens < t) for t ≥ start (SGLang's input_token_logprobs)."""
        check_score_args(token_ids, start, temperature)
        out = self._thread.run_until_complete(self._engine.async_generate(
            input_ids=list(token_ids), sampling_params={"max_new_tokens": 0}, return_logprob=True,
            logprob_start_len=start - 1))
        return prompt_logprobs(out, token_ids, start)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush_cache: bool = True) -> None:
        """Buckets through update_weights_from_tensor without flushing, then one flush."""
        for bucket in weight_buckets(named_tensors, self.update_bucket_bytes):
            ok, message = self._engine.update_weights_from_tensor(
                named_tensors=[(name, _shared(t)) for name, t in bucket], flush_cache=False)
            if not ok:
                raise RuntimeError(f"SGLang update_weights_from_tensor failed: {message}")
        if flush_cache:
            self.flush_cache()
        self.weight_version = version

    def flush_cache(self) -> None:
        """Empty the prefix cache once the scheduler is idle: it is so only one loop after its last
        output, so the flush waits for that (Engine.flush_cache would fail instead)."""
        result = self._thread.run_until_complete(
            self._engine.tokenizer_manager.flush_cache(timeout_s=IDLE_TIMEOUT_S))
        if not result.success:
            raise RuntimeError(f"SGLang flush_cache failed: {result.message or 'requests still running'}")

    def release_memory(self) -> None:
        regions = self._regions.to_release()
        if regions:
            self.flush_cache()  # SGLang's scheduler dies on a release before it is idle
            self._engine.release_memory_occupation(tags=regions)
            self._regions.released.update(regions)

    def resume_memory(self, tags: tuple[str, ...] | None = None) -> None:
        regions = self._regions.to_resume(tags)
        if regions:
            empty_torch_cache()
            self._engine.resume_memory_occupation(tags=regions)
            self._regions.released.difference_update(regions)

    def close(self) -> None:
        """Stop the scheduler processes (sglang kills every child process of this one) and the loop."""
        try:
            self._engine.shutdown()
        finally:
            self._thread.stop()


def build_sglang_engine(config: RecipeConfig) -> Engine:
    """The SGLang engine a recipe asks for: in this process, or a server (given or launched)."""
    s = config.engine.sglang
    launched = s.mode == "in_process" or s.url is None  # a given server runs with its own arguments
    if launched and importlib.util.find_spec("sglang") is None:
        raise ConfigError("engine.name 'sglang': SGLang is not installed here (on GPUs: pip install "
                          "\"agentrl[sglang]\"; on CPU: the environment `make test-sglang` builds)")
    dtype = engine_dtype(config) if launched else choose_dtype(config.model.dtype, config.engine.device).dtype
    args = server_args(local_model_path(config.model.path), config.engine.device, dtype, config.engine.seed, s)
    if launched:  # a given server's are checked at connect
        if args["dtype"] in ("float32", "float") and dtype == "bfloat16" and torch.device(
                config.engine.device).type == "cpu" and sglang_uses_amx():  # extra_args has the last word
            raise ConfigError(f"engine.sglang.extra_args.dtype '{args['dtype']}': SGLang on this CPU (it has AMX) "
                              "computes with its AMX kernels, which take bfloat16 only")
        check_context(config, args)  # before the engine starts, as far as its arguments tell
    engine: SGLangEngine | Any
    if s.mode == "server":
        from agentrl.rollout.sglang_server import SGLangServerEngine

        engine = SGLangServerEngine(s.url, args, s.update_bucket_bytes, s.timeout_s)
    else:
        engine = SGLangEngine(args, s.update_bucket_bytes)
    try:
        check_served_context(config, engine.max_req_input_len)
    except ConfigError:
        engine.close()
        raise
    return engine
