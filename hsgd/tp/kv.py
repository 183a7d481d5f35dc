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
Other NKV are refused (hsgd.tp.shards.check_tp). The core attention takes the rank's kv heads as they are: a rank
holding the whole sequence repeats them to its query heads (hsgd.tp.attention.grouped_forward), ring attention and
the all-gather move them unrepeated and repeat each block (hsgd.cp), so that cp_comm carries NKV/tp heads.

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


def kv_columns(cfg, tp):
    """K/tp: the columns of k (and of v) a tp rank holds, its kv heads times hs (hs with one replicated head)."""
    return kv_heads(cfg, tp, 0)[0] * cfg.head_size


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
    """The rotation's adjoint (by -a) on dq and dk of the core attention's [dq | dk | dv] (B, T, C/tp + 2 NKV/tp
    hs), the rank's own heads (the context layout has summed the repeated kv heads back: hsgd.tp.attention).
    Without rotary positions: dqkv itself."""
    rope = setup.rope(dqkv.shape[1], dtype, array_module(dqkv))
    if rope is None:
        return dqkv
    op, c, kv = setup.ops, setup.nh * setup.cfg.head_size, setup.nkv * setup.cfg.head_size
    dq = op.rope_rows_backward(dqkv[..., :c], (*rope, setup.nh))                     # (B, T, C/tp)
    dk = op.rope_rows_backward(dqkv[..., c:c + kv], (*rope, setup.nkv))             # (B, T, NKV/tp hs)
    return array_module(dqkv).concatenate([dq, dk, dqkv[..., c + kv:]], axis=-1)
