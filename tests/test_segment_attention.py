"""Segmented attention for packed rows (agentrl/trainer/segment_attention.py): only the query-key
pairs a packed row allows, with the logprobs and gradients of running every row in full."""

from __future__ import annotations

import pytest
import torch

from agentrl.trainer import packing, segment_attention
from agentrl.trainer.logprobs import pad_sequences, padded_micro_batches, token_logprobs
from agentrl.trainer.packing import PackCost, PackedRow, enable_packing
from agentrl.trainer.segment_attention import segment_plan

from conftest import make_tiny_llama


@pytest.fixture(autouse=True)
def segments_at_any_width(monkeypatch):
    """These rows are a few dozen tokens wide; the trainer segments only micro-batches of 384
    columns and more, where the three calls' pairs are well below the mask's (tested below)."""
    monkeypatch.setattr(packing, "MIN_SEGMENTED_WIDTH", 0)
    monkeypatch.setattr(packing, "MIN_PAIRS_SAVED", 0)


def two_groups_and_a_lone_row():
    """Rows of a 20-token prompt (5, 11 and 8 tokens after it, row 1 with a masked tool span), rows
    of a 14-token prompt (3 and 9 after it), and a 25-token row alone: one micro-batch of three
    packed rows of different lengths (so two are padded)."""
    generator = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 49000, (n,), generator=generator).tolist()

    a, b = tokens(20), tokens(14)
    sequences = [a + tokens(5), a + tokens(11), a + tokens(8), b + tokens(3), b + tokens(9), tokens(25)]
    masks = [[0] * 20 + [1] * (len(s) - 20) for s in sequences[:3]]
    masks[1][24:27] = [0, 0, 0]
    masks += [[0] * 14 + [1] * (len(s) - 14) for s in sequences[3:5]] + [[0] * 5 + [1] * 20]
    plan = [[PackedRow([0, 1, 2], 19, 19 + 6 + 12 + 9), PackedRow([3, 4], 13, 13 + 4 + 10), PackedRow([5], 0, 25)]]
    return sequences, masks, plan


def test_the_segment_plan_lays_out_prompts_members_and_padding():
    """Rows 46 wide: the first group's prompt (19 kept) and members of 6, 12 and 9 own tokens; the
    second's (13) and members of 4 and 10 from flat position 46 + 13; the lone row all prompt."""
    sequences, masks, plan = two_groups_and_a_lone_row()
    layout = next(padded_micro_batches(plan, sequences, masks, 2, "cpu"))[1].packed.segments
    assert (layout.prompt, layout.prompt_lengths.tolist()) == (25, [19, 13, 25])
    assert layout.own_index.tolist() == [
        [*range(19, 25)] + [24] * 6, [*range(25, 37)], [*range(37, 46)] + [45] * 3,
        [*range(59, 63)] + [62] * 8, [*range(63, 73)] + [72] * 2]
    assert layout.own_real.sum(1).tolist() == [6, 12, 9, 4, 10]
    assert layout.member_index.tolist() == [[*range(19, 46)], [*range(59, 73)] + [46] * 13, [92] * 27]
    assert layout.member_real.sum(1).tolist() == [27, 14, 0]
    assert layout.member_out.tolist() == [*range(19, 46), *range(59, 73)]
    assert layout.prompt_flat.tolist() == [*range(19), *range(25, 38), *range(50, 75)]
    assert layout.prompt_out.tolist() == [*range(19), *range(46, 59), *range(92, 117)]
    mask = layout.prompt_mask(torch.float32)[:, 0, 0]
    assert [(row == 0).sum().item() for row in mask] == [19, 13, 25] and mask[0, 19] == float("-inf")
    # Pairs: 3 rows × 25 × (25 + 27) for the prompts and the members over them, 5 × 12² for the
    # members over themselves: 4620, against 3 × 46² = 6348 under the mask.
    assert layout.pairs() == 3 * 25 * 52 + 5 * 144
    same = segment_plan([5, 5], [[2], [3]], 10, "cpu")
    assert same.prompt_mask(torch.float32) is None  # equal prompts: the members' call needs no mask
    assert segment_plan([5, 7], [[], []], 10, "cpu") is None
    with pytest.raises(ValueError, match="row 1 .* does not fit 10 columns"):
        segment_plan([5, 5], [[2], [3, 3]], 10, "cpu")


def test_micro_batches_where_segments_do_not_pay_keep_the_mask():
    sequences, masks, plan = two_groups_and_a_lone_row()

    def segments():
        return next(padded_micro_batches(plan, sequences, masks, 2, "cpu"))[1].packed.segments

    packing.MIN_SEGMENTED_WIDTH = 47  # narrower than that: one masked call
    assert segments() is None
    packing.MIN_SEGMENTED_WIDTH, packing.MIN_PAIRS_SAVED = 0, 1.37  # 4620 × 1.37 = 6329 < 6348
    assert segments() is not None
    packing.MIN_PAIRS_SAVED = 1.38  # the lone row widens every row's prompt call: 6376 > 6348
    assert segments() is None


def run(model, batch):
    logprobs_BT, entropy_BT = token_logprobs(model, batch, temperature=0.8, entropy_grad=True)
    ((logprobs_BT * batch.mask_BT).sum() + entropy_BT.sum() * 0.1).backward()
    return logprobs_BT.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_segmented_packed_rows_give_the_full_rows_logprobs_and_gradients(monkeypatch):
    sequences, masks, plan = two_groups_and_a_lone_row()
    full = run(make_tiny_llama(), pad_sequences(sequences, masks, pad_id=2))
    model = make_tiny_llama()
    cost = enable_packing(model)
    assert model.config._attn_implementation == segment_attention.NAME and cost.segmented

    def no_fallback(*args, **kwargs):
        raise AssertionError("a packed pass fell back to SDPA with the 4D mask")

    monkeypatch.setattr(segment_attention, "sdpa_attention_forward", no_fallback)
    idx, batch = next(padded_micro_batches(plan, sequences, masks, 2, "cpu"))
    assert idx == [0, 1, 2, 3, 4, 5] and batch.packed is not None
    packed = run(model, batch)
    torch.testing.assert_close(packed[0], full[0], atol=1e-5, rtol=0)
    for name, grad in full[1].items():
        torch.testing.assert_close(packed[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert all(grad.abs().sum() > 0 for grad in packed[1].values())


def test_one_token_members_and_lone_rows_shorter_than_a_prompt(monkeypatch):
    """A member whose own part is one token (the prompt's last), a lone row shorter than the
    longest prompt beside one longer than every packed row, and equal results in float32."""
    generator = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 49000, (n,), generator=generator).tolist()

    a = tokens(30)
    sequences = [a[:], a + tokens(4), tokens(8), tokens(40)]
    masks = [[0] * 30, [0] * 30 + [1] * 4, [0, 0] + [1] * 6, [0] * 3 + [1] * 37]
    plan = [[PackedRow([0, 1], 29, 29 + 1 + 5), PackedRow([2], 0, 8), PackedRow([3], 0, 40)]]
    full = run(make_tiny_llama(), pad_sequences(sequences, masks, pad_id=2))
    model = make_tiny_llama()
    enable_packing(model)
    monkeypatch.setattr(segment_attention, "sdpa_attention_forward", None)  # a fallback would fail
    _, batch = next(padded_micro_batches(plan, sequences, masks, 2, "cpu"))
    assert batch.packed.segments.own_real.sum(1).tolist() == [1, 5]
    packed = run(model, batch)
    torch.testing.assert_close(packed[0], full[0], atol=1e-5, rtol=0)
    for name, grad in full[1].items():
        torch.testing.assert_close(packed[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_segmented_attention_runs_in_bf16_under_autocast(monkeypatch):
    """Under bf16 autocast (the trainer's CPU setting where bf16 is fast) the attention kernels get
    bf16 queries, keys and values (the rotary embedding leaves queries in float32, so they are
    cast, as SDPA's autocast does), and the logprobs stay within bf16 rounding of float32's."""
    sequences, masks, plan = two_groups_and_a_lone_row()
    _, batch = next(padded_micro_batches(plan, sequences, masks, 2, "cpu"))
    model = make_tiny_llama()
    enable_packing(model)
    with torch.no_grad():
        exact, _ = token_logprobs(model, batch)
    dtypes = set()
    flash = segment_attention._flash

    def recording(q, k, v, *args, **kwargs):
        dtypes.add((q.dtype, k.dtype, v.dtype))
        return flash(q, k, v, *args, **kwargs)

    monkeypatch.setattr(segment_attention, "_flash", recording)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rounded, _ = token_logprobs(model, batch)
    assert dtypes == {(torch.bfloat16,) * 3}
    torch.testing.assert_close(rounded, exact, atol=0.05, rtol=0)
    assert not torch.equal(rounded, exact)
    # The backward in bf16 points where float32's does: cosine of the flattened gradients.
    gradients = []
    for autocast in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logprobs_BT, _ = token_logprobs(model, batch)
        (logprobs_BT * batch.mask_BT).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.nn.functional.cosine_similarity(*gradients, dim=0) > 0.99


def test_segmented_packing_joins_every_member_that_fits():
    """With segmented attention a member's pairs are the same in a packed row as in a row of its
    own, so every member of a prompt joins (the masked cost model splits these four, see
    test_train.py), within the token budget; rows that share nothing never join."""
    from agentrl.trainer.packing import packed_rows

    long = [[3] * 20 + [10 + k] * 60 for k in range(4)]
    long_masks = [[0] * 20 + [1] * 60] * 4
    segmented = PackCost(1.0, 0.001, segmented=True)
    assert packed_rows([0, 1, 2, 3], long, long_masks, segmented) == [PackedRow([0, 1, 2, 3], 19, 263)]
    assert packed_rows([0, 1, 2, 3], long, long_masks, segmented, token_budget=202) == [
        PackedRow([0, 1, 2], 19, 202), PackedRow([3], 19, 80)]
    strangers = [[5] * 30, [6] * 30]
    assert packed_rows([0, 1], strangers, [[0] * 10 + [1] * 20] * 2, segmented) == [
        PackedRow([0], 0, 30), PackedRow([1], 0, 30)]


@pytest.mark.parametrize("implementation, device", [("eager", "cpu"), ("sdpa", "cpu"), ("sdpa", "meta")])
def test_enable_packing_installs_segments_only_on_sdpa_models_on_cpu(implementation, device):
    """A model on another device (`meta` stands in for a GPU here) keeps SDPA and the mask."""
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM._from_config(make_tiny_llama().config, attn_implementation=implementation)
    cost = enable_packing(model)
    installed = (implementation, device) == ("sdpa", "cpu")
    assert cost.segmented == installed
    assert model.config._attn_implementation == (segment_attention.NAME if installed else implementation)
    assert enable_packing(model) == cost  # a second call changes nothing
