"""The key/value heads over the tensor-parallel ranks (grouped-query attention: NKV <= NH of them, query head j reading
kv head j // n_rep, n_rep = NH/NKV; Ainslie et al. 2023, "GQA").

Two rules, by how NKV and tp divide:
    split       tp divides NKV: rank i holds kv heads i NKV/tp .. (i+1) NKV/tp - 1, the ones its NH/tp query heads
                read, like q's columns (Megatron-LM's only rule: it divides num_query_groups by tp and asserts that
                tp divides it; torchtitan's ColwiseParallel of wk, wv as well);
    replicated  NKV divides tp (NKV < tp): rank i holds the one kv head its query heads read, i // (tp/NKV), the
                same columns as the tp/NKV - 1 other ranks of its group (as inference engines replicate them). Each
                holder's backward gives only its own query heads' part of dk, dv; the head's gradient is their sum
                (kv_sum), taken before the weight-gradient product so that every holder keeps the whole of it.
Other NKV are refused (hsgd.tp.shards.check_tp). The model repeats a rank's kv heads to its query heads before the
core attention (ops.repeat_kv_rows_forward) and sums them back after it (kv_backward).

Legend: B batch, T sequence (a rank's), C d_model, NH, NKV, hs head size, tp ranks; N = B T rows.
"""
from hsgd.model.backend import array_module
from hsgd.tp.layers import payload


def kv_heads(cfg, tp, rank):
    """(how many kv heads a tp rank holds, the index of its first): NKV/tp of them from rank * NKV/tp when tp divides
    NKV; else (tp a multiple of NKV) the one its query heads read, rank // (tp/NKV) (hsgd.tp.shards.check_tp refuses
    the rest)."""
    if cfg.n_kv_heads >= tp:
        return cfg.n_kv_heads // tp, rank * (cfg.n_kv_heads // tp)
    return 1, rank // (tp // cfg.n_kv_heads)


def kv_sum(dkv, setup):
    """The replicated kv heads' adjoint: where tp/NKV ranks hold the same kv head, each has the part of dk, dv
    (B, T, 2 hs) its own query heads give; the head's gradient is their sum. One Allreduce over tp of a (B, T, 2 NKV
    hs) buffer, every rank's part in its head's slot and zeros elsewhere; each keeps its slot. Returns dkv summed."""
    xp = array_module(dkv)
    B, T, w = dkv.shape                                                  # w = 2 hs
    full = xp.zeros((B, T, setup.cfg.n_kv_heads, w), dtype=dkv.dtype)    # (B, T, NKV, 2 hs)
    full[:, :, setup.kv_owner] = dkv
    setup.comm.Allreduce(payload(full, setup.comm))                      # sum over tp: the holders of each head
    return xp.ascontiguousarray(full[:, :, setup.kv_owner])


def kv_backward(dqkv, dtype, setup):
    """From attention's [dq | dk | dv] (B, T, 3C/tp) on the repeated heads to [dq | dk | dv] on this rank's own
    (B, T, C/tp + 2 NKV/tp hs): the repeat's adjoint (the sum over each group of n_rep query heads), then the
    rotation's (by -a) on dq and dk. Without grouped-query attention or rotary positions: dqkv itself."""
    op, c = setup.ops, dqkv.shape[-1] // 3
    dq, dk, dv = dqkv[..., :c], dqkv[..., c:2 * c], dqkv[..., 2 * c:]
    if setup.n_rep == 1 and setup.cfg.positions != "rope":
        return dqkv
    rep = (setup.nkv, setup.n_rep)
    dk, dv = op.repeat_kv_rows_backward(dk, rep), op.repeat_kv_rows_backward(dv, rep)   # (B, T, NKV/tp hs)
    rope = setup.rope(dqkv.shape[1], dtype, array_module(dqkv))
    if rope is not None:
        dq = op.rope_rows_backward(dq, (*rope, setup.nh))
        dk = op.rope_rows_backward(dk, (*rope, setup.nkv))
    return array_module(dqkv).concatenate([dq, dk, dv], axis=-1)
