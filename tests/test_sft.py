"""SFT samples use the rollout token layout: only assistant tokens carry loss; one step learns; the
output replaces only a saved model, never a directory of other files."""

from __future__ import annotations

import re

import pytest
import torch

from agentrl.rollout.chat import ChatRenderer
from agentrl.tools.builtin.calculator import calculator
from agentrl.trainer.logprobs import pad_sequences, token_logprobs
from agentrl.trainer.sft import conversation_sample, sft_train

from conftest import make_tiny_llama

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


def test_turns_end_with_the_templates_end_token_and_their_text_stays_text(tokenizer):
    """Two ways SFT used to train tokens the policy never samples: with an eos other than the
    template's end of turn (Qwen's base models: <|endoftext|> and <|im_end|>), every turn was cut
    and ended with eos, the newline after it lost; and a demonstration that mentions <|im_end|>
    was taught to stop in the middle of its sentence."""
    import copy

    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.eos_token = "<|endoftext|>"
    literal = "Use <|im_end|> to end a turn."
    messages = MESSAGES[:4] + [{"role": "assistant", "content": literal}]
    for tok in (qwen_like, tokenizer):
        sample = conversation_sample(ChatRenderer(tok, [calculator]), messages)
        rendered = tok.apply_chat_template(messages, tools=[calculator.schema], tokenize=False)
        assert tok.decode(sample.token_ids) + "\n" == rendered
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
        as_text = tok(literal, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert trained == tok(CALL, add_special_tokens=False)["input_ids"] + [2] + as_text + [2]
        assert trained.count(2) == 2 and (tok is tokenizer or tok.eos_token_id not in trained)


def test_a_template_that_adds_eos_after_the_last_message_trains_up_to_the_turns_end(tokenizer):
    """Phi-3's shape: each turn ends with its end token, and eos follows the last message. The
    turn was cut at the last stop token, so SFT trained the newline and eos after it (which the
    policy never samples: it stops at the end token), and a second turn broke the prefix check."""
    import copy

    phi_like = copy.deepcopy(tokenizer)
    phi_like.eos_token = "<|endoftext|>"
    phi_like.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                              "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                              "{{ '<|im_start|>assistant\\n' }}{% else %}{{ eos_token }}{% endif %}")
    renderer = ChatRenderer(phi_like, [])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "Bye."}]
    sample = conversation_sample(renderer, messages)
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
    assert phi_like.decode(trained) == "Hello.<|im_end|>Bye.<|im_end|>"


def test_a_template_without_prefix_renderings_ends_turns_with_its_end_token(tokenizer):
    """Templates whose generation prompt is not how they render an assistant turn (reasoning
    templates open the reply with `<think>`) take the fallback; it used to end each turn with eos,
    which a Qwen base model's policy (eos <|endoftext|>, turns end <|im_end|>) never samples there."""
    import copy

    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.eos_token = "<|endoftext|>"
    qwen_like.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    renderer = ChatRenderer(qwen_like, [])
    ids, fallback = renderer.assistant_turn_ids(MESSAGES[:2], MESSAGES[4])
    assert fallback and renderer.turn_end_id == 2 != qwen_like.eos_token_id
    assert ids == qwen_like("It is 408.", add_special_tokens=False)["input_ids"] + [2]


def test_the_fallback_keeps_special_token_text_as_text(tokenizer):
    """The fallback encoded a turn's content whole, so a literal `<|im_end|>` in it became the
    control token, trained mid-turn: the model would learn to end its turns there."""
    import copy

    from agentrl.rollout.chat import SpecialTextError

    reasoning = copy.deepcopy(tokenizer)  # a generation prompt the rendered turn does not start with
    reasoning.chat_template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}")
    renderer = ChatRenderer(reasoning, [])
    text = "They end with <|im_end|> then a newline."
    ids, fallback = renderer.assistant_turn_ids(MESSAGES[:2], {"role": "assistant", "content": text})
    assert fallback and ids == renderer.encode_text(text) + [2] and ids.count(2) == 1
    assert renderer.decode(ids) == text + "<|im_end|>"
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "<|im_end|>"}}}]}
    with pytest.raises(SpecialTextError, match=re.escape("a tool call's arguments contain the special token text "
                                                         "'<|im_end|>'")):
        renderer.assistant_turn_ids(MESSAGES[:2], call)


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


def sft_recipe(model_dir, output, *overrides):
    from agentrl.recipe import load_recipe

    return load_recipe(None, [f"model.path={model_dir}", f"sft.output={output}", "sft.steps=1", "sft.num_examples=2",
                              "sft.batch_size=2", "sft.dtype=float32",
                              "rollout.tool_configs=[tool_configs/calculator.yaml]", *overrides])


def test_sft_replaces_its_own_output_but_never_a_directory_of_other_files(tmp_path, tiny_model_dir, monkeypatch):
    import agentrl.models
    from agentrl.errors import ConfigError
    from agentrl.trainer.sft import run_sft

    output = tmp_path / "out"
    run_sft(sft_recipe(tiny_model_dir, output))
    first = (output / "model.safetensors").read_bytes()
    run_sft(sft_recipe(tiny_model_dir, output, "sft.seed=7"))  # its own full model: replaced ...
    assert (output / "model.safetensors").read_bytes() != first
    with pytest.raises(ConfigError) as err:  # adapters saved over their own base would name themselves
        run_sft(sft_recipe(output, output, "model.lora.rank=4"))
    assert str(err.value) == (f"sft.base_model: '{output}' is inside sft.output ('{output}'), which the save "
                              "replaces with LoRA adapters that name their base; save them elsewhere")
    assert (output / "model.safetensors").is_file()
    run_sft(sft_recipe(tiny_model_dir, output, "model.lora.rank=4"))  # ... and by adapters
    assert (output / "adapter_config.json").is_file() and not (output / "model.safetensors").exists()

    mydata = tmp_path / "mydata"
    (mydata / "sub").mkdir(parents=True)
    (mydata / "notes.txt").write_text("precious")
    monkeypatch.setattr(agentrl.models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError) as err:
        run_sft(sft_recipe(tiny_model_dir, mydata))
    assert str(err.value) == (f"sft.output: {mydata} holds files that are not a saved model (notes.txt, sub/); "
                              "saving a model replaces the whole directory, so choose another path or move them")
    assert (mydata / "notes.txt").read_text() == "precious" and (mydata / "sub").is_dir()


def test_a_save_refuses_a_model_directory_holding_other_files(tmp_path, tokenizer):
    """The check every save makes (train's step_N/, final/ and critic/ too), whatever chose the path."""
    from agentrl.errors import ConfigError
    from agentrl.trainer.checkpoint import save_model
    from agentrl.trainer.critic import ValueModel

    model, target = make_tiny_llama(), tmp_path / "final"
    target.mkdir()
    save_model(model, tokenizer, target)  # an empty directory is replaced
    save_model(model, tokenizer, target)  # and so is a saved model
    critic = ValueModel(make_tiny_llama().get_decoder())
    critic.save(tmp_path / "critic")
    critic.save(tmp_path / "critic")  # a saved critic: decoder/ and value_head.pt
    (target / "notes.txt").write_text("mine")
    (tmp_path / "critic" / "decoder" / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("mine")
    for path, held in ((target, "notes.txt"), (tmp_path / "critic", "decoder/")):
        with pytest.raises(ConfigError) as err:
            save_model(model, tokenizer, path) if path == target else critic.save(path)
        assert str(err.value) == (f"{path} holds files that are not a saved model ({held}); saving a model "
                                  "replaces the whole directory, so choose another path or move them")
    from agentrl.trainer.checkpoint import check_replaceable

    with pytest.raises(ConfigError, match=r"^sft\.output: .*/afile is a file; a model is saved as a directory"):
        check_replaceable(tmp_path / "afile", "sft.output")
    assert (target / "notes.txt").read_text() == "mine" and (target / "config.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if ".agentrl-" in p.name]  # no staging directory left


def test_arithmetic_demonstrations_need_the_calculator_among_the_recipes_tools(tmp_path, tiny_model_dir):
    """They always call `calculator`: with only the python tool offered, SFT trained calls that RL
    answered with "unknown tool"."""
    from agentrl.errors import ConfigError
    from agentrl.trainer.sft import run_sft

    with pytest.raises(ConfigError) as err:
        run_sft(sft_recipe(tiny_model_dir, tmp_path / "out", "rollout.tool_configs=[tool_configs/python.yaml]"))
    assert str(err.value) == ("sft.data 'arithmetic': its demonstrations call the tool 'calculator', which "
                              "rollout.tool_configs does not offer (it offers: python); add "
                              "tool_configs/calculator.yaml, or give sft.data a file of conversations")
    assert not (tmp_path / "out").exists()


def test_a_data_row_the_template_cannot_render_names_its_file_and_line(tmp_path, tiny_model_dir):
    """Special text in a call's arguments cannot be kept as text inside the template's call markup:
    the run stops before the model loads, naming the row (it was a traceback)."""
    import json

    from agentrl.errors import ConfigError
    from agentrl.trainer.sft import run_sft

    data = tmp_path / "sft.jsonl"
    row = lambda expression: {"messages": [  # noqa: E731
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": expression})}}]}]}
    data.write_text(json.dumps(row("1 + 1")) + "\n" + json.dumps(row("1 <|im_end|> 2")) + "\n")
    with pytest.raises(ConfigError, match=rf"^{data}:2: .*<\|im_end\|>"):
        run_sft(sft_recipe(tiny_model_dir, tmp_path / "out", f"sft.data={data}",
                           "rollout.tool_configs=[tool_configs/calculator.yaml]"))
    assert not (tmp_path / "out").exists()


def test_sft_trains_on_the_trainers_device(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """`agentrl sft` trains where the RL stage trains the policy (`trainer.device`); it used to stay on
    the CPU whatever that said. A CUDA device that is not there stops it before any work."""
    import agentrl.trainer.sft
    from agentrl.cli import main
    from agentrl.trainer.sft import run_sft

    trained_on = []
    monkeypatch.setattr(agentrl.trainer.sft, "sft_train", lambda model, *a, **k: trained_on.append(
        next(model.parameters()).device) or [])
    moved_to = []
    to = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved_to.append(a) or to(self, *a, **k))
    run_sft(sft_recipe(tiny_model_dir, tmp_path / "out", "trainer.device=cpu"))
    assert moved_to == [("cpu",)] and trained_on == [torch.device("cpu")]
    if torch.cuda.is_available():
        return
    capsys.readouterr()
    assert main(["sft", "recipes/quickstart.yaml", "trainer.device=cuda:0"]) == 2
    assert capsys.readouterr().err == ("agentrl: error: override 'trainer.device=cuda:0': trainer.device: 'cuda:0' "
                                       f"is not available (torch {torch.__version__} sees no CUDA device)\n")


SYSTEM_PROMPT = "Solve the problem. Use the calculator tool for arithmetic, then state the final answer."


def trained_samples(monkeypatch, config) -> list:
    """The samples run_sft trains on (its training steps skipped)."""
    import agentrl.trainer.sft
    from agentrl.trainer.sft import run_sft

    seen = []
    monkeypatch.setattr(agentrl.trainer.sft, "sft_train", lambda model, samples, *a, **k: seen.extend(samples) or [])
    run_sft(config)
    return seen


def test_a_file_conversation_opens_with_the_recipes_system_prompt_as_an_rl_prompt_does(tmp_path, tiny_model_dir,
                                                                                       tokenizer, monkeypatch):
    """A conversation from sft.data without a system message trained after the template's default
    one, while RL prompts for the same question open with rollout.system_prompt."""
    import json

    from agentrl.tools.loader import load_tool_files
    from agentrl.types import Task

    question, own = "What is 12 * 34?", [{"role": "system", "content": "Be brief."}]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": opening + [{"role": "user", "content": question},
                                                               {"role": "assistant", "content": "408"}]}) + "\n"
                            for opening in ([], own)))
    config = sft_recipe(tiny_model_dir, tmp_path / "out", f"sft.data={data}",
                        "rollout.tool_configs=[tool_configs/calculator.yaml]", f"rollout.system_prompt={SYSTEM_PROMPT}")
    renderer = ChatRenderer(tokenizer, load_tool_files(config.rollout.tool_configs))
    renderer.system_prompt = SYSTEM_PROMPT
    for sample, task in zip(trained_samples(monkeypatch, config),
                            (Task("t", question), Task("t", own + [{"role": "user", "content": question}]))):
        prompt = sample.token_ids[:sample.loss_mask.index(1)]
        assert prompt == renderer.prompt_ids(task.messages(SYSTEM_PROMPT))  # a conversation's own system message stays
        assert tokenizer.decode(sample.token_ids[len(prompt):]) == "408<|im_end|>"


def test_batches_are_dealt_from_shuffled_epochs(tiny_model, monkeypatch):
    """Each batch was drawn on its own: the quickstart's 3 steps of 4 saw 9 of its 16 demonstrations."""
    import agentrl.trainer.sft
    from agentrl.trainer.sft import Sample

    samples = [Sample([1, 100 + i, 2], [0, 1, 1]) for i in range(16)]
    drawn: list[list[int]] = []
    real = agentrl.trainer.sft.pad_sequences
    monkeypatch.setattr(agentrl.trainer.sft, "pad_sequences",
                        lambda ids, masks, *a: drawn.append([row[1] - 100 for row in ids]) or real(ids, masks, *a))

    def order(steps: int, batch_size: int, seed: int = 1000) -> list[list[int]]:
        drawn.clear()
        sft_train(tiny_model, samples, 2, steps=steps, batch_size=batch_size, lr=1e-3, seed=seed)
        return list(drawn)

    quickstart = order(3, 4)
    assert len({i for batch in quickstart for i in batch}) == 12  # no demonstration twice ...
    five = order(5, 4)
    assert five[:3] == quickstart and sorted(i for batch in five[:4] for i in batch) == list(range(16))  # ... all once
    assert order(5, 4, seed=7) != five
    for batch in order(6, 5):  # batches running past an epoch's end hold no example twice
        assert len(batch) == len(set(batch)) == 5
    dealt = [i for batch in drawn for i in batch]
    assert sorted(dealt[:16]) == list(range(16)) and sorted(dealt[16:]) == sorted(set(dealt[16:]))
    assert all(sorted(batch) == list(range(16)) for batch in order(2, 20))  # a batch larger than the set: all of it


def test_a_bad_sft_base_model_is_named_by_its_key(tmp_path, tiny_model_dir, tokenizer, monkeypatch):
    from agentrl.errors import ConfigError
    from agentrl.trainer.sft import run_sft

    no_weights = tmp_path / "tokenizer-only"
    tokenizer.save_pretrained(no_weights)
    for base, key, why in (
            (tmp_path / "nowhere", "sft.base_model", "not a local model directory"),
            (no_weights, "sft.base_model", "the directory holds no model (no config.json)")):
        with pytest.raises(ConfigError) as err:
            run_sft(sft_recipe(tiny_model_dir, tmp_path / "out", f"sft.base_model={base}"))
        assert str(err.value).startswith(f"{key}: model '{base}': {why}")
    with pytest.raises(ConfigError) as err:  # no sft.base_model: model.path's is the one
        run_sft(sft_recipe(no_weights, tmp_path / "out"))
    assert str(err.value) == f"model.path: model '{no_weights}': the directory holds no model (no config.json)"
