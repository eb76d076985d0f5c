"""Training passes without the checkpoint's randomness, whatever the architecture calls it (OPT's
`dropout` and `layerdrop`, GPTBigCode's `attn_pdrop`, Starcoder2's `residual_dropout`, Mixtral's
router jitter), LoRA's adapter dropout kept, the warning for randomness left over; and the critic
on a mini-batch with nothing to train, and without a key/value cache. Models are tiny random
configs built here (a 500-token vocabulary, no tokenizer involved)."""

from __future__ import annotations

import pytest
import torch
import transformers

from agentrl.trainer.critic import CriticWorker, ValueModel
from agentrl.trainer.logprobs import disable_model_dropout
from agentrl.trainer.policy import PolicyWorker

VOCAB = 500
SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)


def opt_config(**options):
    return transformers.OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, **SMALL, **options)


CONFIGS = {  # each with the dropout its architecture applies outside nn.Dropout, as its checkpoints set it
    "opt": lambda: opt_config(dropout=0.1, attention_dropout=0.1, layerdrop=0.5),
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=VOCAB, attn_pdrop=0.1, resid_pdrop=0.1,
        embd_pdrop=0.1),
    "starcoder2": lambda: transformers.Starcoder2Config(
        hidden_size=64, intermediate_size=128, num_key_value_heads=2, residual_dropout=0.1, embedding_dropout=0.1,
        attention_dropout=0.1, **SMALL),
    "bloom": lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                              hidden_dropout=0.1, attention_dropout=0.1),
    "mixtral": lambda: transformers.MixtralConfig(  # router jitter: train-mode noise that is not called dropout
        hidden_size=64, intermediate_size=64, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.5, **SMALL),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager")


def two_training_passes(model: torch.nn.Module, held_off=()) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of two passes over the same tokens in train mode (`held_off` modules in eval mode)."""
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    model.train()
    for module in held_off:
        module.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model(input_ids=ids).logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_training_passes_are_the_same_whatever_the_architecture_calls_its_dropout(name, capsys):
    model = build(name)
    first, second = two_training_passes(model)
    assert not torch.equal(first, second)  # the configured randomness is real
    disable_model_dropout(model)
    first, second = two_training_passes(model)
    assert torch.equal(first, second)
    assert "warning" not in capsys.readouterr().err


def test_a_jitter_setting_that_shapes_eval_passes_too_is_kept():
    """PhiMoE routes by router_jitter_noise (0.01 in Phi-3.5-MoE) in eval mode as well: zeroed, the
    policy would be another model than the one the engine and the reference run."""
    config = transformers.PhimoeConfig(hidden_size=64, intermediate_size=64, num_key_value_heads=2,
                                       num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5,
                                       input_jitter_noise=0.0, **SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    disable_model_dropout(model)
    assert model.config.router_jitter_noise == 0.5
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, before)
    mixtral = build("mixtral")  # whose jitter is noise in training passes only: zeroed
    disable_model_dropout(mixtral)
    assert mixtral.config.router_jitter_noise == 0.0


def test_an_opt_policy_at_unchanged_weights_neither_clips_nor_drifts():
    """Old logprobs in eval mode, the update's pass in train mode: with OPT's own dropout left on,
    about half the tokens were clipped at lr 1e-12."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    sequences = [prompt + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (30, 25, 40, 35)]
    masks = [[0] * 20 + [1] * (len(s) - 20) for s in sequences]
    advantages = [[m * a for m in mask] for mask, a in zip(masks, (1.0, -1.0, 0.5, -0.5))]
    policy = PolicyWorker(build("opt"), 2, lr=1e-12, temperature=1.0, mini_batches=2)
    metrics = policy.update(sequences, masks, advantages, policy.logprobs(sequences, masks))
    assert metrics["clip_fraction"] == 0.0 and metrics["approx_kl"] < 1e-9  # the second step's weights moved by ~1e-12


def test_lora_dropout_stays_on_while_the_base_models_goes():
    from peft import LoraConfig, get_peft_model

    from agentrl.trainer.lora import peft_wrapping

    with peft_wrapping():
        model = get_peft_model(build("opt"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                        target_modules=["q_proj", "v_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, where the adapters' dropout would change nothing
            torch.nn.init.normal_(parameter, std=0.1)
    disable_model_dropout(model)
    adapters = [m for name, m in model.named_modules() if name.endswith("lora_dropout.default")]
    assert adapters and all(m.p == 0.5 for m in adapters) and model.peft_config["default"].lora_dropout == 0.5
    first, second = two_training_passes(model)
    assert not torch.equal(first, second)  # the adapters' dropout, a recipe setting, is on in training
    first, second = two_training_passes(model, held_off=adapters)
    assert torch.equal(first, second)  # and nothing else is
    assert model.base_model.model.config.dropout == 0.0 and model.base_model.model.config.layerdrop == 0.0


class Noise(torch.nn.Module):
    """Train-mode randomness under a name no rule knows."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.scale = inner, 0.5

    def forward(self, hidden):
        out = self.inner(hidden)
        return out + torch.randn_like(out) * self.scale if self.training else out


def test_randomness_left_in_training_passes_is_named_in_one_warning(capsys):
    model = build("opt")
    model.model.decoder.layers[0].fc2 = Noise(model.model.decoder.layers[0].fc2)
    model.eval()
    state = torch.random.get_rng_state()
    disable_model_dropout(model)
    err = capsys.readouterr().err
    assert err.count("agentrl: warning:") == 1
    assert "two training-mode forward passes of the same tokens through this 'opt' model differ" in err
    assert "PPO/GRPO importance ratios" in err
    # the check leaves the model's mode and the random state as they were
    assert not any(m.training for m in model.modules()) and torch.equal(torch.random.get_rng_state(), state)
    disable_model_dropout(model, rank=1)  # other ranks stay quiet
    assert capsys.readouterr().err == ""


def small_critic(**options) -> CriticWorker:
    return CriticWorker(ValueModel(build("opt").get_decoder()), 2, lr=1e-2, value_clip=None, **options)


def test_a_critic_mini_batch_with_nothing_to_train_moves_no_weight():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    sequences = [prompt + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 10)]
    masks = [[0] * 20 + [1] * (len(s) - 20) for s in sequences]
    critic = small_critic(weight_decay=0.1)
    critic.update(sequences, masks, [[1.0 * m for m in mask] for mask in masks], [[0.0] * len(s) for s in sequences])
    before = {name: tensor.clone() for name, tensor in critic.model.state_dict().items()}
    steps = {id(p): int(state["step"]) for p, state in critic.optimizer.state.items()}
    filled = list(range(3, 40))  # a prompt that filled the context: nothing was sampled
    metrics = critic.update([filled, filled], [[0] * 37] * 2, [[0.0] * 37] * 2, [[0.0] * 37] * 2)
    # Neither Adam's momentum nor the weight decay moved a weight: AdamW saw no gradient at all.
    assert all(torch.equal(tensor, critic.model.state_dict()[name]) for name, tensor in before.items())
    assert {id(p): int(state["step"]) for p, state in critic.optimizer.state.items()} == steps
    # Counted as the policy counts such a mini-batch: no loss, no gradient, not a skipped (non-finite) step.
    assert metrics == {"value_loss": 0.0, "critic_grad_norm": 0.0, "critic_skipped_step_fraction": 0.0}


def test_the_critic_builds_no_key_value_cache():
    critic = small_critic()
    calls = []
    critic.model.decoder.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    critic.values([list(range(3, 20))], [[0] * 5 + [1] * 12])
    assert calls and all(kwargs.get("use_cache") is False for kwargs in calls)
