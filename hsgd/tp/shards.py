"""How each parameter of the GPT is split over the tensor-parallel ranks: which axis, the shards, and the whole again.

A parameter is replicated ("rep"), split along one axis in tp equal parts ("split": the column-parallel weights and
biases, the row-parallel projections), or split by vocabulary ("vocab": wte's rows, lm_head's columns, padded to
tp ceil(V/tp) so that every rank holds Vp = ceil(V/tp) ids). The scheme (hsgd.tp.schemes) says which; a shard is
the exact slice of hsgd.model.serial's parameter, and `unshard` of every rank's shards, in rank order, is the parameter
again.

Key/value heads (grouped-query attention, NKV < NH): attn.k and attn.v are split by heads like q when tp divides NKV
(Megatron-LM's rule: it divides num_query_groups by tp); when NKV < tp (tp a multiple of NKV) rank r holds the one kv
head its query heads read, r // (tp/NKV), the same columns on tp/NKV ranks (hsgd.tp.model.kv_heads). shard and
shard_numel need cfg for that; unshard takes one holder of each head.
"""
import math

from hsgd.model import serial
from hsgd.model.backend import array_module
from hsgd.errors import ConfigError
from hsgd.tp.layers import vocab_range
from hsgd.tp.schemes import make_scheme


def check_tp(cfg, tp, scheme="megatron"):
    """Raise ConfigError unless the model splits over tp ranks (the vocabulary may be padded; heads and d_ff not;
    kv heads split when tp divides NKV, replicated when NKV divides tp)."""
    S = make_scheme(scheme)
    ok = [t for t in range(1, 65) if cfg.n_heads % t == 0 and cfg.d_ff % t == 0 and kv_fits(cfg.n_kv_heads, t)]
    if cfg.n_heads % tp:
        raise ConfigError(f"n_heads={cfg.n_heads} is not divisible by tp={tp}: each tensor-parallel rank holds "
                          f"n_heads/tp whole heads; use tp in {ok}")
    if cfg.d_ff % tp:
        raise ConfigError(f"d_ff={cfg.d_ff} is not divisible by tp={tp}: each tensor-parallel rank holds d_ff/tp "
                          f"MLP columns; use tp in {ok}")
    if not kv_fits(cfg.n_kv_heads, tp):
        raise ConfigError(f"n_kv_heads={cfg.n_kv_heads} can be neither split over tp={tp} (tp must divide it) nor "
                          f"replicated (tp a multiple of it: each rank then holds the one kv head its query heads "
                          f"read); use tp in {ok} or n_kv_heads in "
                          f"{[k for k in range(1, cfg.n_heads + 1) if cfg.n_heads % k == 0 and kv_fits(k, tp)]}")
    S.check(cfg, tp, ok)                                                 # sequence: T-shards of seq_len/tp


def check_tied(cfg, pp, zero):
    """Raise ConfigError for a tied head where hsgd does not tie: the embedding and the head on different pipeline
    stages (pp > 1; Megatron-LM All-Reduces wte's gradient between the first and the last stage), or ZeRO 2 and 3,
    which hold each gradient group's buffer (and ZeRO-3 its parameters) only while that group runs, while the tied
    head writes wte's gradient during the head's."""
    if cfg.tied and (pp > 1 or zero >= 2):
        raise ConfigError(f"--tied needs wte in the embedding and in the LM head of one stage and its gradient whole: "
                          f"hsgd ties them with --pp 1 and --zero 0 or 1 (this run: --pp {pp} --zero {zero}); use "
                          f"those, or --no-tied")


def kv_fits(n_kv_heads, tp):
    """Whether NKV key/value heads go over tp ranks: split (tp divides NKV) or replicated (NKV divides tp)."""
    return n_kv_heads % tp == 0 or tp % n_kv_heads == 0


def is_kv(name):
    return ".attn.k." in name or ".attn.v." in name


def kv_shared(name, cfg, tp):
    """True for attn.k / attn.v when their heads are replicated over tp (NKV < tp)."""
    return cfg is not None and is_kv(name) and cfg.n_kv_heads < tp


def holders_weight(name, cfg, tp):
    """1 for a split parameter held by one tp rank; NKV/tp for a kv head held alike by tp/NKV ranks."""
    return cfg.n_kv_heads / tp if kv_shared(name, cfg, tp) else 1


def split_of(name, scheme="megatron"):
    """How a parameter is split: ("rep", None), ("split", axis) or ("vocab", axis)."""
    return make_scheme(scheme).split_of(name)


def shard(full, name, tp_rank, tp, scheme="megatron", cfg=None):
    """This rank's shard of a full (serial) parameter or gradient: a copy. cfg: needed for attn.k / attn.v when NKV
    < tp (then the columns of kv head tp_rank // (tp/NKV)); without it they are split like q."""
    xp = array_module(full)
    kind, axis = split_of(name, scheme)
    if kind == "rep":
        return full.copy()
    n = full.shape[axis]
    if kind == "vocab":
        start, size = vocab_range(n, tp, tp_rank)
        padded_shape = list(full.shape)
        padded_shape[axis] = size * tp
        padded = xp.zeros(padded_shape, dtype=full.dtype)                # rows/columns past V stay zero
        padded[(slice(None),) * axis + (slice(0, n),)] = full
        full = padded
    elif kv_shared(name, cfg, tp):
        size = n // cfg.n_kv_heads                                       # one head's columns
        start = tp_rank // (tp // cfg.n_kv_heads) * size
    else:
        size, start = n // tp, tp_rank * (n // tp)
    return xp.ascontiguousarray(full[(slice(None),) * axis + (slice(start, start + size),)])


def shard_params(full_params, tp_rank, tp, scheme="megatron", cfg=None):
    return {name: shard(p, name, tp_rank, tp, scheme, cfg) for name, p in full_params.items()}


def shard_numel(cfg, tp, names=None, scheme="megatron"):
    """How many numbers of the parameters `names` (default: all) one tensor-parallel rank holds, from the shapes:
    a split parameter 1/tp of its axis (the vocabulary padded to tp * ceil(V/tp); a replicated kv head 1/NKV), a
    replicated one whole. The same on every tp rank; the size of its dp_comm gradient exchange and of its parameter
    memory."""
    shapes = cfg.param_shapes()
    total = 0
    for name in shapes if names is None else names:
        shape = shapes[name]
        kind, axis = split_of(name, scheme)
        n = math.prod(shape)
        if kind == "vocab":
            n = n // shape[axis] * vocab_range(shape[axis], tp, 0)[1]
        elif kind == "split":
            n = n // shape[axis] * (shape[axis] // (cfg.n_kv_heads if kv_shared(name, cfg, tp) else tp))
        total += n
    return total


def init_params(cfg, comm, seed=0, dtype="float32", device=None, scheme="megatron"):
    """This rank's shards: exact slices of hsgd.model.serial.init_params for the same seed. (Each rank draws the full
    model and keeps its slice: simple, and for the model sizes of this project cheap.)"""
    check_tp(cfg, comm.size, scheme)
    return shard_params(serial.init_params(cfg, seed, dtype, device), comm.rank, comm.size, scheme, cfg)


def unshard(pieces, name, cfg, scheme="megatron"):
    """The full parameter from the shards of all tp ranks, in rank order (the inverse of `shard`)."""
    xp = array_module(pieces[0])
    kind, axis = split_of(name, scheme)
    if kind == "rep":
        return pieces[0].copy()
    if kv_shared(name, cfg, len(pieces)):
        pieces = pieces[::len(pieces) // cfg.n_kv_heads]                  # one holder of each kv head
    full = xp.concatenate(pieces, axis=axis)
    if kind == "vocab":
        full = full[(slice(None),) * axis + (slice(0, cfg.vocab_size),)]      # drop the padding
    return xp.ascontiguousarray(full)


def gather_full(params, cfg, comm, scheme="megatron"):
    """Every full parameter on every rank of the group (pickled allgather: for small models, sampling and checks,
    never in the training step)."""
    return {name: unshard(comm.allgather_obj(p), name, cfg, scheme) for name, p in params.items()}


def whole_model(params, cfg, tp_comm, pp_comm, scheme="megatron", ep_comm=None):
    """The whole model (serial names and shapes) on every rank, from every rank's shards of its stage: gathered
    over tp_comm, then every stage's over pp_comm, and with experts split over ranks every ep rank's experts over
    ep_comm (pickled: for sampling and checks only)."""
    full, mine = {}, gather_full(params, cfg, tp_comm, scheme)
    for part in (ep_comm.allgather_obj(mine) if ep_comm is not None and ep_comm.size > 1 else [mine]):
        for stage in pp_comm.allgather_obj(part):
            full.update(stage)                                              # every stage's parameters
    return {n: full[n] for n in cfg.param_shapes()}


def vocab_padding(cfg, tp):
    """Rows of wte (columns of lm_head) added so that every rank holds Vp = ceil(V/tp)."""
    return math.ceil(cfg.vocab_size / tp) * tp - cfg.vocab_size
