"""The colocated design on one GPU, measured in one run: the transformers engine and the trainer
sharing the device, with a Qwen2-style model of about 0.4B parameters built from its config
(random weights, seeded: no download) and the SmolLM2 tokenizer.

  release   the engine's bytes (weights in torch-memory-saver's "weights" region plus its KV-cache
            pool, read as the driver's free memory: torch's own counters cannot see an unmapped
            region) before and after `release_memory`, then greedy output after resuming the
            weights and, separately, the KV cache, against the output before: identical, token for
            token;
  sync      seconds of the local backend's weight sync (PolicyWorker.push_weights through LocalSink
            into the rollout worker's engine, in `--bucket-mb` buckets, then one flush) as GB/s of the bytes sent, against a
            device-to-device copy of the same bytes in one flat tensor;
  train     tokens/s of PolicyWorker.update in bf16 autocast on sequences whose first quarter is
            a masked prompt, each with its own prompt (no group shares one, so no prompt is
            computed once for several), and the MFU it implies, counted as PaLM's appendix does:
            6 x parameters + 12 x layers x hidden x length FLOPs per token (forward and backward;
            the output head counted at every position, attention over the whole length), against
            the device's dense bf16 peak (--peak-tflops).
Each timed figure is the median of --repeats after one warm-up.

On a CPU (--device cpu, for a quick check of the script with --layers 2) the memory saver is a
no-op: the release line then says so instead of a ratio.

On the GPU machine, which has torch and transformers but none of the rest: carry `make
gpu-wheels` (build/gpu-wheels, the packages agentrl imports here, torch-memory-saver among them)
and the tokenizer (build/gpu-tokenizer), then run
  python3 -m pip install -q --no-index --no-deps build/gpu-wheels/*.whl &&
  PYTHONPATH=. python3 bench/gpu_colocated.py --tokenizer build/gpu-tokenizer

Run: python bench/gpu_colocated.py [--device cuda] [--tokenizer DIR] [--layers 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

HIDDEN = 896  # Qwen2.5-0.5B's
PROMPTS = ["What is 1234 * 5678?", "Name three prime numbers above 100.", "How many days are in a leap year?",
           "Spell 'agent' backwards.", "What is the capital of France?", "Add 17 and 25.",
           "Is 221 a prime number?", "Convert 3 km to metres."]


def qwen2_model(vocab: int, layers: int, seed: int = 0) -> torch.nn.Module:
    """Qwen2.5-0.5B's shape (hidden 896, 14 heads over 2 key/value heads, MLP 4864, tied embeddings)
    with the tokenizer's vocabulary and `layers` layers, weights drawn from `seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, rope_theta=1_000_000.0)
    return Qwen2ForCausalLM(config)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_bytes(device: str) -> int | None:
    return torch.cuda.mem_get_info()[0] if device.startswith("cuda") else None


def timed(fn, device: str, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls, after one untimed."""
    seconds = []
    for _ in range(1 + repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def copy_seconds(size: int, device: str, repeats: int) -> float:
    """Median seconds of a device-to-device copy of `size` bytes in one flat tensor."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return timed(lambda: target.copy_(source), device, repeats)


def training_batch(vocab: int, sequences: int, length: int, seed: int = 0):
    """(sequences, masks, advantages): a quarter prompt (masked), the rest completion, one
    advantage per sequence; token ids at random (speed does not depend on which)."""
    rng = random.Random(seed)
    prompt = length // 4
    batch = ([], [], [])
    for _ in range(sequences):
        advantage = rng.gauss(0.0, 1.0)
        batch[0].append([rng.randrange(vocab) for _ in range(length)])
        batch[1].append([0] * prompt + [1] * (length - prompt))
        batch[2].append([0.0] * prompt + [advantage] * (length - prompt))
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct", help="a tokenizer directory or builtin")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--sequences", type=int, default=32, help="training sequences per update")
    parser.add_argument("--length", type=int, default=1024, help="tokens per training sequence")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    args = parser.parse_args()

    from agentrl.models import load_tokenizer
    from agentrl.recipe import load_recipe
    from agentrl.rollout.worker import LocalSink, RolloutWorker
    from agentrl.trainer.roles import make_policy
    from agentrl.types import SamplingParams

    device = args.device
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"device: {name}, torch {torch.__version__}")
    tokenizer = load_tokenizer(args.tokenizer, chat_template="hermes")
    with tempfile.TemporaryDirectory() as model_dir:
        model = qwen2_model(len(tokenizer), args.layers)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
        print(f"model: Qwen2-style, {args.layers} layers, {params / 1e9:.3f}B parameters (random, seed 0)")
        config = load_recipe(None, [f"model.path={model_dir}", f"engine.device={device}", f"trainer.device={device}",
                                    "model.dtype=bfloat16", "trainer.dtype=bfloat16",
                                    f"trainer.micro_batch_tokens={args.length * 4}"])
        pad_id = tokenizer.pad_token_id

        # release
        if device.startswith("cuda"):
            # The CUDA context and cuBLAS's workspaces first: they are outside the engine's regions
            # (memory_saver.warm_cublas), and no release could free them.
            from agentrl.rollout.memory_saver import warm_cublas

            warm_cublas(torch.device(device))
        synchronize(device)
        free_start = free_bytes(device)
        worker = RolloutWorker(config)  # the local backend's: the engine, the recipe's tools around it
        engine = worker.engine
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 return_dict=True)["input_ids"] for p in PROMPTS]
        greedy = [SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)] * len(prompts)
        before = [c.token_ids for c in engine.generate_batch(prompts, greedy)]
        synchronize(device)
        if engine.memory_saver.enabled:
            engine_bytes = free_start - free_bytes(device)
            held = free_bytes(device)
            engine.release_memory()
            freed = free_bytes(device) - held
            print(f"release: engine {engine_bytes / 2**30:.2f} GiB, freed {freed / 2**30:.2f} GiB "
                  f"({freed / engine_bytes:.1%}; at least 90% wanted)")
        else:
            engine.release_memory()
            print(f"release: no memory saver on {device} (torch-memory-saver is not installed, or this is not "
                  "CUDA): nothing to free")
        engine.resume_memory(("weights",))
        engine.resume_memory(("kv_cache",))
        after = [c.token_ids for c in engine.generate_batch(prompts, greedy)]
        same = sum(a == b for a, b in zip(after, before))
        print(f"greedy after resume: {same}/{len(prompts)} prompts token for token the same")

        # sync
        policy = make_policy(config, pad_id)
        sent = sum(t.nbytes for _, t in policy.named_weights())
        sink, bucket = LocalSink([worker]), args.bucket_mb << 20
        sync_s = timed(lambda: policy.push_weights(sink, engine.weight_version + 1, bucket), device, args.repeats)
        copy_s = copy_seconds(sent, device, args.repeats)
        print(f"sync: {sent / 2**20:.0f} MiB in {sync_s * 1e3:.1f} ms = {sent / sync_s / 1e9:.2f} GB/s; "
              f"device copy {copy_s * 1e3:.2f} ms = {sent / copy_s / 1e9:.1f} GB/s; sync/copy {sync_s / copy_s:.1f}x")

        # train
        engine.release_memory()  # as the training step runs it
        sequences, masks, advantages = training_batch(len(tokenizer), args.sequences, args.length)
        update_s = timed(lambda: policy.update(sequences, masks, advantages), device, args.repeats)
        tokens = args.sequences * args.length
        flops_per_token = 6 * params + 12 * args.layers * HIDDEN * args.length
        achieved = tokens / update_s * flops_per_token
        mfu = f", MFU {achieved / (args.peak_tflops * 1e12):.1%} of {args.peak_tflops:g} TFLOP/s" \
            if device.startswith("cuda") else ""
        print(f"train: {tokens} tokens per update in {update_s:.2f} s = {tokens / update_s:,.0f} tokens/s, "
              f"{achieved / 1e12:.1f} TFLOP/s{mfu}")
        if device.startswith("cuda"):
            print(f"peak memory allocated by torch: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
