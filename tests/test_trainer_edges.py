"""The trainer at its edges: two real gloo ranks whose micro-batches differ, activation checkpointing
with packed rows, rows with nothing to train, dropout, bf16 reference logprobs, LoRA on the
embeddings (refused where they are tied to the head), fewer mini-batches than configured. Models are
tiny random Llamas (a 512-token vocabulary where no tokenizer is involved)."""

from __future__ import annotations

import math
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.trainer.critic import CriticWorker, ValueModel
from agentrl.trainer.distributed import Ranks, open_rendezvous, remove_rendezvous
from agentrl.trainer.logprobs import padded_micro_batches, token_logprobs
from agentrl.trainer.packing import PackedRow, enable_packing, pack_cost
from agentrl.trainer.policy import PolicyWorker, ReferenceWorker, batched_logprobs

PROMPT_TOKENS = 20


def small_llama(attention_dropout: float = 0.0, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         attention_dropout=attention_dropout)
    return LlamaForCausalLM(config)


def group(completion_lengths: tuple[int, ...], rewards: tuple[float, ...], seed: int = 1):
    """Rows that share one 20-token prompt: (sequences, masks, per-token advantages)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 500, (PROMPT_TOKENS,), generator=generator).tolist()
    sequences = [prompt + torch.randint(3, 500, (n,), generator=generator).tolist() for n in completion_lengths]
    masks = [[0] * PROMPT_TOKENS + [1] * n for n in completion_lengths]
    advantages = [[m * r for m in mask] for mask, r in zip(masks, rewards)]
    return sequences, masks, advantages


def with_context_filling_rows(sequences, masks, advantages):
    """Two more rows: a 37-token prompt that filled the context, so nothing was sampled."""
    prompt = list(range(3, 40))
    return (sequences + [prompt, prompt], masks + [[0] * 37, [0] * 37], advantages + [[0.0] * 37, [0.0] * 37])


# Lengths 32, 30, 28: rank 0 gets row 0 alone (nothing to share), rank 1 rows 1 and 2 (a shared prompt).
UNEVEN = group((12, 10, 8), (1.0, -0.5, -0.5))
# Lengths 32, 31, 30, 29: each rank gets two rows of the prompt, so both can share it.
EVEN = group((12, 11, 10, 9), (1.0, -1.0, 0.5, -0.5), seed=2)


def steps(ranks: Ranks = Ranks()) -> dict:
    """Logprobs and one update on each batch, with fresh identical models."""
    policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, ranks=ranks)
    reference = ReferenceWorker(small_llama(), 2, 1.0, 4096, ranks)
    out = {"policy_logprobs": policy.logprobs(*UNEVEN[:2]), "reference_logprobs": reference.logprobs(*UNEVEN[:2]),
           "uneven": policy.update(*UNEVEN)}
    even = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, ranks=ranks)
    out["even_with_empty_rows"] = even.update(*with_context_filling_rows(*EVEN))
    return out


def rank_main(rank: int, rendezvous: str, results) -> None:
    import torch.distributed as dist

    from agentrl.trainer.distributed import init_process_group

    torch.set_num_threads(1)
    ranks = Ranks(rank, 2)
    init_process_group(ranks, rendezvous, "cpu", timeout_s=10.0)  # a mismatch fails, not hangs
    try:
        results.put((rank, steps(ranks)))
    except Exception as error:
        results.put((rank, repr(error)))
    finally:
        dist.destroy_process_group()


def gather(results, processes, timeout_s: float) -> dict:
    """Each rank's answer; a rank that dies without one (gloo aborts the process on a mismatched
    collective) fails at once instead of after the timeout."""
    answers: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < len(processes):
        try:
            rank, answer = results.get(timeout=0.5)
            answers[rank] = answer
        except queue.Empty:
            dead = {rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode not in (None, 0)}
            assert not dead.keys() - answers.keys(), f"ranks died without an answer (exit codes {dead}): {answers}"
            assert time.monotonic() < deadline, f"no answer within {timeout_s} s: {answers}"
    return answers


@pytest.mark.timeout(120)
def test_two_gloo_ranks_with_different_micro_batches_give_the_single_process_step():
    """Rank 0's only micro-batch is one plain row, rank 1's two rows of one prompt packed together:
    each is one decoder call (FSDP2 gathers each layer once per call), so the ranks stay in step.
    In the second batch both ranks pack two rows, and rows with nothing sampled are left out."""
    cost = pack_cost(small_llama())
    sequences, masks, _ = UNEVEN
    assert Ranks(0, 2).micro_batch_plans([0, 1, 2], sequences, masks, 4096, cost) == [
        [[PackedRow([0], 0, 32)]], [[PackedRow([1, 2], PROMPT_TOKENS - 1, 19 + 11 + 9)]]]
    sequences, masks, _ = EVEN
    assert Ranks(0, 2).micro_batch_plans([0, 1, 2, 3], sequences, masks, 4096, cost) == [
        [[PackedRow([0, 3], 19, 19 + 13 + 10)]], [[PackedRow([1, 2], 19, 19 + 12 + 11)]]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = steps()
    finally:
        torch.set_num_threads(threads)
    context = mp.get_context("spawn")
    results = context.Queue()
    rendezvous, _ = open_rendezvous("127.0.0.1")
    processes = [context.Process(target=rank_main, args=(rank, rendezvous, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        answers = gather(results, processes, timeout_s=100)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        remove_rendezvous(rendezvous)
    assert all(isinstance(answer, dict) for answer in answers.values()), answers
    for rank, rows in ((0, [0]), (1, [1, 2])):
        for key in ("policy_logprobs", "reference_logprobs"):
            assert [i for i, row in enumerate(answers[rank][key]) if row is not None] == rows
            for i in rows:
                assert answers[rank][key][i] == pytest.approx(alone[key][i], abs=1e-5)
    for batch in ("uneven", "even_with_empty_rows"):
        assert alone[batch]["grad_norm"] > 0
        for rank in (0, 1):
            assert answers[rank][batch]["grad_norm"] == pytest.approx(alone[batch]["grad_norm"], rel=1e-5)
        assert answers[0][batch]["loss"] + answers[1][batch]["loss"] == pytest.approx(alone[batch]["loss"], abs=1e-6)


@pytest.mark.parametrize("segmented", [False, True])
def test_activation_checkpointing_gives_packed_rows_the_same_logprobs_and_gradients(segmented, monkeypatch):
    """Checkpointed layers recompute their forward pass in the backward pass; with a group's rows
    packed into one row (a 4D mask, or segmented attention whose plan travels with the layer's
    arguments) that gives bit-equal results."""
    from agentrl.models import enable_activation_checkpointing
    from agentrl.trainer import packing, segment_attention

    monkeypatch.setattr(packing, "MIN_SEGMENTED_WIDTH", 0)  # these rows are 46 wide
    if segmented:  # a fallback to SDPA with the mask would make this test about the mask
        monkeypatch.setattr(segment_attention, "sdpa_attention_forward", None)
    sequences, masks, _ = group((5, 11, 8), (1.0, 0.0, -1.0))
    plan = [[PackedRow([0, 1, 2], PROMPT_TOKENS - 1, 19 + 6 + 12 + 9)]]
    results = []
    for checkpointed in (False, True):
        model = small_llama().train()
        assert enable_packing(model).segmented if segmented else pack_cost(model).segmented is False
        if checkpointed:
            enable_activation_checkpointing(model)
        idx, batch = next(padded_micro_batches(plan, sequences, masks, 2, "cpu"))
        assert idx == [0, 1, 2] and batch.packed.segments is not None
        logprobs_BT, entropy_BT = token_logprobs(model, batch, entropy_grad=True)
        ((logprobs_BT * batch.mask_BT).sum() + 0.1 * entropy_BT.sum()).backward()
        results.append((logprobs_BT.detach(), {name: p.grad for name, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(grad, results[1][1][name]) for name, grad in results[0][1].items())
    assert all(grad.abs().sum() > 0 for grad in results[0][1].values())


def test_rows_with_nothing_sampled_leave_the_update_unchanged():
    sequences, masks, advantages = UNEVEN
    updated = []
    for batch in ((sequences, masks, advantages), with_context_filling_rows(sequences, masks, advantages)):
        policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, aggregation="seq-mean-token-mean")
        updated.append((policy.update(*batch), policy.model.state_dict()))
    assert updated[1][0] == updated[0][0] and updated[0][0]["grad_norm"] > 0
    assert all(torch.equal(tensor, updated[1][1][name]) for name, tensor in updated[0][1].items())
    # Nothing to train at all: the step runs and changes nothing.
    policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0)
    before = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    assert policy.update(*with_context_filling_rows([], [], []))["grad_norm"] == 0.0
    assert all(torch.equal(tensor, policy.model.state_dict()[name]) for name, tensor in before.items())


def test_dropout_neither_moves_old_logprobs_nor_clips_at_unchanged_weights():
    """The checkpoint's dropout is off for RL; the adapters' (a recipe setting) stays in training
    but not in the passes without gradients."""
    sequences, masks, advantages = UNEVEN
    policy = PolicyWorker(small_llama(attention_dropout=0.1), 2, lr=1e-3, temperature=1.0)
    first, second = policy.logprobs(sequences, masks), policy.logprobs(sequences, masks)
    assert first == second and policy.model.training
    metrics = policy.update(sequences, masks, advantages, old_logprobs=first)
    assert (metrics["clip_fraction"], metrics["approx_kl"]) == (0.0, 0.0)

    adapted = PolicyWorker(lora_model(lora_dropout=0.5), 2, lr=1e-3, temperature=1.0)
    assert adapted.model.base_model.model.model.layers[0].self_attn.q_proj.lora_dropout["default"].p == 0.5
    assert adapted.logprobs(sequences, masks) == adapted.logprobs(sequences, masks) and adapted.model.training

    torch.manual_seed(0)
    critic = CriticWorker(ValueModel(small_llama(attention_dropout=0.1).get_decoder()), 2, lr=1e-3, value_clip=0.2)
    torch.nn.init.normal_(critic.model.head.weight)
    values = critic.values(sequences, masks)
    assert values == critic.values(sequences, masks) and critic.model.training
    assert any(v != 0.0 for row in values for v in row)
    # The training pass sees the values the eval pass saw: with returns equal to the old values there
    # is nothing to learn (with the checkpoint's dropout on, it was about 0.2).
    assert critic.update(sequences, masks, values, values)["value_loss"] < 1e-12


def test_the_critic_takes_its_weight_decay_from_the_recipe(tiny_model_dir):
    from agentrl.recipe import load_recipe
    from agentrl.trainer.roles import make_critic

    config = load_recipe(None, [f"model.path={tiny_model_dir}", "algorithm.advantage=gae", "critic.weight_decay=0.05"])
    critic = make_critic(config, 2)
    assert [group["weight_decay"] for group in critic.optimizer.param_groups] == [0.05]
    default = make_critic(load_recipe(None, [f"model.path={tiny_model_dir}", "algorithm.advantage=gae"]), 2)
    assert [group["weight_decay"] for group in default.optimizer.param_groups] == [0.0]


def test_the_reference_computes_like_the_policy_under_bf16(tiny_model_dir):
    from agentrl.config import RecipeConfig
    from agentrl.trainer.roles import make_policy, make_reference

    config = RecipeConfig.model_validate({"model": {"path": str(tiny_model_dir)}, "algorithm": {"kl_coef": 0.1},
                                          "trainer": {"device": "cpu", "dtype": "bfloat16"}})
    policy, reference = make_policy(config, 2), make_reference(config, 2)
    assert policy.bf16_autocast and reference.bf16_autocast
    sequences, masks, advantages = UNEVEN
    ref_logprobs = reference.logprobs(sequences, masks)
    assert ref_logprobs == policy.logprobs(sequences, masks)
    assert policy.update(sequences, masks, advantages, ref_logprobs=ref_logprobs)["kl_ref"] == 0.0


def lora_model(**options):
    """LoRA on the embeddings, the head and q_proj of a model whose head has its own weight."""
    from peft import LoraConfig, get_peft_model

    from agentrl.trainer.lora import peft_wrapping

    with peft_wrapping():
        model = get_peft_model(small_llama(tied=False), LoraConfig(
            r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"], **options))
    torch.manual_seed(3)
    for name, parameter in model.named_parameters():
        if "lora_" in name:  # peft starts B at zero; a merge of zeros would prove nothing
            torch.nn.init.normal_(parameter, std=0.1)
    return model


def test_lora_on_the_embeddings_is_merged_like_peft_does():
    from agentrl.rollout.hf_engine import HFEngine
    from agentrl.trainer.lora import merged_weights

    model = lora_model()
    sent = dict(merged_weights(model))
    engine = HFEngine(small_llama(tied=False), pad_token_id=2)
    engine.update_weights(iter(sent.items()), version=1)
    sequences, masks, _ = UNEVEN
    trained = batched_logprobs(model, sequences[:1], masks[:1], 2, 1.0, 4096)[0][PROMPT_TOKENS:]
    torch.testing.assert_close(torch.tensor(engine.score(sequences[0], PROMPT_TOKENS)), torch.tensor(trained),
                               atol=1e-5, rtol=0)
    merged = model.merge_and_unload().state_dict()
    assert sorted(sent) == sorted(merged)
    assert all(torch.equal(tensor, merged[name]) for name, tensor in sent.items())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert not torch.equal(sent[name], small_llama(tied=False).state_dict()[name])


@pytest.mark.parametrize("targets, adapted, tied_to", [
    (["embed_tokens", "q_proj"], "model.embed_tokens", "lm_head"),
    (["lm_head"], "lm_head", "model.embed_tokens"),
    (".*embed_tokens", "model.embed_tokens", "lm_head"),
])
def test_lora_on_a_weight_the_embeddings_share_with_the_head_is_refused(targets, adapted, tied_to):
    """peft would adapt one of the two modules: the trainer would run W + B·A in one and W in the
    other while the engine, tying the merged weight it receives, runs W + B·A in both (on the
    embeddings a logprob gap of 2.5 after three steps; on the head the sync stopped)."""
    from agentrl.config import LoraSettings
    from agentrl.errors import ConfigError
    from agentrl.trainer.lora import add_lora, is_lora

    model = small_llama()
    with pytest.raises(ConfigError) as error:
        add_lora(model, LoraSettings(rank=4, target_modules=targets), "/nonexistent")
    assert str(error.value) == (
        f"model.lora.target_modules: '{adapted}' shares its weight with '{tied_to}' (the model ties its input "
        "embeddings and output head); LoRA would adapt it in one of them only while the engines run the merged "
        "weight in both, so leave both out")
    assert not is_lora(model) and type(model.lm_head) is torch.nn.Linear  # refused before peft changed it
    # Every linear layer but the head is fine on a tied model; the embeddings on an untied one.
    assert is_lora(add_lora(small_llama(), LoraSettings(rank=4), "/nonexistent"))
    assert is_lora(add_lora(small_llama(tied=False), LoraSettings(rank=4, target_modules=targets), "/nonexistent"))


def test_lora_on_a_lora_adapter_saves_one_that_loads_as_trained_from_anywhere(tmp_path, tiny_model_dir, tokenizer,
                                                                            monkeypatch):
    """LoRA RL from a LoRA SFT adapter (model.path given relative, as the quickstart's is) used to
    save adapters whose recorded base was the raw model, or the relative path as given: `final/`
    then loaded without the SFT adapter (eval scored another model) or not at all elsewhere."""
    import os

    from agentrl.config import LoraSettings
    from agentrl.models import load_model
    from agentrl.trainer.checkpoint import save_model
    from agentrl.trainer.lora import add_lora, merged_weights

    monkeypatch.chdir(tmp_path)
    sft = add_lora(load_model(os.path.relpath(tiny_model_dir)), LoraSettings(rank=4), os.path.relpath(tiny_model_dir))
    torch.manual_seed(0)
    for name, p in sft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # a trained SFT adapter: B is no longer zero
    save_model(sft, tokenizer, "runs/sft")
    policy = add_lora(load_model("runs/sft"), LoraSettings(rank=4), "runs/sft")
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # and the RL adapter trained on top of it
    trained = dict(merged_weights(policy))
    save_model(policy, tokenizer, "runs/rl/final")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    reloaded = load_model(str(tmp_path / "runs/rl/final")).state_dict()
    assert max((reloaded[name] - tensor).abs().max().item() for name, tensor in trained.items()) < 1e-6


def test_lora_adapters_start_from_the_seed_not_from_the_processs_random_state():
    """Each process's default torch seed is random: the adapters' A matrices (and so every LoRA run,
    and each FSDP rank's shard of them) used to differ between runs of the same recipe."""
    from agentrl.config import LoraSettings
    from agentrl.trainer.lora import add_lora

    def lora_a(process_seed: int, seed: int) -> torch.Tensor:
        model = small_llama(tied=False)  # the same weights each time (it seeds itself)
        torch.manual_seed(process_seed)
        model = add_lora(model, LoraSettings(rank=4), "/nonexistent", seed=seed)
        after = torch.rand(1)  # the caller's random stream is left where it was
        torch.manual_seed(process_seed)
        assert torch.equal(after, torch.rand(1))
        return torch.cat([p.flatten() for n, p in model.named_parameters() if "lora_A" in n])

    assert torch.equal(lora_a(1, seed=0), lora_a(2, seed=0)) and not torch.equal(lora_a(1, seed=0), lora_a(1, seed=3))


def test_lora_target_modules_that_match_nothing_are_a_config_error():
    from agentrl.config import LoraSettings
    from agentrl.errors import ConfigError
    from agentrl.trainer.lora import add_lora

    with pytest.raises(ConfigError) as error:
        add_lora(small_llama(), LoraSettings(rank=4, target_modules=["nosuch"]), "/nonexistent")
    assert str(error.value) == ("model.lora.target_modules: peft cannot adapt ['nosuch'] in this model (Target "
                                "modules {'nosuch'} not found in the base model. Please check the target modules "
                                "and try again.)")


def test_a_lora_weight_that_cannot_be_merged_stops_the_sync(monkeypatch):
    import agentrl.trainer.lora as lora

    with pytest.raises(RuntimeError, match=r"^model\.embed_tokens\.lora_magnitude_vector\.default"
                                           r"\.weight: a LoRA tensor this weight sync cannot merge"):
        dict(lora.merged_weights(lora_model(use_dora=True)))
    everything = lora.full_tensors
    monkeypatch.setattr(lora, "full_tensors", lambda model: ((name, tensor) for name, tensor in everything(model)
                                                             if "layers.1.self_attn.q_proj.lora_B" not in name))
    with pytest.raises(RuntimeError, match=r"^LoRA merge incomplete: model\.layers\.1\.self_attn\.q_proj has only "
                                           r"\['A', 'W'\]$"):
        dict(lora.merged_weights(lora_model()))


def test_metrics_are_means_over_the_steps_that_ran():
    """One episode dealt into two mini-batches is one optimizer step (the empty part is skipped, as
    when failed episodes were left out): its metrics are that step's, not halved."""
    sequences, masks, advantages = (rows[:1] for rows in UNEVEN)
    metrics = []
    for mini_batches in (1, 2):
        policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, mini_batches=mini_batches)
        policy_metrics = policy.update(sequences, masks, advantages, old_logprobs=policy.logprobs(sequences, masks))
        critic = CriticWorker(ValueModel(small_llama().get_decoder()), 2, lr=1e-3, value_clip=0.2,
                              mini_batches=mini_batches)
        returns = [[float(m) for m in masks[0]]]
        metrics.append(policy_metrics | critic.update(sequences, masks, returns, critic.values(sequences, masks)))
    # The policy's loss is -advantage (ratio 1) and the critic's 0.5 · (0 - 1)²: the step that ran.
    assert (metrics[0]["loss"], metrics[0]["value_loss"]) == (-1.0, 0.5)
    assert metrics[0]["grad_norm"] == pytest.approx(4.098, abs=1e-3)
    assert metrics[0]["critic_grad_norm"] == pytest.approx(4.429, abs=1e-3)
    assert metrics[1] == metrics[0]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_clip_fraction_and_approx_kl_do_not_depend_on_the_micro_batches(aggregation):
    # Old logprobs 0.5 below on each row's first 4 trained tokens: those ratios (e^0.5) are clipped.
    sequences, masks, advantages = group((12, 40, 8, 25), (1.0, 1.0, 1.0, 1.0))
    results = []
    for budget in (64, 100_000):  # a row per micro-batch, then all rows in one
        policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, aggregation=aggregation,
                              micro_batch_tokens=budget)
        old = [[value - 0.5 * (PROMPT_TOKENS <= t < PROMPT_TOKENS + 4) for t, value in enumerate(row)]
               for row in policy.logprobs(sequences, masks)]
        metrics = policy.update(sequences, masks, advantages, old_logprobs=old)
        results.append((metrics["clip_fraction"], metrics["approx_kl"], metrics["loss"]))
    # 16 clipped tokens of 12 + 40 + 8 + 25 = 85 trained; approx KL 0.5 · 0.5² on each of the 16
    assert results[0][0] == pytest.approx(16 / 85) and results[1][0] == pytest.approx(16 / 85)
    assert results[0][1] == pytest.approx(16 * 0.125 / 85) and results[1][1] == pytest.approx(16 * 0.125 / 85)
    assert results[0][2] == pytest.approx(results[1][2], rel=1e-5)


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_named(capsys):
    sequences, masks, advantages = UNEVEN
    policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0)
    before = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    nan_advantages = [[math.nan if m else 0.0 for m in row] for row in masks]  # a NaN that reached the loss
    metrics = policy.update(sequences, masks, nan_advantages)
    assert metrics["skipped_step_fraction"] == 1.0 and metrics["grad_norm"] == 0.0
    assert "agentrl: warning: the policy's gradient norm is nan; this optimizer step is skipped" in capsys.readouterr().err
    assert all(torch.equal(tensor, policy.model.state_dict()[name]) for name, tensor in before.items())
    metrics = policy.update(sequences, masks, advantages)  # the next step trains as usual
    assert metrics["skipped_step_fraction"] == 0.0 and metrics["grad_norm"] > 0
    assert any(not torch.equal(tensor, policy.model.state_dict()[name]) for name, tensor in before.items())


def test_ranks_metrics_merge_into_the_global_values():
    from agentrl.trainer.ray_groups import merge_metrics

    # Each rank's loss is its part of the global loss; the norm and a skipped step are the same on
    # every rank (two ranks that both skipped did not skip twice).
    ranks = [{"loss": 0.25, "grad_norm": 0.0, "skipped_step_fraction": 1.0, "engine_k3_max": 0.5},
             {"loss": 0.5, "grad_norm": 0.0, "skipped_step_fraction": 1.0, "engine_k3_max": 0.75}]
    assert merge_metrics(ranks) == {"loss": 0.75, "grad_norm": 0.0, "skipped_step_fraction": 1.0,
                                    "engine_k3_max": 0.75}


def _scaled_head(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():  # logits of a realistic size (tens), where scaling and capping show
        model.get_output_embeddings().weight.mul_(30)
    return model.eval()


def test_logprobs_follow_what_a_models_forward_does_to_its_logits():
    """Granite divides the head's logits, Gemma 2 soft-caps them: the trainer's logprobs used to
    skip that (up to 12 nats off) while the engine sampled from the model's forward. A forward that
    does something else is refused by name before any work."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    from agentrl.errors import ConfigError
    from agentrl.trainer.logprobs import check_logit_head, pad_sequences

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    sequence = torch.randint(3, 128, (12,)).tolist()
    for model in (GraniteForCausalLM(GraniteConfig(**shape, logits_scaling=8.0)),
                  Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8, final_logit_softcapping=2.0))):
        _scaled_head(model)
        check_logit_head(model, "model.path")
        with torch.no_grad():
            ours, _ = token_logprobs(model, pad_sequences([sequence], [[0] * 4 + [1] * 8], 0), temperature=0.7)
            logits = model(torch.tensor([sequence])).logits[0, 3:-1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[4:])[:, None]).squeeze(1)
        torch.testing.assert_close(ours[0, 4:], expected, atol=1e-5, rtol=0)

    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    doubled = _scaled_head(DoubledLogits(LlamaConfig(**shape)))
    with pytest.raises(ConfigError, match=r"^model.path: DoubledLogits's forward changes the logits after its "
                                          r"output head in a way the trainer does not reproduce"):
        check_logit_head(doubled, "model.path")
    assert doubled.training is False


def test_an_adapter_of_a_builtin_model_records_its_name_not_this_machines_cache(tmp_path):
    """The cache directory differs between machines (AGENTRL_CACHE); the name loads on any of them."""
    import json

    from agentrl.config import LoraSettings
    from agentrl.trainer.lora import add_lora
    from tests.conftest import make_tiny_llama

    # saved as save_model saves adapters: without peft's hub lookup of the base (test_train.py)
    add_lora(make_tiny_llama(), LoraSettings(rank=4), "smollm2-135m-instruct").save_pretrained(
        tmp_path / "builtin", save_embedding_layers=False)
    config = json.loads((tmp_path / "builtin" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"
    make_tiny_llama().save_pretrained(tmp_path / "base")
    add_lora(make_tiny_llama(), LoraSettings(rank=4), str(tmp_path / "base")).save_pretrained(
        tmp_path / "local", save_embedding_layers=False)
    config = json.loads((tmp_path / "local" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())


def test_fsdp_finds_the_blocks_of_models_that_do_not_call_them_layers():
    """Each block is sharded on its own: GPT-2 keeps them in `transformer.h`, and used to stop with
    'no decoder layers found to shard'."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from agentrl.trainer.distributed import decoder_layers

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=2))
    assert decoder_layers(gpt2) == list(gpt2.transformer.h)
    llama = small_llama()
    assert decoder_layers(llama) == list(llama.model.layers)
    assert decoder_layers(ValueModel(small_llama().get_decoder()))[0].__class__.__name__ == "LlamaDecoderLayer"
    adapted = lora_model()
    assert decoder_layers(adapted) == list(adapted.base_model.model.model.layers)


def test_fsdp_shards_the_outermost_blocks_when_the_list_names_nested_ones():
    """MBart's list also names its attention, inside each decoder layer: sharding both, parent
    first, broke the forward pass."""
    from transformers import MBartConfig, MBartForCausalLM

    from agentrl.trainer.distributed import decoder_layers

    mbart = MBartForCausalLM(MBartConfig(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=2,
                                         decoder_ffn_dim=64, encoder_layers=1))
    assert "MBartAttention" in mbart._no_split_modules
    assert decoder_layers(mbart) == list(mbart.model.decoder.layers)


def test_rollout_is_cap_weights_each_tokens_surrogate_by_the_engines_logprobs():
    # The engine found each row's first 4 trained tokens e times less likely than the trainer does
    # (weight e, capped at 2) and the rest as likely (weight 1); ratio 1 and advantage 1 everywhere,
    # so the token-mean loss is minus the mean weight: -(16 · 2 + 69 · 1) / 85.
    sequences, masks, advantages = group((12, 40, 8, 25), (1.0, 1.0, 1.0, 1.0))
    results = {}
    for cap in (None, 2.0):
        policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, rollout_is_cap=cap)
        trainer = policy.logprobs(sequences, masks)
        engine = [[value - 1.0 * (PROMPT_TOKENS <= t < PROMPT_TOKENS + 4) for t, value in enumerate(row)]
                  for row in trainer]
        results[cap] = policy.update(sequences, masks, advantages, rollout_logprobs=engine)
    assert results[2.0]["loss"] == pytest.approx(-(16 * 2 + 69) / 85, rel=1e-5)
    assert results[2.0]["rollout_is_weight_mean"] == pytest.approx((16 * 2 + 69) / 85, rel=1e-5)
    assert results[2.0]["rollout_is_truncated_fraction"] == pytest.approx(16 / 85)
    assert results[None]["loss"] == pytest.approx(-1.0, rel=1e-5) and "rollout_is_weight_mean" not in results[None]
    assert results[2.0]["rollout_logprob_diff"] == pytest.approx(16 / 85, rel=1e-4)
    policy = PolicyWorker(small_llama(), 2, lr=1e-3, temperature=1.0, rollout_is_cap=2.0)
    with pytest.raises(ValueError, match="rollout_is_cap weights tokens by the engine's logprobs"):
        policy.update(sequences, masks, advantages)


def test_a_resumed_rollout_worker_takes_the_engines_stream_only_where_it_fits(tiny_model_dir, capsys):
    """A resume that changed engine.name or engine.device (allowed, with a warning) crashed after
    every model had loaded: SGLang's engine has no `generator` (AttributeError), and a CPU
    generator refuses a CUDA one's state (RuntimeError)."""
    from agentrl.recipe import load_recipe
    from agentrl.rollout.worker import RolloutWorker

    worker = RolloutWorker(load_recipe("recipes/rollout_cpu.yaml", [f"model.path={tiny_model_dir}",
                                                                    "model.dtype=float32"]))
    capsys.readouterr()  # what loading the engine printed
    saved = worker.rng_state()
    draws = lambda: (torch.rand(3, generator=worker.seeds).tolist(),  # noqa: E731
                     torch.rand(3, generator=worker.engine.generator).tolist())
    first = draws()
    worker.set_rng_state(saved)
    assert draws() == first and capsys.readouterr().err == ""
    worker.set_rng_state({"episodes": saved["episodes"], "engine": torch.zeros(16, dtype=torch.uint8)})  # CUDA's size
    assert torch.rand(3, generator=worker.seeds).tolist() == first[0]  # the episodes' stream still resumes
    assert "the checkpoint's engine sampling stream does not fit this engine" in capsys.readouterr().err
    worker.engine = object()  # an engine with no stream of its own (SGLang's)
    worker.set_rng_state(saved)
    assert torch.rand(3, generator=worker.seeds).tolist() == first[0]
    assert capsys.readouterr().err.endswith("(the engine keeps no sampling stream of its own): requests without a "
                                            "seed sample anew\n")


def test_one_module_name_as_a_string_is_refused_with_what_to_write():
    """peft takes a string as a regex over the whole module path: `target_modules: q_proj` matched
    nothing, and the error only said peft could not adapt 'q_proj'."""
    from agentrl.config import LoraSettings
    from agentrl.errors import ConfigError
    from agentrl.trainer.lora import add_lora, is_lora

    with pytest.raises(ConfigError) as error:
        add_lora(small_llama(), LoraSettings(rank=4, target_modules="q_proj"), "/nonexistent")
    assert str(error.value).startswith("model.lora.target_modules: peft cannot adapt 'q_proj' in this model (")
    assert str(error.value).endswith("; one name is a regular expression over a module's whole path, so to adapt "
                                     "the modules named 'q_proj' give the list [q_proj]")
    assert is_lora(add_lora(small_llama(), LoraSettings(rank=4, target_modules=["q_proj"]), "/nonexistent"))
    assert is_lora(add_lora(small_llama(), LoraSettings(rank=4, target_modules=r".*\.q_proj"), "/nonexistent"))
