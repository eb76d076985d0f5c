"""The in-process SGLang engine against real SGLang on CPU (SmolLM2-135M, float32 or, on a CPU with
AMX, bfloat16 (episodes.DTYPE), torch_native attention).

Exact ids and masks of three-turn tool episodes (equal to the transformers engine's, token for
token), the prefix cache across turns, throughput of the episode loop, release/resume, and the
engine's logprobs equal to the trainer's after a weight sync. Tests share one engine and run in
file order; the last one changes its weights.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agentrl.models import load_model
from agentrl.rollout.collect import collect
from agentrl.rollout.hf_engine import HFEngine
from agentrl.tools.builtin.calculator import calculator
from agentrl.trainer.policy import PolicyWorker
from agentrl.types import SamplingParams
from tests.real_sglang.episodes import (AMX, DTYPE, MORE_QUESTIONS, LOGPROB_TOLERANCE, REAL_SGLANG, SYNCS_WEIGHTS,
                                        THREE_TURN_QUESTIONS, gap_to_the_transformers_engine, make_runner, record,
                                        smollm2_args, tool_tasks, turn_spans)

pytestmark = REAL_SGLANG


@pytest.fixture(scope="module")
def engine():
    from agentrl.rollout.sglang_engine import SGLangEngine

    started = time.perf_counter()
    sglang_engine = SGLangEngine(smollm2_args(), update_bucket_bytes=128 * 2**20)
    record(engine_start_s=round(time.perf_counter() - started, 1))
    yield sglang_engine
    sglang_engine.close()


@pytest.fixture(scope="module")
def hf_engine(tokenizer):
    return HFEngine(load_model("smollm2-135m-instruct", DTYPE), pad_token_id=tokenizer.pad_token_id)


def test_three_turn_tool_episodes_match_the_transformers_engines(engine, hf_engine, tokenizer):
    for task in tool_tasks(THREE_TURN_QUESTIONS):  # one at a time: batch composition cannot matter
        engine.flush_cache()  # each episode starts cold, so the cache counts below are its own
        before = dict(engine.stats)
        traj = asyncio.run(make_runner(engine, tokenizer).run(task, "g"))
        assert traj.error is None and traj.metrics["turns"] == 3 and traj.metrics["tool_calls"] == 1, traj.messages
        assert [m["role"] for m in traj.messages[-5:]] == ["assistant", "tool", "assistant", "user", "assistant"]
        gap = gap_to_the_transformers_engine(traj, task, hf_engine, tokenizer)
        assert gap < LOGPROB_TOLERANCE
        rendered = tokenizer.apply_chat_template(traj.messages, tools=[calculator.schema], tokenize=False)
        assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) + "\n" == rendered
        # Each later turn's prompt is the previous turn's prompt and output (its last token's KV
        # is never computed) plus new tokens: SGLang's radix cache serves exactly that prefix.
        spans = turn_spans(traj.loss_mask)
        reusable = sum(end - 1 for _, end in spans[:-1])
        prompts = sum(start for start, _ in spans)
        cached = engine.stats["cached_tokens"] - before["cached_tokens"]
        assert engine.stats["prompt_tokens"] - before["prompt_tokens"] == prompts
        assert cached == reusable, (cached, reusable)
    record(three_turn_prompt_tokens=prompts, three_turn_cached_tokens=cached,
           three_turn_cached_share=round(cached / prompts, 3), episode_logprob_gap_max=gap)


def test_episode_loop_throughput_against_the_transformers_engine(engine, hf_engine, tokenizer):
    tasks = tool_tasks(THREE_TURN_QUESTIONS + MORE_QUESTIONS)
    figures = {}
    for name, eng in (("hf", hf_engine), ("sglang", engine)):
        torch.manual_seed(0)
        started = time.perf_counter()
        trajectories = asyncio.run(collect(make_runner(eng, tokenizer, temperature=1.0), tasks, 2, 64))
        wall = time.perf_counter() - started
        tokens = sum(t.num_generated for t in trajectories)
        assert len(trajectories) == 12 and all(t.error is None for t in trajectories)
        for t in trajectories:
            assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
            assert all(lp < 0 if m else lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask))
        figures |= {f"loop_{name}_tokens": tokens, f"loop_{name}_wall_s": round(wall, 1),
                    f"loop_{name}_tok_per_s": round(tokens / wall, 1)}
    record(**figures)


@SYNCS_WEIGHTS
def test_release_and_resume_keep_greedy_output_identical(engine, hf_engine, tokenizer):
    runner = make_runner(engine, tokenizer)
    prompt = runner.renderer.prompt_ids(tool_tasks(MORE_QUESTIONS)[0].messages())
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=runner.stop_ids)
    before = asyncio.run(engine.generate(prompt, greedy))
    engine.release_memory()
    engine.release_memory()  # a second release has nothing left to release
    engine.resume_memory(("weights",))
    weights = hf_engine.model.state_dict()  # the same weights, reloaded
    started = time.perf_counter()
    engine.update_weights(weights.items(), version=1)
    sync_s = time.perf_counter() - started
    engine.resume_memory(("kv_cache",))
    assert engine._regions.released == set()
    after = asyncio.run(engine.generate(prompt, greedy))
    assert after.token_ids == before.token_ids and after.weight_version == 1 and before.weight_version == 0
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(before.logprobs), atol=1e-5, rtol=0)
    record(sync_s_in_process=round(sync_s, 2))


@pytest.mark.skipif(not AMX, reason="about SGLang's AMX kernels: this CPU has no AMX")
def test_with_amx_release_and_resume_keep_greedy_output_and_an_update_with_its_own_weights_breaks_it(
        engine, hf_engine, tokenizer):
    """Why agentrl trains with no SGLang engine on a CPU with AMX (sglang_engine.check_cpu_engine):
    SGLang packs its linear weights for its AMX kernels at load, and update_weights_from_tensor
    writes unpacked tensors over them without packing them again. Should SGLang repack, this fails,
    and the check can go. Runs last but one: the engine is broken after it."""
    runner = make_runner(engine, tokenizer)
    prompt = runner.renderer.prompt_ids(tool_tasks(MORE_QUESTIONS)[0].messages())
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=runner.stop_ids)
    before = asyncio.run(engine.generate(prompt, greedy))
    engine.release_memory()
    engine.resume_memory()
    assert asyncio.run(engine.generate(prompt, greedy)).token_ids == before.token_ids
    engine.update_weights(hf_engine.model.state_dict().items(), version=1)  # the weights it already has
    after = asyncio.run(engine.generate(prompt, greedy))
    assert after.token_ids[:4] != before.token_ids[:4]
    scored = torch.tensor(hf_engine.score(prompt + after.token_ids, len(prompt)))
    assert scored.mean() < -3  # tokens the model itself finds unlikely: garbage
    record(amx_update_own_weights_scored_mean=scored.mean().item())


def test_a_cancelled_caller_stops_its_request_in_the_scheduler(engine, tokenizer):
    """A client that hangs up cancels generate, and the engine aborts the request by its rid.
    Without the abort, cancelling SGLang's own task only forgets the request while the scheduler
    keeps decoding it: the flush after the cancel (it waits for an idle scheduler, as the flush
    before a release or a weight update does) took 3.8 s here without the abort and 0.8 s with it."""
    runner = make_runner(engine, tokenizer)
    prompt = runner.renderer.prompt_ids(tool_tasks(MORE_QUESTIONS)[0].messages())
    endless = SamplingParams(max_new_tokens=4000, temperature=0.0, stop_token_ids=())

    async def cancel_after_a_second():
        request = asyncio.ensure_future(engine.generate(prompt, endless))
        await asyncio.sleep(1.0)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(cancel_after_a_second())
    started = time.perf_counter()
    engine.flush_cache()
    assert time.perf_counter() - started < 2.0


@SYNCS_WEIGHTS
def test_engine_logprobs_equal_the_trainers_after_a_weight_sync(engine, tokenizer):
    runner = make_runner(engine, tokenizer)
    prompt = runner.renderer.prompt_ids(tool_tasks(MORE_QUESTIONS)[1].messages())
    completion = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=1.0)))
    sequence, mask = prompt + completion.token_ids, [0] * len(prompt) + [1] * len(completion.token_ids)
    policy = PolicyWorker(load_model("smollm2-135m-instruct", "float32"), tokenizer.pad_token_id, lr=1e-4,
                          temperature=1.0)

    def trainer_logprobs() -> torch.Tensor:
        return torch.tensor(policy.logprobs([sequence], [mask])[0][len(prompt):])

    sampled = torch.tensor(completion.logprobs)
    assert (sampled - trainer_logprobs()).abs().max() < LOGPROB_TOLERANCE  # what the rollout records
    policy.update([sequence], [mask], [[float(m) for m in mask]])
    trained = trainer_logprobs()
    stale = torch.tensor(engine.score(sequence, len(prompt)))
    assert (stale - trained).abs().max() > 1e-2  # the update moved the policy away from the engine
    engine.release_memory()
    engine.resume_memory(("weights",))
    started = time.perf_counter()
    engine.update_weights(policy.named_weights(), version=2)
    sync_s = time.perf_counter() - started
    engine.resume_memory(("kv_cache",))
    synced = torch.tensor(engine.score(sequence, len(prompt)))
    gap = (synced - trained).abs()
    assert gap.max() < LOGPROB_TOLERANCE, gap
    after = asyncio.run(engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=1.0)))
    recomputed = policy.logprobs([prompt + after.token_ids], [[0] * len(prompt) + [1] * len(after.token_ids)])[0]
    sample_gap = (torch.tensor(after.logprobs) - torch.tensor(recomputed[len(prompt):])).abs()
    assert after.weight_version == 2 and sample_gap.max() < LOGPROB_TOLERANCE
    record(sync_s_after_update=round(sync_s, 2), score_gap_mean=gap.mean().item(), score_gap_max=gap.max().item(),
           sampled_gap_mean=sample_gap.mean().item(), sampled_gap_max=sample_gap.max().item())
    with pytest.raises(ValueError, match=r"scores at temperature 1 \(or 0\) only, got 0.7"):
        engine.score(sequence, len(prompt), temperature=0.7)
