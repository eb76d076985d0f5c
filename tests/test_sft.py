"""SFT samples use the rollout token layout: only assistant tokens carry loss; one step learns."""

from __future__ import annotations

import torch

from agentrl.rollout.chat import ChatRenderer
from agentrl.tools.builtin.calculator import calculator
from agentrl.trainer.logprobs import pad_sequences, token_logprobs
from agentrl.trainer.sft import conversation_sample, sft_train

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 * 34?"},
            {"role": "assistant", "content": CALL}, {"role": "tool", "name": "calculator", "content": "408"},
            {"role": "assistant", "content": "It is 408."}]


def test_only_assistant_tokens_carry_loss(tokenizer):
    sample = conversation_sample(ChatRenderer(tokenizer, [calculator]), MESSAGES)
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=[calculator.schema], tokenize=False)
    assert tokenizer.decode(sample.token_ids) + "\n" == rendered
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
    expected = (tokenizer(CALL, add_special_tokens=False)["input_ids"] + [2]
                + tokenizer("It is 408.", add_special_tokens=False)["input_ids"] + [2])
    assert trained == expected
    # The tool result, the '\n' after each <|im_end|> and every role header are masked out.
    masked_text = tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask) if not m])
    assert "408\n</tool_response>" in masked_text and "<|im_start|>assistant\n" in masked_text
    assert masked_text.count("<|im_end|>") == 3  # system, user and tool turns; the assistant's are trained


def test_sft_steps_raise_demonstration_likelihood(tokenizer, tiny_model):
    sample = conversation_sample(ChatRenderer(tokenizer, [calculator]), MESSAGES)
    batch = pad_sequences([sample.token_ids], [sample.loss_mask], tokenizer.pad_token_id)

    def nll() -> float:
        with torch.no_grad():
            return -(token_logprobs(tiny_model, batch)[0] * batch.mask_BT).sum().item()

    before = nll()
    losses = sft_train(tiny_model, [sample], tokenizer.pad_token_id, steps=3, batch_size=1, lr=1e-2)
    assert nll() < before and losses[-1] < losses[0]


def test_openai_style_tool_calls_are_trained(tokenizer):
    """`content: null` with `tool_calls` (JSON-string arguments, as the OpenAI API sends them) trains
    on the call as the template renders it, not on an empty turn."""
    openai_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "12 * 34"}'}}]}
    messages = MESSAGES[:2] + [openai_call] + MESSAGES[3:]
    sample = conversation_sample(ChatRenderer(tokenizer, [calculator]), messages)
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
    expected = (tokenizer(CALL, add_special_tokens=False)["input_ids"] + [2]
                + tokenizer("It is 408.", add_special_tokens=False)["input_ids"] + [2])
    assert trained == expected
    # The same ids as the text-form conversation: both render to the same tokens.
    assert sample.token_ids == conversation_sample(ChatRenderer(tokenizer, [calculator]), MESSAGES).token_ids
