"""Attention for packed rows on CPU that computes only the query-key pairs the packing allows.

A packed row (packing.py) is `[prompt | own_1 | own_2 | ...]`: the prompt attends causally to
itself, and member k's own tokens attend to the prompt and causally to their own earlier tokens.
SDPA with the 4D mask computes all L² pairs of the row and then masks most of them; here a
micro-batch's attention is three calls to the CPU flash-attention kernel:

- the packed rows' prompts, causal over the longest prompt's columns (a shorter prompt's extra
  columns are its members' tokens, computed and dropped: a causal prefix does not see what follows
  it);
- every member token over its row's prompt keys, a row's members as one block of queries (masked
  only past a row's own prompt, when the rows' prompts differ in length);
- each member's tokens over its own keys, causal, the members batched and padded at the end.

The last two halves of a member's attention are merged with their log-sum-exps (the softmax over
the union of the two key sets). A quickstart packed row (250 prompt tokens, 8 members of 80–190)
has ~1.8M pairs under the mask and ~0.6M here, padding included. The backward pass calls the
kernel's backward on each part with the merged output and log-sum-exp, which is that part's exact
share of the gradient (the identity ring attention uses). Over short rows the one masked call is
cheaper than three over pieces, and a row without members (its whole length a "prompt") next to
packed rows widens the prompt call for all of them; packing.py segments a micro-batch only when it
is wide enough and the three calls' pairs are well below the mask's (`SegmentPlan.pairs`).

Written against aten's CPU flash-attention ops because SDPA does not return the log-sum-exp the
merge needs. On other devices, for micro-batches without a plan, and with attention dropout, this
is transformers' SDPA attention with the mask. The plan reaches the attention through the
decoder's keyword arguments (transformers passes them on to every layer), so activation
checkpointing recomputes a layer with the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "agentrl_segments"
KEYWORD = "packed_segments"  # the decoder keyword that carries a micro-batch's SegmentPlan

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class SegmentPlan:
    """A micro-batch of G packed rows, W columns each, for segmented attention. Positions are flat,
    g * W + t. Row g's prompt is columns [0, prompt_lengths[g]) (a row without members is all
    prompt); its members' own tokens follow in order."""

    prompt: int  # the longest prompt: the prompt call runs columns [0, prompt) of every row
    prompt_lengths: torch.Tensor  # (G,)
    prompt_flat: torch.Tensor  # (Np,) the real prompt tokens' indices into the prompt call's G × prompt outputs
    prompt_out: torch.Tensor  # (Np,) their flat positions
    member_index: torch.Tensor  # (G, Q) each row's member tokens, padded at the end with the row's first position
    member_real: torch.Tensor  # (G, Q) bool
    own_index: torch.Tensor  # (M, E) each member's own tokens, padded at the end with its last one
    own_real: torch.Tensor  # (M, E) bool
    member_out: torch.Tensor  # (N,) every member token's flat position, rows and members in order
    # (G, 1, 1, prompt) bool, True past a row's own prompt; None when every prompt is `prompt` long.
    # Bool, not the additive float mask: FSDP's mixed precision casts the float tensors it finds in
    # a layer's inputs.
    beyond_prompt: torch.Tensor | None

    def prompt_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask for the members' call over the prompt keys."""
        if self.beyond_prompt is None:
            return None
        return torch.zeros(self.beyond_prompt.shape, dtype=dtype,
                           device=self.beyond_prompt.device).masked_fill(self.beyond_prompt, float("-inf"))

    def pairs(self) -> int:
        """Query-key pairs the three calls compute, padding included."""
        rows, queries = self.member_index.shape
        members, longest = self.own_index.shape
        return rows * self.prompt * (self.prompt + queries) + members * longest * longest


def segment_plan(prompts: list[int], members: list[list[int]], width: int,
                 device: torch.device | str) -> SegmentPlan | None:
    """The plan for rows of `width` columns: row g's prompt is `prompts[g]` tokens long and is
    followed by members of `members[g]` own tokens each. None when no row has members."""
    for g, lengths in enumerate(members):
        if prompts[g] < 1 or min(lengths, default=1) < 1 or prompts[g] + sum(lengths) > width:
            raise ValueError(f"segment_plan: row {g} (prompt {prompts[g]}, members {lengths}) does not fit "
                             f"{width} columns with a prompt and members of at least one token")
    own = []
    for g, lengths in enumerate(members):
        start = g * width + prompts[g]
        for n in lengths:
            own.append(list(range(start, start + n)))
            start += n
    if not own:
        return None
    rows = [[t for member in own if member[0] // width == g for t in member] for g in range(len(prompts))]
    longest, rows_longest, prompt = max(map(len, own)), max(1, max(map(len, rows))), max(prompts)

    def padded(lists: list[list[int]], size: int, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor([x + [pad] * (size - len(x)) for x, pad in zip(lists, pads)], device=device)
        real = torch.tensor([[True] * len(x) + [False] * (size - len(x)) for x in lists], device=device)
        return index, real

    member_index, member_real = padded(rows, rows_longest, [g * width for g in range(len(rows))])
    own_index, own_real = padded(own, longest, [member[-1] for member in own])
    lengths = torch.tensor(prompts, device=device)
    beyond = torch.arange(prompt, device=device) >= lengths[:, None]
    return SegmentPlan(
        prompt, lengths,
        torch.tensor([g * prompt + t for g, n in enumerate(prompts) for t in range(n)], device=device),
        torch.tensor([g * width + t for g, n in enumerate(prompts) for t in range(n)], device=device),
        member_index, member_real, own_index, own_real, torch.tensor([t for m in own for t in m], device=device),
        beyond[:, None, None, :] if bool(beyond.any()) else None)


def _gather(x_flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(R, H, C, D) from flat (G·W, H, D) tensors at an (R, C) index."""
    return x_flat[index].transpose(1, 2).contiguous()


def _real(o: torch.Tensor, lse: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real queries' outputs (N, H, D) and log-sum-exps (N, H) of an (R, H, C, ·) call."""
    return o.transpose(1, 2)[real], lse.transpose(1, 2)[real]


def _merged_in(o, lse, real, d_m, o_m, lse_m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded call's (grad, out, lse) for its backward: real queries carry the merged output and
    log-sum-exp and their gradient; padded ones keep their own (finite) values with zero gradient,
    so they contribute nothing."""
    d = torch.zeros_like(o).transpose(1, 2)
    d[real] = d_m
    o, lse = o.transpose(1, 2).clone(), lse.transpose(1, 2).clone()
    o[real], lse[real] = o_m, lse_m
    return (d.transpose(1, 2).contiguous(), o.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous())


def _scatter(flat: torch.Tensor, index: torch.Tensor, real: torch.Tensor, grad: torch.Tensor) -> None:
    flat.index_add_(0, index[real], grad.transpose(1, 2)[real])


class _Segmented(torch.autograd.Function):
    """q, k, v (G, H, W, D), heads repeated, one dtype; out (G, W, H, D), as transformers expects."""

    @staticmethod
    def forward(ctx, q, k, v, plan: SegmentPlan, scale: float):
        rows, heads, width, dim = q.shape
        p = plan.prompt
        kp, vp = k[:, :, :p].contiguous(), v[:, :, :p].contiguous()
        o_p, lse_p = _flash(q[:, :, :p].contiguous(), kp, vp, 0.0, True, scale=scale)
        q_f, k_f, v_f = (x.transpose(1, 2).reshape(rows * width, heads, dim) for x in (q, k, v))
        o_a, lse_a = _flash(_gather(q_f, plan.member_index), kp, vp, 0.0, False,  # members over their prompt
                            attn_mask=plan.prompt_mask(q.dtype), scale=scale)
        own = [_gather(x, plan.own_index) for x in (q_f, k_f, v_f)]
        o_b, lse_b = _flash(*own, 0.0, True, scale=scale)  # each member over its own tokens
        (o_am, lse_am), (o_bm, lse_bm) = _real(o_a, lse_a, plan.member_real), _real(o_b, lse_b, plan.own_real)
        lse_m = torch.logaddexp(lse_am, lse_bm)
        wide = torch.promote_types(q.dtype, torch.float32)
        o_m = (o_am.to(wide) * (lse_am - lse_m).exp()[..., None]
               + o_bm.to(wide) * (lse_bm - lse_m).exp()[..., None]).to(q.dtype)
        out = q.new_zeros((rows * width, heads, dim))
        out[plan.prompt_out] = o_p.transpose(1, 2).reshape(rows * p, heads, dim)[plan.prompt_flat]
        out[plan.member_out] = o_m
        ctx.save_for_backward(q, k, v, o_p, lse_p, o_a, lse_a, o_b, lse_b, o_m, lse_m)
        ctx.plan, ctx.scale = plan, scale
        return out.view(rows, width, heads, dim)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, o_p, lse_p, o_a, lse_a, o_b, lse_b, o_m, lse_m = ctx.saved_tensors
        plan, scale, p = ctx.plan, ctx.scale, ctx.plan.prompt
        rows, heads, width, dim = q.shape
        d_f = d_out.reshape(rows * width, heads, dim)
        q_f, k_f, v_f = (x.transpose(1, 2).reshape(rows * width, heads, dim) for x in (q, k, v))
        kp, vp = k[:, :, :p].contiguous(), v[:, :, :p].contiguous()
        d_p = q.new_zeros((rows * p, heads, dim))
        d_p[plan.prompt_flat] = d_f[plan.prompt_out]
        dq_p, dk_p, dv_p = _flash_backward(d_p.view(rows, p, heads, dim).transpose(1, 2).contiguous(),
                                           q[:, :, :p].contiguous(), kp, vp, o_p, lse_p, 0.0, True, scale=scale)
        d_m = d_f[plan.member_out]
        d_a, o_a, lse_a = _merged_in(o_a, lse_a, plan.member_real, d_m, o_m, lse_m)
        dq_a, dk_a, dv_a = _flash_backward(d_a, _gather(q_f, plan.member_index), kp, vp, o_a, lse_a, 0.0, False,
                                           attn_mask=plan.prompt_mask(q.dtype), scale=scale)
        d_b, o_b, lse_b = _merged_in(o_b, lse_b, plan.own_real, d_m, o_m, lse_m)
        dq_b, dk_b, dv_b = _flash_backward(d_b, *(_gather(x, plan.own_index) for x in (q_f, k_f, v_f)), o_b, lse_b,
                                           0.0, True, scale=scale)
        grads = [torch.zeros_like(q_f) for _ in range(3)]
        _scatter(grads[0], plan.member_index, plan.member_real, dq_a)
        for flat, grad in zip(grads, (dq_b, dk_b, dv_b)):
            _scatter(flat, plan.own_index, plan.own_real, grad)
        dq, dk, dv = (g.view(rows, width, heads, dim).transpose(1, 2).contiguous() for g in grads)
        dq[:, :, :p] += dq_p
        dk[:, :, :p] += dk_p + dk_a
        dv[:, :, :p] += dv_p + dv_a
        return dq, dk, dv, None, None


def segment_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs):
    plan: SegmentPlan | None = kwargs.pop(KEYWORD, None)
    if plan is None or query.device.type != "cpu" or dropout > 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    group = query.shape[1] // key.shape[1]  # query heads per key head, as transformers' repeat_kv lays them out
    query, key, value = (query.to(dtype), key.to(dtype).repeat_interleave(group, 1),
                         value.to(dtype).repeat_interleave(group, 1))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with torch.autocast("cpu", enabled=False):
        return _Segmented.apply(query, key, value, plan, scale), None


AttentionInterface.register(NAME, segment_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def install(model: torch.nn.Module) -> bool:
    """Switch a CPU model that uses SDPA attention to `agentrl_segments` (SDPA itself in every pass
    without a plan); False, and nothing changed, for any other model."""
    config = model.config
    if (config._attn_implementation != "sdpa" or next(model.parameters()).device.type != "cpu"
            or getattr(config, "attn_logit_softcapping", None)):  # the kernel has no soft-capping
        return config._attn_implementation == NAME
    model.set_attn_implementation(NAME)
    return True
