"""Triton bodies of mix-and-permute (decorated at first use, see backend.py).

Legend: T tokens, R views (= routing heads), S slots, L latent, N dispatched rows.
Both kernels walk TOKENS, not rows: a program loads a token block's R views once and
scatters (forward) or gathers (backward) that token's S rows through row_of_TS, the
inverse of the dispatch order (-1 = the pair was dropped). Every (token, slot) owns at most
one row, so stores never collide: no atomics, deterministic results, and each byte the
operation needs is moved once (views and mix read once, rows written once; backward reads
the row gradients once and writes the view and mix gradients once).
Views/rows may be bf16; sums run in fp32.
"""

import triton.language as tl


def mix_permute_fwd(
    views_ptr, mix_ptr, row_of_ptr, rows_ptr,
    T, L,
    NUM_VIEWS: tl.constexpr, NUM_SLOTS: tl.constexpr, VIEWS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    r = tl.arange(0, VIEWS_PAD)
    t_ok = t < T
    l_ok = l < L
    t64 = t.to(tl.int64)
    tr_ok = t_ok[:, None] & (r < NUM_VIEWS)[None, :]
    view_at = views_ptr + (t64[:, None, None] * NUM_VIEWS + r[None, :, None]) * L + l[None, None, :]
    views = tl.load(view_at, mask=tr_ok[:, :, None] & l_ok[None, None, :], other=0.0)
    views = views.to(tl.float32)  # [BLOCK_T, VIEWS_PAD, BLOCK_L]
    for j in tl.static_range(NUM_SLOTS):
        slot = t64 * NUM_SLOTS + j
        row = tl.load(row_of_ptr + slot, mask=t_ok, other=-1)
        mix = tl.load(mix_ptr + slot[:, None] * NUM_VIEWS + r[None, :], mask=tr_ok, other=0.0)
        blended = tl.sum(mix.to(tl.float32)[:, :, None] * views, axis=1)  # [BLOCK_T, BLOCK_L]
        out = rows_ptr + row[:, None] * L + l[None, :]
        tl.store(out, blended.to(rows_ptr.dtype.element_ty),
                 mask=(row >= 0)[:, None] & l_ok[None, :])


def mix_permute_bwd(
    views_ptr, mix_ptr, row_of_ptr, drows_ptr, dviews_ptr, dmix_ptr,
    T, L,
    NUM_VIEWS: tl.constexpr, NUM_SLOTS: tl.constexpr, VIEWS_PAD: tl.constexpr,
    SLOTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, VIEWS_PAD)
    s = tl.arange(0, SLOTS_PAD)
    t_ok = t < T
    t64 = t.to(tl.int64)
    tr_ok = t_ok[:, None] & (r < NUM_VIEWS)[None, :]
    dmix = tl.zeros([BLOCK_T, SLOTS_PAD, VIEWS_PAD], dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):  # the whole latent row, so d mix needs no cross-program sum
        l = l0 + tl.arange(0, BLOCK_L)
        l_ok = l < L
        trl_ok = tr_ok[:, :, None] & l_ok[None, None, :]
        view_off = (t64[:, None, None] * NUM_VIEWS + r[None, :, None]) * L + l[None, None, :]
        views = tl.load(views_ptr + view_off, mask=trl_ok, other=0.0).to(tl.float32)
        dviews = tl.zeros([BLOCK_T, VIEWS_PAD, BLOCK_L], dtype=tl.float32)
        for j in tl.static_range(NUM_SLOTS):
            slot = t64 * NUM_SLOTS + j
            row = tl.load(row_of_ptr + slot, mask=t_ok, other=-1)
            drow = tl.load(drows_ptr + row[:, None] * L + l[None, :],
                           mask=(row >= 0)[:, None] & l_ok[None, :], other=0.0).to(tl.float32)
            mix = tl.load(mix_ptr + slot[:, None] * NUM_VIEWS + r[None, :], mask=tr_ok,
                          other=0.0).to(tl.float32)
            dviews += mix[:, :, None] * drow[:, None, :]
            dmix_j = tl.sum(views * drow[:, None, :], axis=2)  # [BLOCK_T, VIEWS_PAD]
            dmix += tl.where(s[None, :, None] == j, dmix_j[:, None, :], 0.0)
        tl.store(dviews_ptr + view_off, dviews.to(dviews_ptr.dtype.element_ty), mask=trl_ok)
    dmix_off = (t64[:, None, None] * NUM_SLOTS + s[None, :, None]) * NUM_VIEWS + r[None, None, :]
    dmix_ok = tr_ok[:, None, :] & (s < NUM_SLOTS)[None, :, None]
    tl.store(dmix_ptr + dmix_off, dmix.to(dmix_ptr.dtype.element_ty), mask=dmix_ok)
