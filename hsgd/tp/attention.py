"""The context layout the tensor-parallel model asks: which positions of each sequence a rank holds, and how its core
attention sees the others; and the layout of a rank that holds the whole sequence.

Everything in a Transformer block treats each position on its own except the core attention, where position t
reads the keys and values of positions 0..t. So a layout of the sequence over ranks needs to say two things, and
the model (hsgd.tp.model) asks only these:

    ctx.cp                how many ranks share each sequence (1: WholeSequence)
    ctx.held_bytes()      what the layout itself holds for the whole run (positions, masks)
    ctx.local(a)          (B, T) -> (B, T/cp): this rank's positions of the token ids or targets
    ctx.rows(t0, t1)      the global positions of local rows t0..t1-1: the rows of wpe they add
    ctx.attention_forward(q, k, v, nh) -> y, cache        q, k, v, y: (B, T/cp, C/tp), this rank's queries
    ctx.attention_backward(dy, cache, out) -> dq, dk, dv  views of out (B, T/cp, 3C/tp), [dq | dk | dv]
    ctx.keeps_probabilities   whether the cache holds the probabilities, (T x T) or (T/cp x T) (--recompute
                              selective drops them and calls attention_forward again in the backward pass)
The cp layouts also count the attention scores they compute (ctx.work, hsgd.cp.split).

WholeSequence (cp = 1) is the layout of every run without context parallelism: all T positions on every rank,
the core attention of hsgd.model.ops; FlashSequence (--attention flash) the same positions with the attention of
hsgd.model.flash, which keeps no probabilities. Context parallelism (hsgd.cp, chapter 15) splits the sequence over
cp ranks with two more layouts of this interface: ring attention, and an all-gather of the keys and values.
"""
from hsgd.model import flash
from hsgd.model.ops import attention_backward, attention_forward

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
        """softmax(q k^T / sqrt(hs) + causal mask) v over the local heads (hsgd.model.ops). q, k, v: (B, T, C/tp)."""
        return attention_forward(q, k, v, nh)

    def attention_backward(self, dy, cache, out=None):
        """dq, dk, dv (B, T, C/tp): views of `out` (B, T, 3C/tp)."""
        return attention_backward(dy, cache, out=out)


WHOLE = WholeSequence()


class FlashSequence(WholeSequence):
    """cp = 1, --attention flash: the core attention by blocks with an online softmax (hsgd.model.flash), caching
    q/sqrt(hs), k, v, y and one log-sum-exp per query and head: no (T x T) array is kept, and --recompute selective
    has nothing to drop."""
    keeps_probabilities = False

    def attention_forward(self, q, k, v, nh):
        return flash.attention_forward(q, k, v, nh)

    def attention_backward(self, dy, cache, out=None):
        return flash.attention_backward(dy, cache, out=out)


FLASH = FlashSequence()
