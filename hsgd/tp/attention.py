"""The context layout the tensor-parallel model asks: which positions of each sequence a rank holds, and how its core
attention sees the others; and the layout of a rank that holds the whole sequence.

Everything in a Transformer block treats each position on its own except the core attention, where position t
reads the keys and values of positions 0..t. So a layout of the sequence over ranks needs to say two things, and
the model (hsgd.tp.model) asks only these:

    ctx.cp                how many ranks share each sequence (1: WholeSequence)
    ctx.held_bytes()      what the layout itself holds for the whole run (positions, masks)
    ctx.local(a)          (B, T) -> (B, T/cp): this rank's positions of the token ids or targets
    ctx.rows(t0, t1)      the global positions of local rows t0..t1-1: the rows of wpe they add
    ctx.attention_forward(q, k, v, nh) -> y, cache        q, y: (B, T/cp, C/tp), this rank's queries; k, v:
                                                          (B, T/cp, K/tp), K/tp = C/tp / n_rep: the rank's kv heads,
                                                          each read by n_rep of its nh query heads (grouped-query
                                                          attention; n_rep = 1 without)
    ctx.attention_backward(dy, cache, out) -> dq, dk, dv  views of out (B, T/cp, C/tp + 2K/tp), [dq | dk | dv]
    ctx.keeps_probabilities   whether the cache holds the probabilities, (T x T) or (T/cp x T) (--recompute
                              selective drops them and calls attention_forward again in the backward pass)
The cp layouts also count the attention scores they compute (ctx.work, hsgd.cp.split).

WholeSequence (cp = 1) is the layout of every run without context parallelism: all T positions on every rank,
the core attention of hsgd.model.ops; FlashSequence (--attention flash) the same positions with the attention of
hsgd.model.flash, which keeps no probabilities. Context parallelism (hsgd.cp, chapter 13) splits the sequence over
cp ranks with more layouts of this interface: ring attention, an all-gather of the keys and values, and Ulysses'
all-to-all to a head split (hsgd.cp.layouts makes them).
"""
from hsgd.model import flash
from hsgd.model.backend import array_module
from hsgd.model.ops import attention_backward, attention_forward, repeat_kv_rows_backward, repeat_kv_rows_forward

ATTENTIONS = ("materialized", "flash")


class WholeSequence:
    """cp = 1: every rank holds all T positions; the core attention is local (hsgd.model.ops)."""
    cp = 1
    keeps_probabilities = True

    def held_bytes(self):
        """Nothing held."""
        return 0

    def local(self, a):
        """(B, T) -> (B, T): all of it."""
        return a

    def rows(self, t0, t1):
        """Local rows t0..t1-1 are positions t0..t1-1."""
        return slice(t0, t1)

    def attention_forward(self, q, k, v, nh):
        """softmax(q k^T / sqrt(hs) + causal mask) v over the local heads (hsgd.model.ops), the kv heads repeated to
        the query heads first (grouped_forward). q: (B, T, C/tp); k, v: (B, T, K/tp)."""
        return grouped_forward(attention_forward, q, k, v, nh)

    def attention_backward(self, dy, cache, out=None):
        """dq (B, T, C/tp), dk, dv (B, T, K/tp): views of `out` (B, T, C/tp + 2K/tp)."""
        return grouped_backward(attention_backward, dy, cache, out)


def grouped_forward(attend, q, k, v, nh):
    """attend(q, k, v, nh) with k, v (B, T, K/tp) repeated to the nh query heads first (ops.repeat_kv_rows_forward:
    query head j reads kv head j // n_rep, n_rep = C/K): where the whole sequence is on the rank nothing travels,
    and the attention of hsgd.model.ops / hsgd.model.flash runs on equal heads. Returns y and (its cache, the
    repeat's)."""
    n_rep = q.shape[-1] // k.shape[-1]
    k, rep = repeat_kv_rows_forward(k, nh // n_rep, n_rep)                 # (B, T, C/tp)
    v, _ = repeat_kv_rows_forward(v, nh // n_rep, n_rep)
    y, cache = attend(q, k, v, nh)
    return y, (cache, rep)


def grouped_backward(backward, dy, cache, out=None):
    """backward(dy, cache, out) of the repeated heads, then the repeat's adjoint on dk and dv (the sum over each
    group of n_rep query heads): dq (B, T, C/tp), dk, dv (B, T, K/tp), views of out (B, T, C/tp + 2K/tp)."""
    cache, rep = cache
    n_rep = rep[1]
    if n_rep == 1:
        return backward(dy, cache, out=out)
    B, T, C = dy.shape
    K = C // n_rep
    dq, dk, dv = backward(dy, cache)                                        # (B, T, C/tp) x 3, repeated heads
    if out is None:
        out = array_module(dy).empty_like(dy, shape=(B, T, C + 2 * K))
    out[..., :C] = dq
    out[..., C:C + K] = repeat_kv_rows_backward(dk, rep)                   # (B, T, K/tp) the group's sum
    out[..., C + K:] = repeat_kv_rows_backward(dv, rep)
    return out[..., :C], out[..., C:C + K], out[..., C + K:]


WHOLE = WholeSequence()


class FlashSequence(WholeSequence):
    """cp = 1, --attention flash: the core attention by blocks with an online softmax (hsgd.model.flash), caching
    q/sqrt(hs), k, v, y and one log-sum-exp per query and head: no (T x T) array is kept, and --recompute selective
    has nothing to drop."""
    keeps_probabilities = False

    def attention_forward(self, q, k, v, nh):
        return grouped_forward(flash.attention_forward, q, k, v, nh)

    def attention_backward(self, dy, cache, out=None):
        return grouped_backward(flash.attention_backward, dy, cache, out)


FLASH = FlashSequence()
