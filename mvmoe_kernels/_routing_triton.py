"""Triton bodies of the fused multi-router kernels (decorated at first use, see backend.py).

Legend: T tokens, E experts, R routing heads, S selected slots (top-k).
One program owns BLOCK_T tokens and ALL experts (BLOCK_E >= E), so selection needs no
cross-program communication. Maths is fp32 whatever the logits' dtype.

Forward, per token block:
  summed = sum_r sigmoid(logits[:, r, :])                (R loads of a [BLOCK_T, E] tile)
  top-k of (summed + bias): S rounds of row max, ties to the lowest expert id
  slots in ascending expert id: S rounds of "lowest selected id not yet emitted"
  gates and mixing weights at the selected experts (a gather of R logits per slot)
Backward, per token block (d = upstream gradient):
  d summed_i (selected) += (alpha_i dg_i - [sum >= eps] sum_j dg_j g_j) / max(sum, eps)
                          (k = 1: alpha_i dg_i / R)
  d s_{m,i}  (selected) += (da_{i,m} - sum_r da_{i,r} a_{i,r}) / summed_i  (summed_i > 0)
  d logits_{m,e} = (d summed_e + mix part) * s (1 - s)
"""

import triton.language as tl


def multi_router_fwd(
    logits_ptr, bias_ptr, alpha_ptr,
    idx_ptr, gates_ptr, mix_ptr, summed_ptr,
    T, E, eps,
    NUM_HEADS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    ok = t_ok[:, None] & e_ok[None, :]
    t64 = t.to(tl.int64)
    head0 = logits_ptr + t64[:, None] * (NUM_HEADS * E) + e[None, :]

    summed = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for r in tl.static_range(NUM_HEADS):
        summed += tl.sigmoid(tl.load(head0 + r * E, mask=ok, other=0.0).to(tl.float32))
    tl.store(summed_ptr + t64[:, None] * E + e[None, :], summed, mask=ok)

    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    key = summed + bias[None, :]
    selected = ok & (e[None, :] < 0)  # all False [BLOCK_T, BLOCK_E]
    for _ in tl.static_range(NUM_SLOTS):
        open_ = ok & ~selected
        best = tl.max(tl.where(open_, key, -float("inf")), axis=1)
        hit = open_ & (key == best[:, None])
        pick = tl.min(tl.where(hit, e[None, :], BLOCK_E), axis=1)  # ties -> lowest id
        selected = selected | (e[None, :] == pick[:, None])

    sel_sum = tl.sum(tl.where(selected, summed, 0.0), axis=1)
    denom = tl.maximum(sel_sum, eps)
    pending = selected
    for j in tl.static_range(NUM_SLOTS):
        idx_j = tl.min(tl.where(pending, e[None, :], BLOCK_E), axis=1)
        is_j = e[None, :] == idx_j[:, None]
        pending = pending & ~is_j
        sbar_j = tl.sum(tl.where(is_j, summed, 0.0), axis=1)
        alpha_j = tl.load(alpha_ptr + idx_j, mask=t_ok, other=0.0).to(tl.float32)
        if NUM_SLOTS == 1:
            gate_j = alpha_j * sbar_j / NUM_HEADS
        else:
            gate_j = alpha_j * sbar_j / denom
        slot = t64 * NUM_SLOTS + j
        tl.store(idx_ptr + slot, idx_j.to(tl.int64), mask=t_ok)
        tl.store(gates_ptr + slot, gate_j, mask=t_ok)
        positive = sbar_j > 0
        safe = tl.where(positive, sbar_j, 1.0)
        for r in tl.static_range(NUM_HEADS):
            x = tl.load(logits_ptr + t64 * (NUM_HEADS * E) + r * E + idx_j, mask=t_ok, other=0.0)
            a = tl.where(positive, tl.sigmoid(x.to(tl.float32)) / safe, 1.0 / NUM_HEADS)
            tl.store(mix_ptr + slot * NUM_HEADS + r, a, mask=t_ok)


def multi_router_bwd(
    logits_ptr, alpha_ptr, idx_ptr, gates_ptr, mix_ptr, summed_ptr,
    dgates_ptr, dmix_ptr, dsummed_ptr,
    dlogits_ptr, dalpha_ptr,
    T, E, eps,
    NUM_HEADS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    HAS_DSUMMED: tl.constexpr, NEEDS_DALPHA: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    ok = t_ok[:, None] & (e < E)[None, :]
    t64 = t.to(tl.int64)
    tile = t64[:, None] * E + e[None, :]

    # per-token scalars of Eq. 3: the selected sum and sum_j dg_j g_j
    sel_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    dot = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(NUM_SLOTS):
        slot = t64 * NUM_SLOTS + j
        idx_j = tl.load(idx_ptr + slot, mask=t_ok, other=0)
        sel_sum += tl.load(summed_ptr + t64 * E + idx_j, mask=t_ok, other=0.0)
        dot += tl.load(dgates_ptr + slot, mask=t_ok, other=0.0) * tl.load(
            gates_ptr + slot, mask=t_ok, other=0.0)
    denom = tl.maximum(sel_sum, eps)
    dot = tl.where(sel_sum >= eps, dot, 0.0)  # clamp_min passes no gradient below eps

    for m in tl.static_range(NUM_HEADS):
        if HAS_DSUMMED:
            acc = tl.load(dsummed_ptr + tile, mask=ok, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for j in tl.static_range(NUM_SLOTS):
            slot = t64 * NUM_SLOTS + j
            idx_j = tl.load(idx_ptr + slot, mask=t_ok, other=-1)
            sbar_j = tl.load(summed_ptr + t64 * E + idx_j, mask=t_ok, other=0.0)
            alpha_j = tl.load(alpha_ptr + idx_j, mask=t_ok, other=0.0).to(tl.float32)
            dg_j = tl.load(dgates_ptr + slot, mask=t_ok, other=0.0)
            if NUM_SLOTS == 1:
                dsel = alpha_j * dg_j / NUM_HEADS
            else:
                dsel = (alpha_j * dg_j - dot) / denom
            if NEEDS_DALPHA:
                if m == 0:  # d alpha_i = dg_i * g_i / alpha_i, written once per slot
                    if NUM_SLOTS == 1:
                        tl.store(dalpha_ptr + slot, dg_j * sbar_j / NUM_HEADS, mask=t_ok)
                    else:
                        tl.store(dalpha_ptr + slot, dg_j * sbar_j / denom, mask=t_ok)
            centred = tl.zeros([BLOCK_T], dtype=tl.float32)
            for r in tl.static_range(NUM_HEADS):
                centred -= tl.load(dmix_ptr + slot * NUM_HEADS + r, mask=t_ok, other=0.0) * \
                    tl.load(mix_ptr + slot * NUM_HEADS + r, mask=t_ok, other=0.0)
            centred += tl.load(dmix_ptr + slot * NUM_HEADS + m, mask=t_ok, other=0.0)
            positive = sbar_j > 0
            dmix_part = tl.where(positive, centred / tl.where(positive, sbar_j, 1.0), 0.0)
            acc += tl.where(e[None, :] == idx_j[:, None], (dsel + dmix_part)[:, None], 0.0)
        head = logits_ptr + t64[:, None] * (NUM_HEADS * E) + m * E + e[None, :]
        s = tl.sigmoid(tl.load(head, mask=ok, other=0.0).to(tl.float32))
        out = dlogits_ptr + t64[:, None] * (NUM_HEADS * E) + m * E + e[None, :]
        tl.store(out, (acc * s * (1.0 - s)).to(dlogits_ptr.dtype.element_ty), mask=ok)
