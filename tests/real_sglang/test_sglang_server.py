"""The SGLang engine over HTTP, against a real `sglang.launch_server` started on 127.0.0.1.

A greedy tool episode equal to the transformers engine's; new weights through safetensors shards
(the loopback CPU path) that change the output, with the server's logprobs equal to the trainer's,
and the old weights sent back by value (the path to a server on another host) giving the old output
back; memory release/resume over HTTP; and a dead server reported with its URL instead of a hang.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agentrl.models import load_model
from agentrl.rollout.hf_engine import HFEngine
from agentrl.trainer.policy import PolicyWorker
from agentrl.types import SamplingParams
from tests.real_sglang.episodes import (DTYPE, LOGPROB_TOLERANCE, MORE_QUESTIONS, REAL_SGLANG, SYNCS_WEIGHTS,
                                        THREE_TURN_QUESTIONS, gap_to_the_transformers_engine, make_runner, record,
                                        smollm2_args, tool_tasks)

pytestmark = REAL_SGLANG


@pytest.fixture(scope="module")
def server():
    from agentrl.rollout.sglang_server import SGLangServerEngine

    started = time.perf_counter()
    engine = SGLangServerEngine(None, smollm2_args(), update_bucket_bytes=128 * 2**20, timeout_s=600)
    record(server_start_s=round(time.perf_counter() - started, 1))
    yield engine
    engine.close()


def test_launched_server_runs_the_episode_the_transformers_engine_runs(server, tokenizer):
    assert server.url.startswith("http://127.0.0.1:") and server.process.poll() is None
    task = tool_tasks(THREE_TURN_QUESTIONS[:1])[0]
    hf = HFEngine(load_model("smollm2-135m-instruct", DTYPE), pad_token_id=tokenizer.pad_token_id)
    traj = asyncio.run(make_runner(server, tokenizer).run(task, "g"))
    assert traj.error is None and traj.metrics["turns"] == 3 and traj.metrics["tool_calls"] == 1
    assert gap_to_the_transformers_engine(traj, task, hf, tokenizer) < LOGPROB_TOLERANCE
    assert server.stats["cached_tokens"] > 0  # turns 2 and 3 reuse the prefix


@SYNCS_WEIGHTS
def test_new_weights_change_the_output_and_old_ones_sent_by_value_restore_it(server, tokenizer):
    runner = make_runner(server, tokenizer)
    prompt = runner.renderer.prompt_ids(tool_tasks(MORE_QUESTIONS)[0].messages())
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=runner.stop_ids)
    before = asyncio.run(server.generate(prompt, greedy))
    policy = PolicyWorker(load_model("smollm2-135m-instruct", "float32"), tokenizer.pad_token_id, lr=1e-4,
                          temperature=1.0)
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    with torch.no_grad():  # a different policy: every weight scaled by 1.05
        for param in policy.model.parameters():
            param.mul_(1.05)
    server.release_memory()
    server.resume_memory(("weights",))
    started = time.perf_counter()
    server.update_weights(policy.named_weights(), version=1)
    sync_s = time.perf_counter() - started
    server.resume_memory(("kv_cache",))
    changed = asyncio.run(server.generate(prompt, greedy))
    assert changed.token_ids != before.token_ids and changed.weight_version == 1
    sequence = prompt + changed.token_ids
    trainer = torch.tensor(policy.logprobs([sequence], [[0] * len(prompt) + [1] * len(changed.token_ids)])[0][len(prompt):])
    gap = (torch.tensor(server.score(sequence, len(prompt))) - trainer).abs()
    assert gap.max() < LOGPROB_TOLERANCE
    server.weight_transfer = "tensor"  # by value, as to a server on another host
    started = time.perf_counter()
    server.update_weights(original.items(), version=2)
    by_value_s = time.perf_counter() - started
    restored = asyncio.run(server.generate(prompt, greedy))
    assert restored.token_ids == before.token_ids and restored.weight_version == 2
    torch.testing.assert_close(torch.tensor(restored.logprobs), torch.tensor(before.logprobs), atol=1e-5, rtol=0)
    record(sync_s_server_disk=round(sync_s, 2), sync_s_server_by_value=round(by_value_s, 2),
           server_score_gap_max=gap.max().item())


def test_a_dead_server_is_an_error_naming_its_url(server, tokenizer):
    from agentrl.rollout.sglang_launch import stop_server

    stop_server(server.process)
    started = time.perf_counter()
    with pytest.raises(RuntimeError) as failure:
        asyncio.run(server.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
    message = str(failure.value)
    assert message.startswith(f"SGLang server at {server.url}: POST /generate failed (ConnectError")
    assert f"the server exited with code {server.process.returncode}, log {server.log_path}" in message
    assert time.perf_counter() - started < 10  # three attempts with backoff, then the error
    with pytest.raises(RuntimeError, match=r"GET /health_generate failed \(ConnectError"):
        server.check_health()
