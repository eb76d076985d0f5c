"""KV reuse across turns in the transformers engine: same tokens as without it, fewer prefilled.

Every comparison runs the same model twice, once with the prefix cache and once with it off
(`kv_cache_bytes=0`), greedy in float32: token ids must be equal and logprobs equal to 1e-5 (a key
at a wrong position or a wrongly masked column would move them far more).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import MistralConfig

from agentrl.data import arithmetic_tasks
from agentrl.env.interaction import Turn
from agentrl.rollout.chat import ChatRenderer, stop_token_ids
from agentrl.rollout.collect import collect
from agentrl.rollout.episode import EpisodeRunner, EpisodeSettings
from agentrl.rollout.hf_engine import DEFAULT_KV_CACHE_BYTES, HFEngine
from agentrl.errors import ConfigError
from agentrl.models import plain_attention_layers
from agentrl.recipe import load_recipe
from agentrl.rollout.run import load_policy
from agentrl.rollout.kv_cache import MIN_SHARED_TOKENS, CacheEntry, Hit, PrefixKVCache, split_copies, split_point
from agentrl.rollout.running_batch import Row
from agentrl.tools.builtin.calculator import calculator
from agentrl.tools.parsers import parse_hermes
from agentrl.trainer.sft import conversation_sample, sft_train
from agentrl.types import Completion, SamplingParams
from tests.conftest import make_tiny_llama

QUESTIONS = ["What is 12 * 34?", "A farmer has 3 rows of 17 trees. How many trees?", "Add 5 and 9.",
             "What is 2 to the power of 10, minus 1000?"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def tool_turns(engine: HFEngine, tokenizer, questions: list[str], turns: int = 3,
               new_tokens: int = 12) -> list[list[int]]:
    """`turns` assistant turns per question, all questions batched together. A random model does not
    write tool calls, so after each sampled turn the test closes it with <|im_end|> and appends the
    template's tool turn holding the real calculator's output, as the episode loop would."""
    renderer = ChatRenderer(tokenizer, [calculator])
    histories = [[{"role": "user", "content": q}] for q in questions]
    ids = [renderer.prompt_ids(h) for h in histories]
    for turn in range(turns):
        completions = engine.generate_batch(ids, [greedy(new_tokens)] * len(ids))
        for row, completion in enumerate(completions):
            ids[row] = ids[row] + completion.token_ids + [tokenizer.eos_token_id]
            histories[row].append({"role": "assistant", "content": renderer.decode(completion.token_ids)})
            if turn < turns - 1:
                tool = {"role": "tool", "name": "calculator", "content": calculator(f"{row + 2} * {turn + 7}")}
                suffix, _ = renderer.suffix_ids(ids[row], histories[row], [tool])
                histories[row].append(tool)
                ids[row] = ids[row] + suffix
    return ids


def test_three_tool_turns_match_no_reuse_with_mixed_cached_lengths(tiny_model, tokenizer):
    reuse, plain = HFEngine(tiny_model, pad_token_id=2), HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=0)
    # Questions of different lengths: every batch after the first mixes rows with different cached lengths.
    assert tool_turns(reuse, tokenizer, QUESTIONS) == tool_turns(plain, tokenizer, QUESTIONS)
    assert plain.stats["cached_tokens"] == 0 and reuse.stats["cached_tokens"] > 0
    assert reuse.stats["prefill_tokens"] + reuse.stats["cached_tokens"] == plain.stats["prefill_tokens"]
    assert len(reuse.prefix_cache) == len(QUESTIONS)  # each turn's entry replaced the one it extended


def test_a_batch_of_misses_partial_and_full_hits_matches_no_reuse(tiny_model):
    reuse, plain = HFEngine(tiny_model, pad_token_id=2), HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=0)
    first = [1, 504, 3459, 30, 2, 9690, 28, 30, 253]
    done = reuse.generate_batch([first], [greedy(8)])[0].token_ids
    extended = first + done + [11, 12]  # the next turn: the cached entry is a prefix
    sibling = first[:5] + [77, 78]  # shares only five tokens with it: not reused (timing decides if it exists)
    repeat = first + done[:-1]  # exactly the cached entry: all but its last token are reused
    fresh = [7, 33, 44]  # nothing in common
    prompts = [extended, sibling, repeat, fresh]
    before = dict(reuse.stats)
    got = reuse.generate_batch(prompts, [greedy(10)] * 4)
    want = plain.generate_batch(prompts, [greedy(10)] * 4)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
    cached = len(first) + len(done) - 1
    assert reuse.stats["cached_tokens"] - before["cached_tokens"] == cached + (len(repeat) - 1)
    # The misses compute all but their last token alone first (6 and 2), then each row its last one.
    assert reuse.stats["prefill_tokens"] - before["prefill_tokens"] == 3 + (6 + 1) + 1 + (2 + 1)


def test_a_shared_prompt_is_computed_once_and_the_same_whether_requests_come_together_or_apart(tiny_model):
    """A GRPO group's requests share their prompt: it is computed once, and every request sees the
    same numbers whether its siblings arrived in the same batch, earlier, or not at all."""
    prompt = [1, 504, 3459, 30, 2, 9690, 28, 30, 253, 77, 91, 5]
    together = HFEngine(tiny_model, pad_token_id=2)
    batch = together.generate_batch([prompt] * 3, [greedy(6)] * 3)
    # The prefix once, then the last token once: the other two rows join as copies of the first.
    assert together.stats["prefill_tokens"] == len(prompt) and together.stats["copied_requests"] == 2
    assert together.stats["cached_tokens"] == 2 * len(prompt)
    apart = HFEngine(tiny_model, pad_token_id=2)
    one_by_one = [apart.generate_batch([prompt], [greedy(6)])[0] for _ in range(3)]
    assert apart.stats["prefill_tokens"] == len(prompt) - 1 + 3
    alone = HFEngine(tiny_model, pad_token_id=2).generate_batch([prompt], [greedy(6)])[0]
    for completion in one_by_one:  # a sibling's stored prompt gives exactly what computing it would
        assert completion.token_ids == alone.token_ids and completion.logprobs == alone.logprobs  # bit for bit
    for completion in batch:  # decoded three rows at a time: only the batch shape changes the rounding
        assert completion.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_prompts_opening_with_the_same_message_compute_it_once_and_the_same(tiny_model, tokenizer):
    """Different tasks share their first message (system prompt and tool schemas): the engine
    computes it in a pass of its own, keeps it, and a later prompt starting with it computes only
    the rest, getting bit for bit what computing the message itself gives."""
    renderer = ChatRenderer(tokenizer, [calculator])
    system = {"role": "system", "content": "Solve the problem. Use the calculator tool for arithmetic."}
    prompts = [renderer.prompt_ids([system, {"role": "user", "content": q}]) for q in QUESTIONS]
    ends = stop_token_ids(tokenizer)
    split = prompts[0].index(tokenizer.eos_token_id) + 1  # just after the system message's <|im_end|>
    assert split >= MIN_SHARED_TOKENS and all(p[:split] == prompts[0][:split] for p in prompts)
    assert prompts[0][split:] != prompts[1][split:]

    def alone(prompt: list[int]) -> Completion:
        return HFEngine(tiny_model, pad_token_id=2, message_end_ids=ends).generate_batch([prompt], [greedy(8)])[0]

    shared = HFEngine(tiny_model, pad_token_id=2, message_end_ids=ends)
    first = shared.generate_batch([prompts[0]], [greedy(8)])[0]
    assert shared.stats["prefill_tokens"] == len(prompts[0])  # the message, the rest, then the last token
    for prompt in prompts[1:]:
        before = dict(shared.stats)
        got = shared.generate_batch([prompt], [greedy(8)])[0]
        assert shared.stats["cached_tokens"] - before["cached_tokens"] == split
        assert shared.stats["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - split
        want = alone(prompt)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs  # bit for bit
    entries = list(shared.prefix_cache._entries.values())
    assert [len(e.ids_T) for e in entries if e.shared] == [split]
    # Without message ends nothing is shared across tasks; splitting moves no logprob beyond rounding.
    unsplit = HFEngine(tiny_model, pad_token_id=2)
    whole = unsplit.generate_batch([prompts[0]], [greedy(8)])[0]
    assert whole.token_ids == first.token_ids
    torch.testing.assert_close(torch.tensor(whole.logprobs), torch.tensor(first.logprobs), atol=1e-5, rtol=0)
    before = dict(unsplit.stats)
    unsplit.generate_batch([prompts[1]], [greedy(8)])
    assert unsplit.stats["cached_tokens"] == before["cached_tokens"]
    # Arriving together, the first prompt computes the message and the others load it at once.
    together = HFEngine(tiny_model, pad_token_id=2, message_end_ids=ends)
    together.generate_batch(prompts, [greedy(8)] * len(prompts))
    assert together.stats["prefill_tokens"] == sum(len(p) for p in prompts) - split * (len(prompts) - 1)
    # A budget that keeps the message but not a whole prompt: the row computes everything when it
    # joins, and the counts say so (nothing reused, every token prefilled once).
    message_bytes = next(e.nbytes for e in entries if e.shared)
    tight = HFEngine(tiny_model, pad_token_id=2, message_end_ids=ends, kv_cache_bytes=message_bytes)
    got = tight.generate_batch([prompts[1]], [greedy(8)])[0]
    assert tight.stats["cached_tokens"] == 0 and tight.stats["prefill_tokens"] == len(prompts[1])
    assert got.token_ids == alone(prompts[1]).token_ids


def test_the_recipe_engine_splits_at_the_tokenizer_message_ends(tiny_model_dir):
    """The engine the CLI, the trainer and the server build knows where the template ends a
    message (ChatML's <|im_end|>), so their prompts share the first message."""
    tokenizer, engine = load_policy(load_recipe(None, [f"model.path={tiny_model_dir}"]))
    assert engine.message_end_ids == frozenset(stop_token_ids(tokenizer))
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.message_end_ids


def test_a_prompt_splits_after_its_first_long_message_only():
    end = frozenset({2})
    assert split_point([9] * 63 + [2, 4, 4], end) == 64
    assert split_point([9] * 62 + [2, 4, 2, 4], end) == 0  # a first message shorter than MIN_SHARED_TOKENS
    assert split_point([9] * 63 + [2], end) == 0  # nothing follows it
    assert split_point([9] * 80, end) == 0 and split_point([9] * 63 + [2, 4], frozenset()) == 0
    cache = PrefixKVCache(budget_bytes=10**6)
    kv = (torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    cache.store([5, 6, 7, 8], kv, shared=True)
    assert cache.reusable([5, 6, 7, 8, 9]).entry is None  # a first message is reused by the split only
    assert cache.shared_prefix([5, 6, 7, 8]) is not None and cache.shared_prefix([5, 6, 7]) is None


class GoOn:
    """A user who says 'Go on.' after each of the first two assistant turns and then ends."""

    async def start(self, task) -> None:
        self.replies = 0

    async def respond(self, messages) -> Turn:
        self.replies += 1
        return Turn("Go on.", done=self.replies >= 3)

    async def finish(self) -> None:
        return None


@pytest.fixture(scope="module")
def stopping_model(tokenizer):
    """A tiny random model never samples <|im_end|>, so its turns would all end by length and an
    episode would stop after one turn. 30 SFT steps on two short conversations (about 1 s) teach it
    to answer 'Done.' and end its turn, which is all the episode loop needs to continue."""
    renderer = ChatRenderer(tokenizer, [])
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": "Done."},
                      {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Done."}]
                     for q in ("What is 12 * 34?", "How many apples are left?")]
    model = make_tiny_llama()
    sft_train(model, [conversation_sample(renderer, c) for c in conversations], tokenizer.pad_token_id,
              steps=30, batch_size=2, lr=1e-2)
    return model


def run_episodes(model, tokenizer, tasks, group: int, **engine_kwargs):
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, **engine_kwargs)
    settings = EpisodeSettings(max_turns=3, max_new_tokens_per_turn=24, temperature=0.0,
                               system_prompt="Use the calculator.")
    runner = EpisodeRunner(engine, tokenizer, [calculator], parse_hermes, settings, interaction_factory=GoOn)
    return asyncio.run(collect(runner, tasks, group, max_concurrent=8)), engine


def request_lengths(loss_mask: list[int]) -> list[int]:
    """The length of the ids each generate call got: where every sampled run starts."""
    return [i for i, m in enumerate(loss_mask) if m and not loss_mask[i - 1]]


def test_episode_turns_prefill_only_new_tokens(stopping_model, tokenizer):
    [traj], engine = run_episodes(stopping_model, tokenizer, arithmetic_tasks(1, seed=0), group=1)
    assert traj.finish == "stop" and traj.metrics["turns"] == 3
    starts = request_lengths(traj.loss_mask)
    mask = traj.loss_mask + [0]
    ends = [i for i, m in enumerate(traj.loss_mask) if m and not mask[i + 1]]  # each turn's last sample
    reused = ends[:-1]  # turn t + 1 reuses what turn t fed the model: its ids and all its samples but the last
    assert engine.stats["cached_tokens"] == sum(reused)
    assert engine.stats["prefill_tokens"] == starts[0] + sum(s - r for s, r in zip(starts[1:], reused))
    suffix = tokenizer("\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert engine.stats["prefill_tokens"] == starts[0] + 2 * (1 + len(suffix["input_ids"]))


def test_concurrent_episodes_match_no_reuse(stopping_model, tokenizer):
    tasks = arithmetic_tasks(2, seed=3)
    with_reuse, engine = run_episodes(stopping_model, tokenizer, tasks, group=2)
    without, plain = run_episodes(stopping_model, tokenizer, tasks, group=2, kv_cache_bytes=0)
    assert [t.metrics["turns"] for t in with_reuse] == [3.0] * 4
    assert [t.token_ids for t in with_reuse] == [t.token_ids for t in without]
    for a, b in zip(with_reuse, without):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
    requested = sum(sum(request_lengths(t.loss_mask)) for t in with_reuse)
    assert engine.stats["prefill_tokens"] + engine.stats["cached_tokens"] == requested == plain.stats["prefill_tokens"]
    assert engine.stats["prefill_tokens"] < requested / 2
    # Greedy, so each group's two episodes are the same: their first requests join as one and its
    # copy; a later turn's two do when they come back in time for the same step (timing decides).
    assert engine.stats["copied_requests"] >= 2 and plain.stats["copied_requests"] == 0


def test_lru_eviction_under_a_tiny_budget_recomputes_the_same_output(tiny_model, tokenizer):
    probe = HFEngine(tiny_model, pad_token_id=2)
    tool_turns(probe, tokenizer, QUESTIONS[:1], turns=1)
    one_entry = probe.prefix_cache.bytes
    small = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=int(2.5 * one_entry))
    full = HFEngine(tiny_model, pad_token_id=2)
    assert tool_turns(small, tokenizer, QUESTIONS) == tool_turns(full, tokenizer, QUESTIONS)
    assert small.stats["kv_cache_evictions"] > 0 and full.stats["kv_cache_evictions"] == 0
    assert 0 < small.prefix_cache.bytes <= small.prefix_cache.budget_bytes
    assert small.stats["prefill_tokens"] > full.stats["prefill_tokens"]  # misses were recomputed


def test_weight_update_drops_the_cache(tiny_model, tokenizer):
    renderer = ChatRenderer(tokenizer, [calculator])
    prompt = renderer.prompt_ids([{"role": "user", "content": QUESTIONS[0]}])
    engine = HFEngine(tiny_model, pad_token_id=2)
    first = engine.generate_batch([prompt], [greedy(8)])[0].token_ids
    following = prompt + first + [2, 198, 1, 4093, 198]
    new_weights = make_tiny_llama(seed=1)
    engine.update_weights(new_weights.state_dict().items(), version=1)
    assert len(engine.prefix_cache) == 0 and engine.stats["kv_cache_bytes"] == 0
    cached_before = engine.stats["cached_tokens"]
    after = engine.generate_batch([following], [greedy(8)])[0]
    assert engine.stats["cached_tokens"] == cached_before  # nothing from the old weights was reused
    fresh = HFEngine(new_weights, pad_token_id=2, kv_cache_bytes=0).generate_batch([following], [greedy(8)])[0]
    assert after.token_ids == fresh.token_ids and after.weight_version == 1
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=1e-5)
    # Without the flush the old keys and values stay and are reused (SGLang's flush_cache=False too).
    engine.update_weights(make_tiny_llama(seed=2).state_dict().items(), version=2, flush_cache=False)
    engine.generate_batch([following + after.token_ids + [2]], [greedy(2)])
    assert engine.stats["cached_tokens"] == cached_before + len(following) + len(after.token_ids) - 1


def test_prefix_cache_bookkeeping():
    kv = (torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))  # 1 layer, 2 heads, 4 tokens, 8 dims: 256 bytes each
    cache = PrefixKVCache(budget_bytes=2 * (512 + 32))
    cache.store([5, 6, 7, 8], kv)
    cache.store([5, 6, 9, 9], kv)
    assert cache.bytes == 2 * (512 + 32) and len(cache) == 2
    hit = cache.reusable([5, 6, 7, 8, 1])  # extends an entry: all of it, which its successor replaces
    assert (hit.length, hit.covers_entry) == (4, True)
    hit = cache.reusable([5, 6, 7])  # an entry holding all its tokens but the last
    assert (hit.length, hit.covers_entry) == (2, False)
    assert cache.reusable([5, 6, 9, 1]).length == 3
    assert cache.reusable([5, 6, 7, 1, 2]).entry is None  # a partial match (3 tokens) is not reused
    assert cache.reusable([4, 6]).entry is None
    cache.store([1, 2, 3, 4], kv)  # evicts the least recently used: [5, 6, 7, 8]
    assert cache.evictions == 1 and cache.reusable([5, 6, 7, 8, 0]).entry is None
    assert cache.reusable([5, 6, 9, 9, 0]).length == 4
    cache.store(list(range(16)), (torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)))  # larger than the budget
    assert len(cache) == 2
    cache.clear()
    assert cache.bytes == 0 and cache.reusable([1, 2, 3, 4, 5]).entry is None


def test_the_engine_refuses_sliding_window_models_by_name():
    """Their layers keep only the last keys, which neither the running batch's slots nor the prefix
    cache represent (before, such a model failed inside attention once a row joined mid-decode)."""
    from transformers import MistralForCausalLM

    assert plain_attention_layers(make_tiny_llama().config) == set()
    config = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    assert plain_attention_layers(config) == {"DynamicSlidingWindowLayer"}
    with pytest.raises(ConfigError, match="MistralForCausalLM has DynamicSlidingWindowLayer layers. Use engine.name=sglang"):
        HFEngine(MistralForCausalLM(config), pad_token_id=0)



def test_the_engine_refuses_models_whose_cached_keys_have_another_shape():
    """Multi-head latent attention (DeepSeek-V3 here) caches keys and values of other shapes than
    the config's heads and `head_dim`; the slot buffers are laid out from the config, so such a model
    failed on its first request with a shape error inside the decode thread."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2)
    model = DeepseekV3ForCausalLM(config)
    # What it caches instead (the compressed latent, its own rotary keys) differs across transformers versions.
    with pytest.raises(ConfigError, match=r"cache 4 key/value heads of size 8 per layer \(from the config\); "
                                          r"DeepseekV3ForCausalLM caches keys \(\d+, 2, \d+\).* Use engine.name=sglang"):
        HFEngine(model, pad_token_id=0)

def test_the_rollout_returns_only_after_the_decode_thread_stopped(stopping_model, tokenizer):
    """The decode thread idles `batch_wait_s` after its last result before it stops; a rollout that
    returned meanwhile would let the process exit with that thread inside torch."""
    from agentrl.rollout.collect import run_episodes as run_episodes_sync

    engine = HFEngine(stopping_model, pad_token_id=tokenizer.pad_token_id, batch_wait_s=0.3)
    settings = EpisodeSettings(max_turns=1, max_new_tokens_per_turn=4, temperature=0.0)
    runner = EpisodeRunner(engine, tokenizer, [calculator], parse_hermes, settings)
    [traj] = run_episodes_sync(runner, arithmetic_tasks(1, seed=0), 1, 4)
    assert traj.metrics["turns"] == 1
    assert not engine.serving
    assert engine.wait_idle(timeout_s=0)


def test_a_prompt_over_the_whole_budget_is_computed_once(tiny_model):
    """A prompt whose keys and values exceed kv_cache_bytes went through the model twice: its
    prefix pass's result was not kept, so the row computed it all again when it joined."""
    fed: list[int] = []
    tiny_model.model.embed_tokens.register_forward_hook(lambda module, args, out: fed.append(args[0].numel()))
    prompt = [1] + list(range(300, 700))  # 401 tokens: 2 layers x 2 heads x 16 x 4 bytes x 2 = 1 KB a token
    outputs = {}
    for budget in (0, 10_000, DEFAULT_KV_CACHE_BYTES):
        engine = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=budget)
        fed.clear()
        outputs[budget] = engine.generate_batch([prompt], [SamplingParams(max_new_tokens=3, temperature=0.0)])[0]
        assert sum(fed) == 401 + 2 and engine.stats["prefill_tokens"] == 401, (budget, fed)
        assert len(engine.prefix_cache) == (budget == DEFAULT_KV_CACHE_BYTES)
    assert outputs[10_000].token_ids == outputs[0].token_ids == outputs[DEFAULT_KV_CACHE_BYTES].token_ids
    # Once copied into the batch, what the row reused is not held by it: a second copy of a prompt
    # larger than the whole budget, counted nowhere, until the row finished.
    finished: list[Row] = []
    with torch.no_grad():
        HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=10_000)._decode([Row(prompt, greedy(3))], finished.append)
    assert finished[0].hit.length == 400 and finished[0].hit.entry is None


def decode_with_joins(model, rows, joins: dict[int, Row]) -> dict[str, list[int]]:
    """The engine's decode loop over `rows`, with `joins[k]` arriving as step k is planned, as a
    request back from its tool a little earlier or later would."""
    engine = HFEngine(model, pad_token_id=2, seed=0)
    out: dict[str, list[int]] = {}
    step = 0

    def admit(room: int) -> list[Row]:
        nonlocal step
        step += 1
        return [joins[step]] if step in joins else []

    with torch.no_grad():
        engine._decode(rows, lambda row: out.__setitem__(row.owner, row.ids), admit)
    return out


def test_a_seeded_request_samples_the_same_tokens_whoever_joins_its_batch_and_when(tiny_model):
    """Every row used to draw from the engine's one generator in batch order, so a request's tokens
    changed with the step at which another joined its batch, which follows the timing of tools: a
    multi-turn rollout could not be reproduced, or resumed exactly, even with a fixed seed."""
    a, b = [1, 504, 3459, 30, 2, 9690, 28, 30, 253], [1, 77, 88, 99, 2, 9690, 28]
    sampling = lambda seed: SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed)  # noqa: E731
    runs = {seeded: [decode_with_joins(tiny_model, [Row(a, sampling(11 if seeded else None), owner="a")],
                                       {k: Row(b, sampling(12 if seeded else None), owner="b")}) for k in (3, 4, 5)]
            for seeded in (True, False)}
    assert len({tuple(r["a"]) for r in runs[False]}) > 1  # the shared stream: a's tokens follow b's arrival
    assert runs[True][0] == runs[True][1] == runs[True][2]
    assert decode_with_joins(tiny_model, [Row(a, sampling(11), owner="a")], {})["a"] == runs[True][0]["a"]
    assert runs[True][0]["b"] != decode_with_joins(tiny_model, [Row(b, sampling(13), owner="b")], {})["b"]


def test_seeded_multi_turn_episodes_are_the_same_whatever_their_concurrency(stopping_model, tokenizer):
    """Three-turn episodes (a simulated user) sampled at temperature 1: with 16 episodes in flight
    their turns share batches in one order, with 3 in another; with the same seed every episode
    samples the same tokens either way. Another seed samples others, and each episode of a group
    samples its own."""
    tasks = arithmetic_tasks(4, seed=0)

    def rollout(seed: int, concurrent: int):
        engine = HFEngine(stopping_model, pad_token_id=tokenizer.pad_token_id, seed=0)
        settings = EpisodeSettings(max_turns=3, max_new_tokens_per_turn=24, temperature=1.0)
        runner = EpisodeRunner(engine, tokenizer, [calculator], parse_hermes, settings, interaction_factory=GoOn)
        return asyncio.run(collect(runner, tasks, 4, max_concurrent=concurrent, seed=seed))

    first = rollout(7, 16)
    assert sum(t.metrics["turns"] for t in first) > 16  # most episodes run several turns
    again = rollout(7, 3)
    assert [t.token_ids for t in again] == [t.token_ids for t in first]
    for a, b in zip(again, first):  # batched with other rows, the logits round differently
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
    other = rollout(8, 16)
    assert sum(a.token_ids != b.token_ids for a, b in zip(first, other)) >= 12
    for group in range(4):
        members = first[4 * group:4 * group + 4]
        assert len({tuple(t.token_ids) for t in members}) >= 3


def test_rows_with_the_next_prompt_of_a_joining_row_join_as_its_copies_and_sample_their_own_tokens(tiny_model):
    """A GRPO group's episodes that sampled the same tool call come back with the same next prompt
    while other rows decode: it is computed once, in the running rows' mixed pass, and each copy
    draws its own tokens from it, exactly the ones it draws when it is the only one joining."""
    first, running = [1, 504, 3459, 30, 2, 9690, 28, 30, 253], [1, 77, 88, 99, 2, 9690, 28]
    sampling = lambda seed: SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed)  # noqa: E731

    def decode(seeds: list[int]) -> tuple[dict[str, Completion], HFEngine]:
        engine = HFEngine(tiny_model, pad_token_id=2)
        turn = engine.generate_batch([first], [greedy(6)])[0].token_ids  # the previous turn, now cached
        prompt = first + turn + [11, 12, 13]  # + the tool's output
        before = dict(engine.stats)
        out: dict[str, Completion] = {}
        steps = iter(range(100))
        joining = [Row(prompt, sampling(seed), owner=f"seed {seed}") for seed in seeds]
        with torch.no_grad():
            engine._decode([Row(running, sampling(5), owner="running")],
                           lambda row: out.__setitem__(row.owner, engine._completion(row)),
                           lambda room: joining if next(steps) == 2 else [])
        engine.stats = {key: value - before[key] for key, value in engine.stats.items()}
        return out, engine

    together, engine = decode([21, 22, 23])
    assert engine.stats["copied_requests"] == 2 and engine.stats["joined_requests"] == 3
    # The running row's prompt, then the joining rows' new tokens once: the previous turn's last
    # sample (never fed back) and the three of the tool's output.
    assert engine.stats["prefill_tokens"] == len(running) + 4
    assert len({tuple(c.token_ids) for c in together.values()}) == 4  # each copy drew its own tokens
    for seed in (21, 22, 23):
        alone, single = decode([seed])
        assert single.stats["copied_requests"] == 0 and single.stats["prefill_tokens"] == len(running) + 4
        for name in (f"seed {seed}", "running"):
            assert together[name].token_ids == alone[name].token_ids
            torch.testing.assert_close(torch.tensor(together[name].logprobs), torch.tensor(alone[name].logprobs),
                                       atol=1e-5, rtol=0)


def test_rows_are_copies_only_when_their_prompts_and_reused_keys_are_the_same():
    kv = (torch.arange(24.0).view(2, 1, 3, 4), -torch.arange(24.0).view(2, 1, 3, 4))
    entry = CacheEntry(torch.tensor([5, 6, 7]), kv, 0)
    sibling = CacheEntry(torch.tensor([5, 6, 7]), (kv[0], kv[1] + 1e-7), 0)  # decoded in another batch slot
    stale = CacheEntry(torch.tensor([5, 6, 7]), kv, 0, weights=1)  # kept across a weight update
    rows = [Row([5, 6, 7, 8, 9], greedy(4)) for _ in range(5)] + [Row([5, 6, 7, 8, 0], greedy(4))]
    for row, hit in zip(rows, [Hit(entry, length=3), Hit(sibling, length=3), Hit(entry, length=3),
                               Hit(stale, length=3, weights=1), Hit(entry, length=2), Hit(entry, length=3)]):
        row.hit = hit
    computing, copies = split_copies(rows)
    assert computing == [rows[0], rows[3], rows[4], rows[5]]
    assert copies == [(0, rows[1]), (0, rows[2])]


def test_entries_kept_across_a_weight_update_say_the_oldest_weights_they_hold(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)
    first = [1, 504, 3459, 30]
    done = engine.generate_batch([first], [greedy(2)])[0].token_ids
    engine.update_weights([], version=1, flush_cache=False)
    engine.generate_batch([[1, 77, 88, 99]], [greedy(2)])
    engine.generate_batch([first + done + [11]], [greedy(2)])  # extends the kept entry: its keys are the old weights'
    weights = {tuple(e.ids_T[:4].tolist()): (len(e.ids_T), e.weights) for e in engine.prefix_cache._entries.values()}
    assert weights == {(1, 504, 3459, 30): (len(first) + len(done) + 2, 0), (1, 77, 88, 99): (5, 1)}


def test_copies_of_a_prompt_over_the_whole_budget_compute_its_prefix_once(tiny_model):
    prompt = list(range(3, 40))
    engine = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=10_000)  # less than one prompt's keys and values
    completions = engine.generate_batch([prompt] * 3, [greedy(3)] * 3)
    assert len(engine.prefix_cache) == 0 and engine.stats["copied_requests"] == 2
    assert engine.stats["prefill_tokens"] == len(prompt)  # the prefix pass, then the last token once
    alone = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=0).generate_batch([prompt], [greedy(3)])[0]
    assert all(c.token_ids == alone.token_ids for c in completions)
