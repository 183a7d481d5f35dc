"""Optimizers, the learning-rate schedule and gradient clipping, all on local shards.

The lecture's mini-batch SGD is  w <- w - lr * (1/B) * sum_j grad_j . hsgd's loss is already the mean over
the batch, so its gradient *is* (1/B) * sum_j grad_j, and the update is  w <- w - lr * g.

    SGD:    v <- mu v + g;  w <- w - lr v                      (mu = 0: plain SGD)
    AdamW:  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
            w <- w - lr * ( m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) )
    both:   decoupled weight decay w <- w - lr * wd * w on matrices (2-D), not on biases and LayerNorm.

Every rank updates its own shards with the averaged gradient; the update is elementwise, so a shard's update is
the slice of the full update and replicas stay identical. The trainer hands the optimizer its shards as one flat
array ({"flat": ...}) with a per-element 0/1 weight-decay mask; the per-parameter form (a dict of names, the 2-D
rule) is the same arithmetic. The one non-local quantity is the gradient norm used for clipping (`global_grad_norm`
per parameter; the trainer's one-copy form: hsgd.step.health.global_norm).
"""
import math

from mpi4py import MPI

from hsgd.model.backend import array_module, to_host


def decays(name, p):
    """Weight decay applies to weight matrices and embeddings (2-D), not to biases and LayerNorm (1-D).
    p: the parameter, or its shape."""
    return len(getattr(p, "shape", p)) >= 2


def apply_weight_decay(p, name, lr, wd, decay=None):
    """p <- p * (1 - lr * wd * m), m = 1 for decayed parameters (or a per-element 0/1 mask from decay[name])."""
    if not wd:
        return
    m = decays(name, p) if decay is None else decay[name]
    if m is True or m is False:
        if m:
            p *= 1.0 - lr * wd
    else:
        p *= 1.0 - (lr * wd) * m


class SGD:
    def __init__(self, lr, momentum=0.0, weight_decay=0.0):
        self.lr = lr                      # learning rate (a schedule may pass another one to step())
        self.momentum = momentum          # heavy-ball coefficient mu; 0 = plain SGD
        self.weight_decay = weight_decay  # decoupled weight decay on 2-D parameters
        self.t = 0                        # steps taken
        self.state = {}                   # name (the trainer: "flat") -> velocity v, created on first use

    def moments(self, name):
        """{"velocity": v} of parameter `name` (empty before the first step, and for plain SGD)."""
        return {"velocity": self.state[name]} if name in self.state else {}

    def set_moments(self, name, moments):
        """The inverse of moments (a checkpoint's state back in place)."""
        self.state.pop(name, None)
        if moments:
            self.state[name] = moments["velocity"]

    def step(self, params, grads, lr=None, decay=None):
        """decay: optional {name: bool or per-element 0/1 mask} instead of the 2-D rule (the trainer's flat array)."""
        lr = self.lr if lr is None else lr
        self.t += 1
        for name, p in params.items():
            g = grads[name]
            apply_weight_decay(p, name, lr, self.weight_decay, decay)
            if self.momentum:
                v = self.state.get(name)
                if v is None:
                    v = self.state[name] = array_module(p).zeros_like(p)
                v *= self.momentum
                v += g
                g = v
            p -= lr * g


class AdamW:
    def __init__(self, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        self.lr = lr                      # learning rate (a schedule may pass another one to step())
        self.b1, self.b2 = betas          # decay rates of the first and second moment estimates
        self.eps = eps                    # added to sqrt(v) to avoid division by zero
        self.weight_decay = weight_decay  # decoupled weight decay on 2-D parameters
        self.t = 0                        # steps taken (for the bias corrections)
        self.state = {}                   # name (the trainer: "flat") -> (m, v)

    def moments(self, name):
        """{"m": first moment, "v": second moment} of parameter `name` (empty before the first step)."""
        return dict(zip(("m", "v"), self.state[name])) if name in self.state else {}

    def set_moments(self, name, moments):
        """The inverse of moments (a checkpoint's state back in place)."""
        self.state.pop(name, None)
        if moments:
            self.state[name] = (moments["m"], moments["v"])

    def step(self, params, grads, lr=None, decay=None):
        """decay: optional {name: bool or per-element 0/1 mask} instead of the 2-D rule (the trainer's flat array)."""
        lr = self.lr if lr is None else lr
        self.t += 1
        c1, c2 = 1.0 - self.b1 ** self.t, 1.0 - self.b2 ** self.t
        for name, p in params.items():
            g = grads[name]
            xp = array_module(p)
            if name not in self.state:
                self.state[name] = (xp.zeros_like(p), xp.zeros_like(p))
            m, v = self.state[name]
            m *= self.b1
            m += (1.0 - self.b1) * g
            v *= self.b2
            v += (1.0 - self.b2) * (g * g)
            apply_weight_decay(p, name, lr, self.weight_decay, decay)
            denom = xp.sqrt(v / c2)
            denom += self.eps
            p -= (lr / c1) * (m / denom)


def make_optimizer(name, lr, momentum=0.0, weight_decay=0.0, betas=(0.9, 0.95)):
    if name == "sgd":
        return SGD(lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return AdamW(lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


def lr_at(step, lr, warmup=0, total=None, min_ratio=0.1):
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio * lr at step `total` (steps count from 1).
    total=None: constant after warmup."""
    if warmup and step <= warmup:
        return lr * step / warmup
    if not total or total <= warmup:
        return lr
    progress = min((step - warmup) / (total - warmup), 1.0)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def grad_square_sums(grads, norm_weight):
    """On the device, no host copy: [sum of squares over tensor-sharded parameters, over replicated ones].
    norm_weight(name): 1 (or True) for a parameter split over tp, 0 (or False) for a replicated one, a fraction w
    for one that 1/w tp ranks hold alike (a replicated key/value head: hsgd.step.trainer.HybridTrainer.norm_weight),
    whose squares count w on each of them."""
    g0 = next(iter(grads.values()))
    xp = array_module(g0)
    zero = xp.zeros((), dtype=g0.dtype)
    sharded = sum(((g * g).sum() * float(norm_weight(n)) for n, g in grads.items() if norm_weight(n)), zero)
    replicated = sum(((g * g).sum() for n, g in grads.items() if not norm_weight(n)), zero)
    return xp.stack([sharded, replicated])


def norm_from_squares(sharded, replicated, tp_comm=None, pp_comm=None, dp_comm=None, copies=1):
    """The norm of the full model's gradient from this rank's sums of squares (host floats).

        ||g||^2 = sum over sharded parameters of their squares, summed over the tp ranks (each holds a slice)
                + sum over replicated parameters of their squares, counted once (every tp rank holds a copy)
    then summed over pipeline stages (pp_comm), which hold different layers. Gradients are already averaged
    over dp, so replicas compute the same norm without communicating, unless each holds only a chunk (ZeRO:
    pass dp_comm, and both sums are first added over it). copies: how many stages hold each layer (2 for DualPipe's
    two copies, hsgd.pp.dual, whose summed gradients are equal on both: the sum over pp divided by it).
    """
    if dp_comm is not None:
        sharded, replicated = dp_comm.comm.allreduce(sharded), dp_comm.comm.allreduce(replicated)
    total = (sharded if tp_comm is None else tp_comm.comm.allreduce(sharded, op=MPI.SUM)) + replicated
    if pp_comm is not None:
        total = pp_comm.comm.allreduce(total, op=MPI.SUM) / copies     # (DualPipe: each layer on two stages)
    return math.sqrt(total)


def global_grad_norm(grads, norm_weight, tp_comm=None, pp_comm=None):
    """The global gradient norm (see norm_from_squares, grad_square_sums), with one host copy of the two sums."""
    sq = to_host(grad_square_sums(grads, norm_weight))
    return norm_from_squares(float(sq[0]), float(sq[1]), tp_comm, pp_comm)


def clip_grads(grads, norm, max_norm):
    """Scale all gradients by max_norm / norm when norm > max_norm. Returns the factor applied."""
    if not max_norm or norm <= max_norm:
        return 1.0
    factor = max_norm / (norm + 1e-12)
    for g in grads.values():
        g *= factor
    return factor
