"""Which pipeline stage holds each piece of the model: a schedule's placement, as data.

The layers are cut into p v pieces, k = 0 .. p v - 1 (hsgd.pp.chunks.chunk_layers); piece 0 holds the embedding,
piece p v - 1 the final norm, the LM head and the loss. Each of the p stages holds v of them, its chunks c = 0 ..
v - 1. Two placements:

    loop   chunk c of stage s is piece k = c p + s: a micro-batch goes stage 0, 1, .., p-1, then back to stage 0
           for chunk 1 (the plain pipeline, v = 1, and Megatron-LM's interleaved schedule; Narayanan et al. 2021)
    v      v = 2, chunk 0 of stage s is piece s and chunk 1 is piece 2p - 1 - s: down the stages and back up, so
           stage p-1 holds pieces p-1 and p and hands the activation to itself, and stage 0 holds the first and the
           last piece, the loss among them (ZB-V: Qi et al. 2024, "Pipeline Parallelism with Controllable Memory";
           DualPipeV, the V-shaped half of DeepSeek-AI 2024's DualPipe)

    dual   v = 2, p even, the model cut into p pieces held twice (DualPipe: DeepSeek-AI 2024): micro-batches 0 ..
           m/2 - 1 go down (piece k on stage k, its chunk 0), micro-batches m/2 .. m-1 go up (piece k on stage
           p-1-k, its chunk 1). Stage s holds pieces s and p-1-s, and so does stage p-1-s: every parameter is on two
           stages, whose gradients are summed after the backward passes (hsgd.pp.dual); the pieces' "holder" below
           is the downward one (the checkpoint's files, evaluation)

A piece hands its activation to piece k + 1 and receives its gradient from there; when both pieces are on one
stage the hand-off is a local copy, not a message (Stage.forward and Stage.backward, and pp_formula's count).
Along the path of a micro-batch through chunk c of stage s, pl.before(s, c) and pl.after(s, c) are the (stage,
chunk) of the pieces k - 1 and k + 1 (None at either end); pl.runs(c, j, m) whether micro-batch j (of m) passes
through chunk c at all (always, but in the dual placement).

    pl = placement("loop", p, v)       pl.piece(s, c) -> k      pl.holder(k) -> (s, c)     pl.stage(k) -> s
"""
from hsgd.errors import ConfigError

SHAPES = ("loop", "v", "dual")


class Placement:
    """Piece k of the model on (stage, chunk) as `shape` places it (the module docstring); p stages, v chunks each."""

    def __init__(self, shape, p, v):
        if shape not in SHAPES:
            raise ConfigError(f"placement {shape!r} is not known; use one of {', '.join(SHAPES)}")
        if shape == "v" and v != 2:
            raise ConfigError(f"the V placement puts 2 chunks on every stage (down and back up), not {v}; use "
                              "virtual_stages 2")
        if shape == "dual" and (v != 2 or p % 2):
            raise ConfigError(f"the dual placement (DualPipe) sends half the micro-batches down and half up the "
                              f"stages, each stage holding 2 chunks: pp={p} must be even, e.g. {p - 1 or 2} or "
                              f"{p + 1}" + (f", with 2 chunks each (not {v})" if v != 2 else ""))
        self.shape, self.p, self.v, self.K = shape, p, v, p if shape == "dual" else p * v
        self.where = [None] * self.K                          # piece k -> (stage, chunk) (dual: going down)
        for s in range(p):
            for c in range(v):
                if shape != "dual" or c == 0:
                    self.where[self.piece(s, c)] = (s, c)

    def piece(self, s, c):
        """The piece chunk c of stage s holds."""
        if self.shape == "v":
            return s if c == 0 else 2 * self.p - 1 - s
        if self.shape == "dual":
            return s if c == 0 else self.p - 1 - s
        return c * self.p + s

    def before(self, s, c):
        """(stage, chunk) of the piece before chunk c of stage s on its micro-batches' path; None for piece 0."""
        k = self.piece(s, c)
        if k == 0:
            return None
        return (s - 1, 0) if self.shape == "dual" and c == 0 else (s + 1, 1) if self.shape == "dual" \
            else self.where[k - 1]

    def after(self, s, c):
        """(stage, chunk) of the piece after chunk c of stage s on its micro-batches' path; None for the last."""
        k = self.piece(s, c)
        if k == self.K - 1:
            return None
        return (s + 1, 0) if self.shape == "dual" and c == 0 else (s - 1, 1) if self.shape == "dual" \
            else self.where[k + 1]

    def runs(self, c, j, m):
        """Whether micro-batch j of m passes through chunk c (dual: the first half goes down chunk 0, the second
        half up chunk 1)."""
        return self.shape != "dual" or c == (j >= m // 2)

    def holder(self, k):
        """(stage, chunk) of piece k."""
        return self.where[k]

    def stage(self, k):
        """The stage that holds piece k."""
        return self.where[k][0]

    def local_handoffs(self, s):
        """How many of stage s's pieces hand their activation to a piece of the same stage (k and k + 1 both on
        s): 0 in a loop of p > 1 stages, 1 on the V's last stage."""
        return sum(1 for c in range(self.v) if self.after(s, c) is not None and self.after(s, c)[0] == s)

    def __eq__(self, other):
        return isinstance(other, Placement) and (self.shape, self.p, self.v) == (other.shape, other.p, other.v)

    def __repr__(self):
        return f"placement({self.shape!r}, {self.p}, {self.v})"


def placement(shape, p, v=1):
    """The Placement of `shape` ("loop" or "v") for p stages of v chunks each."""
    return Placement(shape, p, v)
