"""Pipeline parallelism: the layers split into pp stages, each DP group's batch into m micro-batches.

The lecture, sections 1 and 4.2: with layers split across workers, one worker computes while the others wait
for its activations; cutting the mini-batch into micro-batches lets the stages work on different micro-batches
at once. What remains idle is the "bubble": with p stages, m micro-batches and equal costs per stage, a fraction
(p - 1) / (m + p - 1) of each stage's step.

Stage s holds the blocks split_layers(L, pp)[s]; stage 0 also the embedding, stage p-1 the final LayerNorm, the
LM head and the loss (with v chunks per stage, chunk_layers cuts pp v pieces, chunk c of stage s being piece
c pp + s). Each stage is itself tensor-parallel over tp_comm (hsgd.tp.model.stage_forward/backward). This module
holds the cut and the bytes on pp_comm; hsgd.pp.schedules the schedules as lists of actions and what can be said of
them without running them; hsgd.pp.stage runs a stage's list, sending activations forward and their gradients back.

Schedules (the order in which one stage runs its forward "F j" and backward "B j" actions; more in
hsgd.pp.schedules: interleaved 1F1B and the zero-bubble ZB-H1):
    GPipe (Huang et al. 2019):
            F0 F1 ... F(m-1)  B0 B1 ... B(m-1)                     holds the activations of all m micro-batches
    1F1B (PipeDream-Flush: Narayanan et al. 2019, 2021):
            min(p-s-1, m) warm-up forwards, then one forward and one backward in turn, then the remaining
            backwards                                              holds at most p - s micro-batches
Both accumulate the gradients of the micro-batches in the same order (B0, B1, ...), so they give the same
numbers; they differ in memory (and, with unequal costs, in time).
"""
import itertools

from hsgd.errors import ConfigError


def split_layers(n_layers, pp, split=None):
    """The blocks of each stage, as ranges. split: layers per stage (a list), default as even as possible
    (the first n_layers % pp stages get one more)."""
    if split is None:
        if pp > n_layers:
            raise ConfigError(f"n_layers={n_layers} cannot be split into pp={pp} stages of at least one layer; "
                              f"use pp <= {n_layers} or more layers")
        base, extra = divmod(n_layers, pp)
        split = [base + (s < extra) for s in range(pp)]
    split = [int(x) for x in split]
    if len(split) != pp or sum(split) != n_layers or min(split) < 1:
        if pp > n_layers:
            raise ConfigError(f"n_layers={n_layers} cannot be split into pp={pp} stages of at least one layer")
        even = ",".join(str(len(r)) for r in split_layers(n_layers, pp))
        raise ConfigError(f"pp_split={','.join(map(str, split))} must give each of the pp={pp} stages at least one "
                          f"layer and add up to n_layers={n_layers}, e.g. {even}")
    bounds = [0, *itertools.accumulate(split)]                         # (linear in pp)
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def parse_split(text):
    """'2,1,1' -> [2, 1, 1]; None stays None."""
    if text is None or isinstance(text, (list, tuple)):
        return text
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"pp_split={text!r} must be layers per stage (per chunk with virtual stages) separated by "
                          f"commas, e.g. 2,2") from None


def stage_names(cfg, layers, first, last):
    """Names of the parameters a stage holds (those the model's family has): the embedding's on the first, its
    blocks', the head's on the last (a tied head is wte, which the first stage holds: hsgd ties with pp = 1)."""
    shapes = cfg.param_shapes()
    names = [n for n in shapes if n.startswith("h.") and int(n.split(".")[1]) in layers]
    if first:
        names = [n for n in ("wte", "wpe") if n in shapes] + names
    if last:
        names += [n for n in ("ln_f.weight", "ln_f.bias", "lm_head.weight") if n in shapes]
    return names


def chunk_layers(n_layers, pp, v=1, split=None):
    """The blocks of each of the pp v model pieces (hsgd.pp.schedules): piece k = c pp + s is chunk c of stage s.
    split: layers per piece (pp v numbers), default as even as possible. v = 1: split_layers."""
    if v == 1 or pp > n_layers:
        return split_layers(n_layers, pp, split)                        # (its messages speak of stages)
    if pp * v > n_layers:
        raise ConfigError(f"n_layers={n_layers} cannot be cut into pp x virtual_stages = {pp} x {v} = {pp * v} "
                          f"chunks of at least one layer; use --n-layers {pp * v} or more, fewer stages, or "
                          f"(interleaved) virtual_stages from 1 to {n_layers // pp}; zb-v and dualpipev hold 2 "
                          "chunks per stage, dualpipe 2 pieces of pp")
    if split is not None and (len(split) != pp * v or sum(split) != n_layers or min(split) < 1):
        even = ",".join(str(len(r)) for r in split_layers(n_layers, pp * v))
        raise ConfigError(f"pp_split={','.join(map(str, split))} must give each of the pp x virtual_stages = "
                          f"{pp * v} chunks at least one layer (chunk c of stage s is entry c*pp + s) and add up to "
                          f"n_layers={n_layers}, e.g. {even}")
    return split_layers(n_layers, pp * v, split)


def stage_chunks(n_layers, pp, s, v=1, split=None, pl=None):
    """Stage s's chunks, [(k, layers, first, last)]: chunk c is the model's piece k = pl.piece(s, c) (hsgd.pp.
    placement; default the loop, k = c pp + s; chunk_layers cuts the pl.K pieces: pp v, or pp in the dual
    placement), first when it is piece 0 (the embedding), last when it is piece K - 1 (the head and the loss)."""
    K = pl.K if pl is not None else pp * v                          # (the dual placement: pp pieces, twice)
    cut = chunk_layers(n_layers, pp, K // pp, split)
    pieces = [pl.piece(s, c) if pl is not None else c * pp + s for c in range(v)]
    return [(k, cut[k], k == 0, k == K - 1) for k in pieces]


def pp_formula(batch_per_mb, cfg, m, first, last, itemsize, scheme="megatron", tp=1, v=1, cp=1, local=0, twin=0):
    """{(comm, op): (calls, bytes)} of one step on pp_comm for one stage: per micro-batch and chunk, an activation
    out and a gradient in towards the next piece (unless the chunk is the model's last piece: `last`), a gradient
    out and an activation in towards the previous one (unless it is the first: `first`), so m (2v - first - last)
    messages each way: with v chunks a middle stage sends v times as often as with one, an end stage 2v - 1 times.
    A hand-off between two pieces of the same stage (`local` of them: hsgd.pp.placement.local_handoffs, the V's
    turn) is a copy, no message: 2 fewer each way per micro-batch and such hand-off. DualPipe's stage (hsgd.pp.dual:
    v = 1 here, first and last its place going down, half its micro-batches each way) also sends its `twin` bytes
    of gradients to the stage holding the same pieces, and receives as many.
    A message is one activation (tp_model.stage_activation_shape): (B/m, T, C), or the T-shard (B/m, T/tp, C) of
    the sequence scheme; with context parallelism T/cp in place of T."""
    from hsgd.tp.model import stage_activation_shape
    B, T, C = stage_activation_shape(scheme, batch_per_mb, cfg, tp, cp)
    msg = B * T * C * itemsize
    sends = m * (2 * v - first - last - 2 * local)
    out = {}
    if sends or twin:
        out[("pp", "Isend")] = (sends + bool(twin), sends * msg + twin)
        out[("pp", "Recv")] = (sends + bool(twin), sends * msg + twin)
    return out
