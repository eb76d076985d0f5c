"""The transformers engine: exactness against model.generate, logprobs, batching, weight updates."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from agentrl.rollout.hf_engine import HFEngine
from agentrl.rollout.kv_cache import cache_keyword, returned_cache
from agentrl.rollout import sampling
from agentrl.rollout.sampling import sample_tokens
from agentrl.types import SamplingParams
from tests.conftest import make_tiny_llama

PROMPTS = [[1, 504, 3459, 30, 2], [1, 9690, 28, 30, 253, 1789, 3, 28], [1, 33]]


def greedy(n: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=stop)


def test_greedy_batch_matches_generate_row_by_row(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)
    completions = engine.generate_batch(PROMPTS, [greedy(12)] * 3)
    for prompt, completion in zip(PROMPTS, completions):
        reference = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
        assert completion.token_ids == reference and completion.finish == "length"


def test_logprobs_equal_a_full_forward_pass(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2, seed=3)
    completions = engine.generate_batch(PROMPTS, [SamplingParams(max_new_tokens=10, temperature=0.7)] * 3)
    for prompt, completion in zip(PROMPTS, completions):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, len(prompt) - 1:-1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_stop_tokens_and_per_request_budgets(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)
    free = engine.generate_batch([PROMPTS[0]], [greedy(8)])[0].token_ids
    stop = free[3]
    first_stop = free.index(stop)
    out = engine.generate_batch([PROMPTS[0], PROMPTS[0]], [greedy(8, (stop,)), greedy(2, (stop,))])
    assert out[0].token_ids == free[: first_stop + 1] and out[0].finish == "stop"
    assert out[1].token_ids == free[: min(2, first_stop + 1)]


def test_concurrent_calls_are_batched(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)

    async def many():
        return await asyncio.gather(*(engine.generate(p, greedy(6)) for p in PROMPTS * 4))

    results = asyncio.run(many())
    assert engine.stats["requests"] == 12 and engine.stats["batches"] == 1
    solo = HFEngine(tiny_model, pad_token_id=2).generate_batch([PROMPTS[1]], [greedy(6)])[0]
    assert results[1].token_ids == solo.token_ids  # padding in a batch does not change the result


def test_different_sampling_settings_go_to_different_batches(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)

    async def mixed():
        return await asyncio.gather(engine.generate(PROMPTS[0], greedy(3)),
                                    engine.generate(PROMPTS[1], SamplingParams(3, temperature=1.0)))

    asyncio.run(mixed())
    assert engine.stats["batches"] == 2


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny_model):
    a = HFEngine(tiny_model, pad_token_id=2, seed=7).generate_batch(PROMPTS, [SamplingParams(8)] * 3)
    b = HFEngine(tiny_model, pad_token_id=2, seed=7).generate_batch(PROMPTS, [SamplingParams(8)] * 3)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 2.5]])
    ids, logp = sample_tokens(logits, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert ids.tolist() == [1, 2]
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 2]])


def test_a_tiny_positive_temperature_samples_the_most_likely_token_with_logprob_zero():
    # 5 / 1e-39 overflows float32: the largest logit went to +inf and every logprob to NaN.
    logits = torch.tensor([[5.0, 3.0, -2.0, 1.0], [0.0, 0.5, 4.0, 3.9]])
    for temperature in (1e-39, 1e-30):
        ids, logp = sample_tokens(logits, temperature, 1.0, torch.Generator().manual_seed(0))
        assert ids.tolist() == [0, 2] and logp.tolist() == [0.0, 0.0]


def test_sampling_draws_each_token_with_its_probability():
    """100 000 rows in one call; 0.006 is four standard deviations of the largest frequency."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1e9]]).expand(100_000, 4)
    generator = torch.Generator().manual_seed(0)
    ids, logp = sample_tokens(logits, temperature=1.0, top_p=1.0, generator=generator)
    probs = torch.tensor([1.0, 2.718282, 7.389056, 0.0]) / 11.107338  # softmax by hand
    torch.testing.assert_close(torch.bincount(ids, minlength=4) / len(ids), probs, atol=0.006, rtol=0)
    torch.testing.assert_close(logp, probs.log()[ids])
    # Temperature 2 gives 0.186, 0.307, 0.506; top-p 0.7 keeps the two largest, renormalised.
    ids, logp = sample_tokens(logits, temperature=2.0, top_p=0.7, generator=generator)
    torch.testing.assert_close(torch.bincount(ids, minlength=4) / len(ids),
                               torch.tensor([0.0, 0.3775, 0.6225, 0.0]), atol=0.006, rtol=0)
    torch.testing.assert_close(logp[ids == 2], torch.full_like(logp[ids == 2], 0.50648).log(), atol=1e-4, rtol=0)


def test_top_p_orders_only_the_candidates_when_they_hold_the_nucleus_and_draws_what_a_full_sort_draws():
    """Row 0 is peaked (its top 256 tokens hold more than 0.9), row 1 nearly flat over 1000
    tokens (they hold about 0.26): the second makes the whole batch fall back to a full sort.
    Either way every draw equals nucleus sampling by the definition, over a full sort."""

    def by_definition(logits_BV, temperature, top_p, generator):
        probs_BV = torch.log_softmax(logits_BV / temperature, -1).exp()  # as the engine computes them
        probs_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        probs_BV = probs_BV.masked_fill(probs_BV.cumsum(-1) - probs_BV > top_p, 0.0)
        cdf_BV = probs_BV.cumsum(-1, dtype=torch.float64)
        draw_B1 = torch.rand((len(cdf_BV), 1), generator=generator, dtype=torch.float64)
        return order_BV.gather(1, torch.searchsorted(cdf_BV, draw_B1 * cdf_BV[:, -1:], right=True)).squeeze(1)

    torch.manual_seed(0)
    peaked, flat = torch.randn(1, 1000) * 8, torch.randn(1, 1000) * 0.01
    probs = torch.softmax(peaked, -1)
    assert probs.topk(256).values.sum() > 0.9 and torch.softmax(flat, -1).topk(256).values.sum() < 0.3
    sorted_probs, order = sampling.nucleus(probs, 0.9)
    assert sorted_probs.shape == (1, 256) and bool((sorted_probs[0, :-1] >= sorted_probs[0, 1:]).all())
    kept = int((sorted_probs > 0).sum())
    assert probs[0, order[0, :kept - 1]].sum() <= 0.9 < probs[0, order[0, :kept]].sum()
    for logits in (peaked, torch.cat([peaked, flat])):
        for seed in range(20):
            ids, logp = sample_tokens(logits, 1.0, 0.9, torch.Generator().manual_seed(seed))
            assert ids.tolist() == by_definition(logits, 1.0, 0.9, torch.Generator().manual_seed(seed)).tolist()
            torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1))


def test_update_weights_in_place_changes_outputs_and_version(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)
    before = engine.generate_batch(PROMPTS, [greedy(6)] * 3)
    other = make_tiny_llama(seed=1)
    engine.update_weights(other.state_dict().items(), version=5)
    after = engine.generate_batch(PROMPTS, [greedy(6)] * 3)
    reference = HFEngine(other, pad_token_id=2).generate_batch(PROMPTS, [greedy(6)] * 3)
    assert [c.token_ids for c in after] == [c.token_ids for c in reference]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert after[0].weight_version == 5 and before[0].weight_version == 0
    with pytest.raises(KeyError, match="no tensor 'lm_head.bias'"):
        engine.update_weights([("lm_head.bias", torch.zeros(3))], version=6)
    with pytest.raises(ValueError, match="'model.norm.weight' has shape \\(3,\\), expected \\(64,\\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=6)


def test_a_request_arriving_mid_decode_joins_and_a_short_row_leaves_early(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)
    finished: list[str] = []

    async def ask(name: str, prompt: list[int], n: int):
        completion = await engine.generate(prompt, greedy(n))
        finished.append(name)
        return completion

    async def run():
        long = asyncio.create_task(ask("long", PROMPTS[1], 300))
        while engine.stats["requests"] == 0:  # the long request is decoding
            await asyncio.sleep(0.001)
        return await ask("short", PROMPTS[0], 5), await long

    short, long = asyncio.run(run())
    assert finished == ["short", "long"]  # the short one did not wait for the long one's 300 tokens
    assert engine.stats["joined_requests"] == 1 and engine.stats["batches"] == 2
    solo = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=0)
    for got, want in zip((short, long), solo.generate_batch([PROMPTS[0], PROMPTS[1]], [greedy(5), greedy(300)])):
        assert got.token_ids == want.token_ids  # joining a batch of another width changes nothing
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=1e-5)


def test_rows_joining_and_leaving_on_a_script_decode_exactly_as_alone(tiny_model):
    """Joins and leaves at chosen steps, through the running batch's slots: a join into a freed slot
    of a wide enough buffer copies nothing that is running; a row longer than the running ones
    (beyond the spare columns a new batch keeps) makes room on the left; more rows than the buffer
    holds make it grow; a leave moves the last row into the freed slot. Rows joining running ones
    share the running rows' forward pass. Every row's ids and logprobs equal a lone generation's."""
    from agentrl.rollout.running_batch import Row

    engine = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=0, max_batch_size=8)
    long_prompt = [1] + list(range(300, 500))  # longer than the running rows and their spare columns
    plan = {  # step -> rows joining then
        0: [("a", PROMPTS[0], 20), ("b", PROMPTS[1], 3)],
        5: [("c", PROMPTS[2], 6)],  # into b's freed slot: no reallocation
        7: [("d", long_prompt, 4)],  # room on the left
        8: [("e", PROMPTS[1], 5), ("f", PROMPTS[0], 2)],  # 5 rows in 4 slots: it grows
    }
    step, results, buffers, passes = 0, {}, [], []

    def watched(join):
        def run(batch, rows):
            before = batch.keys[0]
            join(batch, rows)
            passes.append((join.__name__, len(batch) - len(rows)))
            buffers.append((rows[0].owner, before.data_ptr() == batch.keys[0].data_ptr() and before.numel() > 0))
        return run

    def admit(room):
        nonlocal step
        step += 1
        return [Row(p, greedy(n), owner=name) for name, p, n in plan.get(step, [])][:room]

    engine._prefill, engine._mixed = watched(engine._prefill), watched(engine._mixed)
    first = [Row(p, greedy(n), owner=name) for name, p, n in plan[0]]
    with torch.no_grad():
        engine._decode(first, lambda row: results.__setitem__(row.owner, row), admit)
    assert dict(buffers) == {"a": False, "c": True, "d": False, "e": False}
    assert passes == [("_prefill", 0), ("_mixed", 1), ("_mixed", 2), ("_mixed", 3)]
    assert engine.stats["joined_requests"] == 4 and len(results) == 6
    for name, prompt, n in [spec for specs in plan.values() for spec in specs]:
        alone = HFEngine(tiny_model, pad_token_id=2, kv_cache_bytes=0).generate_batch([prompt], [greedy(n)])[0]
        assert results[name].ids == alone.token_ids, name
        torch.testing.assert_close(torch.tensor(results[name].logprobs), torch.tensor(alone.logprobs),
                                   atol=1e-5, rtol=1e-5)


def test_a_failed_decode_reaches_its_caller_and_the_engine_keeps_serving(tiny_model, monkeypatch):
    engine = HFEngine(tiny_model, pad_token_id=2)
    step = engine._step

    def broken_once(batch):
        monkeypatch.setattr(engine, "_step", step)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine, "_step", broken_once)

    async def run():
        with pytest.raises(RuntimeError, match="^out of memory$"):
            await engine.generate(PROMPTS[0], greedy(3))
        return await engine.generate(PROMPTS[0], greedy(3))

    assert len(asyncio.run(run()).token_ids) == 3


def test_an_id_outside_the_vocabulary_fails_only_its_own_request(tiny_model):
    engine = HFEngine(tiny_model, pad_token_id=2)
    vocabulary = tiny_model.get_input_embeddings().num_embeddings

    async def run():
        running = asyncio.ensure_future(engine.generate(PROMPTS[0], greedy(40)))
        while engine.stats["requests"] == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(ValueError, match=rf"^generate: token id {vocabulary} is outside the model's "
                                             rf"vocabulary \(0..{vocabulary - 1}\)$"):
            await engine.generate([1, vocabulary], greedy(3))
        return await running

    assert len(asyncio.run(run()).token_ids) == 40


def test_a_request_past_the_models_positions_fails_alone_naming_both_numbers(tiny_model):
    """GPT-2's learned positions raised an IndexError past n_positions that failed every request
    of the batch; a rotary model (Llama) decoded garbage there without a word."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).eval()
    engine = HFEngine(gpt2, pad_token_id=0)

    async def run():
        fits = engine.generate(list(range(3, 31)), greedy(4))  # 28 + 4 = 32 positions: all of them
        too_long = engine.generate(list(range(3, 43)), greedy(4))
        return await asyncio.gather(fits, too_long, return_exceptions=True)

    fits, too_long = asyncio.run(run())
    assert len(fits.token_ids) == 4 and fits.finish == "length"
    assert isinstance(too_long, ValueError) and str(too_long) == \
        "generate: 40 prompt tokens + max_new_tokens 4 exceed the model's max_position_embeddings (32)"
    with pytest.raises(ValueError, match=r"^generate: 28 prompt tokens \+ max_new_tokens 5 exceed"):
        asyncio.run(engine.generate(list(range(3, 31)), greedy(5)))  # the sequence, its last token too, must fit
    tiny_model.config.max_position_embeddings = 8
    with pytest.raises(ValueError, match=r"^generate: 5 prompt tokens \+ max_new_tokens 4 exceed the model's "
                                         r"max_position_embeddings \(8\)$"):
        asyncio.run(HFEngine(tiny_model, pad_token_id=2).generate(PROMPTS[0], greedy(4)))


def test_generate_does_not_wait_for_the_event_loops_executor(tiny_model):
    """Tool calls that timed out keep their executor threads (tools/threads.py). The decode thread
    used to be one of the loop's executor calls: queued behind them, every generate waited."""
    import concurrent.futures
    import threading

    engine = HFEngine(tiny_model, pad_token_id=2)
    release = threading.Event()

    async def run():
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        stuck = asyncio.ensure_future(asyncio.to_thread(release.wait))  # holds the executor's only thread
        try:
            return await asyncio.wait_for(engine.generate(PROMPTS[0], greedy(3)), timeout=10)
        finally:
            release.set()
            await stuck

    assert len(asyncio.run(run()).token_ids) == 3
    assert engine.wait_idle(10) and not engine.serving


def test_requests_made_together_fail_together_when_no_decode_thread_starts(tiny_model, monkeypatch):
    """Every request queued for the thread that could not start gets the error (they used to wait
    with no thread coming), and the next request starts one."""
    import threading

    engine = HFEngine(tiny_model, pad_token_id=2)
    original = threading.Thread.start

    def refuse(thread):
        monkeypatch.setattr(threading.Thread, "start", original)  # once
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)

    async def together():
        asks = [engine.generate(PROMPTS[i % 2], greedy(3)) for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), timeout=10)

    assert [repr(r) for r in asyncio.run(together())] == [repr(RuntimeError("can't start new thread"))] * 3
    assert not engine.serving and len(asyncio.run(engine.generate(PROMPTS[0], greedy(3))).token_ids) == 3


def test_a_bad_tensor_in_an_update_copies_none_and_unknown_memory_tags_are_refused(tiny_model):
    """A bad name or shape found after earlier tensors were copied left a mix of old and new
    weights under the old version; a misspelt resume_memory tag left that memory released."""
    engine = HFEngine(tiny_model, pad_token_id=2)
    before = {name: t.clone() for name, t in tiny_model.state_dict().items()}
    new_norm = ("model.norm.weight", torch.full((64,), 9.0))
    with pytest.raises(KeyError, match="no tensor 'lm_head.bias'; none of this call's tensors were copied"):
        engine.update_weights(iter([new_norm, ("lm_head.bias", torch.zeros(3))]), version=1)
    with pytest.raises(ValueError, match=r"^update_weights: 'model.layers.1.input_layernorm.weight' has shape "
                                         r"\(3,\), expected \(64,\); none of this call's tensors were copied$"):
        engine.update_weights([new_norm, ("model.layers.1.input_layernorm.weight", torch.zeros(3))], version=1)
    assert all(torch.equal(t, before[name]) for name, t in tiny_model.state_dict().items())
    assert engine.weight_version == 0
    engine.release_memory()
    with pytest.raises(ValueError, match=r"^resume_memory: unknown tags \['kv-cache', 'weight'\]; "
                                         r"expected weights, kv_cache$"):
        engine.resume_memory(("weight", "kv-cache"))
    with pytest.raises(RuntimeError, match="weights memory is released"):
        engine.score(PROMPTS[0], 1)
    engine.resume_memory(("weights", "kv_cache"))
    assert len(engine.score(PROMPTS[0], 1)) == 4


def test_a_request_queued_while_the_decode_thread_decides_to_stop_still_runs(tiny_model):
    """The decode thread finds nothing waiting and ends; a request queued in between (here held
    open by a pause after the decision) must start a new thread, not wait for the ending one."""

    class PausingEngine(HFEngine):
        def _serve_one(self):
            more = super()._serve_one()
            if not more:
                time.sleep(0.3)  # a thread switch right after deciding to stop
            return more

    engine = PausingEngine(tiny_model, pad_token_id=2)

    async def run():
        first = await engine.generate(PROMPTS[0], greedy(3))
        await asyncio.sleep(0.05)  # the thread is inside its pause now
        second = await asyncio.wait_for(engine.generate(PROMPTS[1], greedy(3)), timeout=10)
        return first, second

    first, second = asyncio.run(run())
    assert len(first.token_ids) == len(second.token_ids) == 3


def test_a_request_with_other_settings_is_not_starved_by_requests_joining_the_running_batch(tiny_model):
    """A (temperature 1) decodes; G (greedy) waits for other settings; B (temperature 1) arrives
    after G. B could join A's running batch, but G is older: A's batch drains, then G runs, then B."""
    engine = HFEngine(tiny_model, pad_token_id=2)
    hot = lambda n: SamplingParams(n, 1.0, stop_token_ids=())  # noqa: E731
    finished = []

    async def run():
        a = asyncio.ensure_future(engine.generate(PROMPTS[0], hot(200)))
        while engine.stats["requests"] == 0:
            await asyncio.sleep(0.005)
        g = asyncio.ensure_future(engine.generate(PROMPTS[1], greedy(3)))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(engine.generate(PROMPTS[2], hot(3)))
        for name, future in (("a", a), ("g", g), ("b", b)):
            future.add_done_callback(lambda _, name=name: finished.append(name))
        await asyncio.gather(a, g, b)

    asyncio.run(run())
    assert finished == ["a", "g", "b"] and engine.stats["batches"] == 3 and engine.stats["joined_requests"] == 0




def test_a_cancelled_caller_stops_its_row_and_a_cancelled_waiting_request_never_runs(tiny_model):
    """An HTTP client that hangs up cancels its generate call: its row leaves the batch at the
    next step instead of decoding its whole budget, and a request still waiting is dropped."""
    engine = HFEngine(tiny_model, pad_token_id=2)

    async def run():
        running = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(2000, 0.0, stop_token_ids=())))
        # other sampling settings: it waits for the first batch to end
        waiting = asyncio.ensure_future(engine.generate(PROMPTS[1], SamplingParams(2000, 1.0, stop_token_ids=())))
        while engine.stats["requests"] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        waiting.cancel()
        running.cancel()
        return await asyncio.to_thread(engine.wait_idle, 60)

    assert asyncio.run(run())
    assert engine.stats["requests"] == 1 and 0 < engine.stats["generated_tokens"] < 500


def test_results_for_an_event_loop_that_closed_are_dropped_without_an_error(tiny_model, monkeypatch):
    """An interrupted rollout tears its event loop down while rows still decode: handing their
    results to the closed loop used to raise in the decode thread (two tracebacks on every Ctrl-C)."""
    import threading

    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    engine = HFEngine(tiny_model, pad_token_id=2)
    loop = asyncio.new_event_loop()

    async def start() -> list[asyncio.Future]:
        requests = [asyncio.ensure_future(engine.generate(PROMPTS[0], greedy(40))),
                    asyncio.ensure_future(engine.generate(PROMPTS[1], greedy(120)))]
        while engine.stats["requests"] < 2:
            await asyncio.sleep(0.01)
        return requests

    requests = loop.run_until_complete(start())
    loop.close()
    assert engine.wait_idle(60)
    assert errors == [] and engine.stats["generated_tokens"] == 160  # both rows ran to their budgets
    assert not any(r.done() for r in requests)  # nobody was told: their loop is gone


def test_a_decode_start_left_on_a_loop_that_closed_is_scheduled_again(tiny_model):
    """The decode thread starts from a callback on the requesting loop; a loop that stopped and
    closed before running it left the engine believing a thread served, and every later request
    waited for ever."""
    engine = HFEngine(tiny_model, pad_token_id=2)
    loop = asyncio.new_event_loop()
    orphan = loop.create_task(engine.generate(PROMPTS[0], greedy(3)))
    orphan._log_destroy_pending = False  # it stays pending with its loop: no "Task was destroyed" line
    loop.call_soon(loop.stop)
    loop.run_forever()  # the request is queued; the start callback is behind the stop
    loop.close()

    async def again():
        return await asyncio.wait_for(engine.generate(PROMPTS[0], greedy(3)), 60)

    assert len(asyncio.run(again()).token_ids) == 3
    assert engine.wait_idle(60)


def test_the_slot_attention_is_sdpa_outside_mixed_passes_and_is_not_saved(tmp_path):
    """The engine switches its model's attention to `agentrl_slots` (packed_attention.py): every
    ordinary forward pass (the trainer's, `score`'s, a padded batch) must give exactly SDPA's
    numbers, and a checkpoint saved from the model must not name an attention other processes lack."""
    from transformers import AutoModelForCausalLM

    from agentrl.rollout.packed_attention import NAME

    model = make_tiny_llama()
    ids = torch.tensor([[2, 2, 1, 504, 3459], [1, 9690, 28, 30, 253]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = model(input_ids=ids, attention_mask=mask).logits
    engine = HFEngine(model, pad_token_id=2)
    assert engine.mixed_passes and model.config._attn_implementation == NAME
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_a_model_without_sdpa_attention_joins_in_passes_of_its_own_with_the_same_tokens():
    eager = make_tiny_llama()
    eager.set_attn_implementation("eager")
    separate, mixed = HFEngine(eager, pad_token_id=2), HFEngine(make_tiny_llama(), pad_token_id=2)
    assert not separate.mixed_passes and eager.config._attn_implementation == "eager"

    async def long_then_short(engine):
        long = asyncio.create_task(engine.generate(PROMPTS[1], greedy(60)))
        while engine.stats["requests"] == 0:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # the long row is decoding when the short one joins
        return await engine.generate(PROMPTS[2], greedy(8)), await long

    for got, want in zip(asyncio.run(long_then_short(separate)), asyncio.run(long_then_short(mixed))):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=1e-5)
    assert separate.stats["joined_requests"] == mixed.stats["joined_requests"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_steps_without_padding_group_query_heads_and_match_sdpa(monkeypatch, dtype):
    """A decode step whose rows have no padding gets no mask from transformers, which then sends
    one-token queries to SDPA's `enable_gqa` (slow on CPU in bfloat16); the engine's attention
    groups the query heads per key head itself and must give SDPA's numbers."""
    from agentrl.rollout import packed_attention

    grouped = []
    original = packed_attention.grouped_decode_attention
    monkeypatch.setattr(packed_attention, "grouped_decode_attention",
                        lambda *args: grouped.append(args[0].shape) or original(*args))
    reference, model = make_tiny_llama().to(dtype), make_tiny_llama().to(dtype)
    HFEngine(model, pad_token_id=2)
    ids = torch.tensor([[1, 504, 3459, 28, 30], [1, 9690, 28, 30, 253]])

    def last_step(m):
        prefix = returned_cache(m(input_ids=ids[:, :-1], use_cache=True))
        return m(input_ids=ids[:, -1:], **{cache_keyword(m): prefix}).logits

    got, want = last_step(model), last_step(reference)
    assert grouped == [(2, 4, 1, 16)] * 2  # both layers' one-token step: 2 rows, 4 query heads, head dim 16
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, value_dim", [(6, 2, 16), (6, 2, 24), (4, 4, 16)])
def test_grouped_decode_attention_equals_transformers_sdpa(heads, kv_heads, value_dim):
    """Against transformers' own one-token SDPA attention: query heads in transformers' order
    (query head h reads key head h // groups), a query that is a transposed view as the attention
    modules pass it, values whose head size differs from the keys'."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from agentrl.rollout.packed_attention import grouped_decode_attention

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    query = torch.randn(3, 1, heads, 16).transpose(1, 2)  # (rows, heads, 1, dim), not contiguous
    key, value = torch.randn(3, kv_heads, 7, 16), torch.randn(3, kv_heads, 7, value_dim)
    want, _ = sdpa_attention_forward(module, query, key, value, None, scaling=None)
    got, _ = grouped_decode_attention(query, key, value, None)
    assert got.shape == want.shape == (3, 1, heads, value_dim)
    torch.testing.assert_close(got, want)


def test_a_seeded_top_p_draw_is_the_same_whatever_row_shares_its_batch():
    """A flat row used to send the whole batch to a full sort, which orders tied probabilities
    (bf16 logits tie often) unlike topk: the same seed then drew another token of the same logit."""
    torch.manual_seed(0)
    V, changed = 4096, 0
    for trial in range(40):
        row = (torch.randn(1, V) * 3.0).to(torch.bfloat16)
        row[0, :300] = (torch.randn(300) * 0.3 + 14).to(torch.bfloat16)  # ~300 near-equal logits, many tied
        flat = (torch.randn(1, V) * 0.01).to(torch.bfloat16)
        assert torch.softmax(row.float(), -1).topk(256).values.sum() > 0.5  # the row alone: the top-256 path
        alone, _ = sample_tokens(row, 1.0, 0.5, None, [torch.Generator().manual_seed(trial)])
        batched, _ = sample_tokens(torch.cat([row, flat]), 1.0, 0.5, None,
                                   [torch.Generator().manual_seed(trial), torch.Generator().manual_seed(999)])
        changed += int(alone[0] != batched[0])
    assert changed == 0


def test_a_request_whose_row_cannot_be_made_fails_alone(tiny_model, monkeypatch):
    """Rows were made after their requests had left the queue and before any was in the batch:
    one that failed left its batch-mates' futures unresolved for ever (a first admit), or failed
    every running row with its error (a join mid-decode)."""
    import agentrl.rollout.hf_engine as hf_engine

    class Row(hf_engine.Row):
        def __post_init__(self) -> None:
            if self.sampling.seed == 13:  # a request the row cannot be made for
                raise ValueError("no row for seed 13")
            super().__post_init__()

    monkeypatch.setattr(hf_engine, "Row", Row)
    engine = HFEngine(tiny_model, pad_token_id=2)
    # one temperature: the bad request is taken with the others, into their batch
    good = SamplingParams(max_new_tokens=4, temperature=0.0, seed=1)
    bad = SamplingParams(max_new_tokens=4, temperature=0.0, seed=13)

    async def together() -> list:
        return await asyncio.wait_for(asyncio.gather(engine.generate(PROMPTS[0], good), engine.generate(PROMPTS[1], bad),
                                                     return_exceptions=True), timeout=60)

    async def joining() -> list:
        long = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=1500, temperature=0.0)))
        await asyncio.sleep(0.05)  # decoding by now (1500 tokens take about a second)
        joiner = asyncio.ensure_future(engine.generate(PROMPTS[1], bad))
        return await asyncio.wait_for(asyncio.gather(long, joiner, return_exceptions=True), timeout=60)

    alone = engine.generate_batch([PROMPTS[0]], [greedy(1500)])[0].token_ids
    first, failed = asyncio.run(together())
    assert first.token_ids == alone[:4] and str(failed) == "no row for seed 13"
    running, failed = asyncio.run(joining())
    assert running.token_ids == alone and str(failed) == "no row for seed 13"
    with pytest.raises(ValueError, match=r"^generate: seed 18446744073709551616 is no integer from 0 to 2\*\*64 - 1"):
        asyncio.run(engine.generate(PROMPTS[0], SamplingParams(seed=2**64)))


def test_close_fails_the_waiting_requests_refuses_new_ones_and_leaves_the_cache_empty(tiny_model):
    """close() only cleared the cache: a request waiting for another batch still ran after it,
    as did one made after it, and both stored their prefixes again."""
    engine = HFEngine(tiny_model, pad_token_id=0)

    async def main():
        running = asyncio.ensure_future(engine.generate([1, 5, 6, 7], greedy(1000)))  # a second or so
        waiting = asyncio.ensure_future(engine.generate([1, 8, 9], SamplingParams(20, 1.0)))  # another batch
        while engine.stats["requests"] == 0:  # the first batch is decoding
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.close)
        with pytest.raises(RuntimeError, match="^HFEngine.generate: the engine is closed$"):
            await engine.generate([1, 10, 11], greedy(5))
        with pytest.raises(RuntimeError, match="^HFEngine: the engine was closed before this request ran$"):
            await waiting
        return await running

    assert len(asyncio.run(main()).token_ids) == 1000  # the batch already decoding finishes
    assert engine.wait_idle(10)
    assert len(engine.prefix_cache) == 0 and engine.stats["requests"] == 1
