"""FP8 matrix products: the model's linear layers with their operands cast to 8 bits (--fp8 hybrid).

A linear Y = X W (+ b) of a Transformer block has three products, each cast on its way in (hsgd.fp8.scaling):

    forward    Y  = q(X) q(W)          X (N, K) and W (K, M) in E4M3, tiles along K          (+ b, not cast)
    dgrad      dX = q(dY) q(W)^T       dY (N, M) in E5M2 and W in E4M3, tiles along M
    wgrad      dW += q(X)^T q(dY)      X in E4M3 and dY in E5M2, tiles along the tokens N     (db = sum dY, not cast)

in the products' accumulation type (float32 in a float32 run, as a tensor core accumulates; float64 in the exact
mode; --fp8-accumulate: a few bits, promoted every N_c, hsgd.fp8.accumulate). The master weights, their gradients
and the optimizer stay in the run's type; q(W) is a cast copy. What is not cast, as in DeepSeek-V3 and Megatron-LM's
FP8 recipes: the embedding, the LM head, the norms, the attention's scores and softmax, the loss.

Fp8Ops wraps the layer functions the models take (hsgd.model.layers for the serial reference, hsgd.tp.ops in a
layout) and the tensor-parallel schemes' projections (make_scheme(..., ops)), with the same signatures: the model's
formulas do not change. Which linear a call is, it learns from its weight: bind(params) tells it the parameters
dict the model reads, and a weight found there under a block's linear name (FP8_LINEARS) is cast; any other product
(the LM head) passes through. Each linear's operands have names in the histories of delayed scaling:

    <weight name>:w        the weight, e.g. h.0.attn.q.weight:w
    <linear>:dy            its output gradient, e.g. h.0.attn.q:dy
    <input>:x              its input, shared by the linears that read it: h.0.attn.qkv:x (q, k, v), h.0.mlp.in:x
                           (fc, or gate and up), h.0.attn.proj:x, h.0.mlp.proj:x
"""
import re

from hsgd.fp8.domains import Holders
from hsgd.model import llama_layers

FP8_LINEARS = re.compile(r"^h\.\d+\.(attn\.(q|k|v|proj)|mlp\.(fc|gate|up|proj))\.weight$")


def input_key(name):
    """The history name of a linear's input: the linears that read one tensor share it."""
    block, _, rest = name.partition(".attn.") if ".attn." in name else name.partition(".mlp.")
    part = "attn" if ".attn." in name else "mlp"
    lin = rest.split(".")[0]
    shared = {"q": "qkv", "k": "qkv", "v": "qkv", "fc": "in", "gate": "in", "up": "in"}.get(lin, lin)
    return f"{block}.{part}.{shared}:x"


def key(name, role):
    """The history name of operand `role` of the linear whose weight is `name`."""
    if role == "x":
        return input_key(name)
    return f"{name}:w" if role == "w" else f"{name[:-len('.weight')]}:dy"


class Fp8Ops:
    """The layer functions `ops` with the block linears' products in FP8 (the module docstring). fp8: the run's
    hsgd.fp8.scaling.Fp8; holders: where the operands lie (hsgd.fp8.domains.Holders; default: one rank, the serial
    model). Every other function is ops' own."""

    def __init__(self, ops, fp8, holders=None):
        self.f, self.fp8, self.holders = ops, fp8, holders or Holders()
        self.params, self.ids, self.seen = {}, {}, None

    def __getattr__(self, name):
        """Every other layer function: ops' own (the plain layers' Llama ones from hsgd.model.llama_layers, as
        hsgd.model.serial.llama_ops takes them)."""
        return getattr(self.f if hasattr(self.f, name) else llama_layers, name)

    def bind(self, params):
        """The parameters dict the model reads its weights from (ZeRO-3 fills it group by group: looked up again
        on a miss)."""
        self.params, self.ids, self.seen = params, {}, None

    def name_of(self, W):
        """The name of a block linear's weight W in the bound dict, or None (not cast: the LM head, a tied head's
        view). The map from the arrays to their names is made again only when the dict holds other arrays."""
        n = self.ids.get(id(W))
        if n is None or self.params.get(n) is not W:
            now = [id(v) for v in self.params.values()]
            n = None
            if now != self.seen:
                self.seen, self.ids = now, {id(v): k for k, v in self.params.items()}
                n = self.ids.get(id(W))
        return n if n is not None and FP8_LINEARS.match(n) else None

    def q(self, a2, role, name, axis):
        """Operand a2 (2-D) of the linear `name` cast along `axis` (a weight ZeRO-3 sent as FP8 arrives cast with its
        one scale, hsgd.dp.fp8_gather: as it is)."""
        if role == "w" and name in self.fp8.precast:
            return a2
        h = self.holders
        return self.fp8.quantize(a2, role, key(name, role), h.spread(name, role), h, axis)

    # ---------------------------------------------------------------------------------------- one linear
    def linear_forward(self, x, W, b=None):
        """y = q(x) q(W) (+ b); the cache (x2, W) holds them uncast (the backward casts along its own axes)."""
        name = self.name_of(W)
        if name is None:
            return self.f.linear_forward(x, W, b)
        x2 = x.reshape(-1, x.shape[-1])                                          # (N, K)
        y = self.fp8.matmul(self.q(x2, "x", name, 1), self.q(W, "w", name, 0))   # (N, M)
        if b is not None:
            y += b
        return y.reshape(*x.shape[:-1], W.shape[1]), (x2, W)

    def linear_input_grad(self, dy, cache):
        """dx = q(dy) q(W)^T, both cast along M."""
        x2, W = cache
        name = self.name_of(W)
        if name is None:
            return self.f.linear_input_grad(dy, cache)
        dy2 = dy.reshape(-1, dy.shape[-1])                                       # (N, M)
        dx = self.fp8.matmul(self.q(dy2, "dy", name, 1), self.q(W, "w", name, 1).T)   # (N, K)
        return dx.reshape(*dy.shape[:-1], W.shape[0])

    def linear_weight_grad(self, dy, cache, dW, db=None):
        """dW += q(x)^T q(dy), both cast along the tokens; db += sum dy (uncast)."""
        x2, W = cache
        name = self.name_of(W)
        if name is None:
            return self.f.linear_weight_grad(dy, cache, dW, db)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dW += self.fp8.matmul(self.q(x2, "x", name, 0).T, self.q(dy2, "dy", name, 0))   # (K, M)
        if db is not None:
            db += dy2.sum(axis=0)

    def linear_backward(self, dy, cache, dW, db=None):
        """The serial model's linear backward: the two halves."""
        self.linear_weight_grad(dy, cache, dW, db)
        return self.linear_input_grad(dy, cache)

    # ---------------------------------------------------------------------------------------- several on one input
    def fused_forward(self, x, weights, biases):
        """y_j = q(x) q(W_j) + b_j: x cast once (its history is the input's), each weight with its own scale."""
        names = [self.name_of(W) for W in weights]
        if names[0] is None:
            return self.f.fused_forward(x, weights, biases)
        x2 = x.reshape(-1, x.shape[-1])
        xq = self.q(x2, "x", names[0], 1)
        ys = []
        for W, b, n in zip(weights, biases, names):
            y = self.fp8.matmul(xq, self.q(W, "w", n, 0))
            if b is not None:
                y += b
            ys.append(y.reshape(*x.shape[:-1], W.shape[1]))
        return ys, (x2, tuple(weights))

    def segments(self, dy, weights):
        """[(dy_j (N, M_j), W_j, name_j)]: the outputs' gradients side by side, cut by the weights' widths."""
        dy2, lo, out = dy.reshape(-1, dy.shape[-1]), 0, []
        for W in weights:
            out.append((dy2[:, lo:lo + W.shape[1]], W, self.name_of(W)))
            lo += W.shape[1]
        return out

    def fused_input_grad(self, dy, cache):
        """dx = sum_j q(dy_j) q(W_j)^T."""
        x2, weights = cache
        if self.name_of(weights[0]) is None:
            return self.f.fused_input_grad(dy, cache)
        dx = None
        for dy_j, W, n in self.segments(dy, weights):
            part = self.fp8.matmul(self.q(dy_j, "dy", n, 1), self.q(W, "w", n, 1).T)   # (N, K)
            dx = part if dx is None else dx + part
        return dx.reshape(*dy.shape[:-1], weights[0].shape[0])

    def fused_weight_grad(self, dy, cache, *grads):
        """dW_j += q(x)^T q(dy_j), db_j += sum dy_j. grads: (dW_1, db_1, ..., dW_n, db_n)."""
        x2, weights = cache
        if self.name_of(weights[0]) is None:
            return self.f.fused_weight_grad(dy, cache, *grads)
        xq = self.q(x2, "x", self.name_of(weights[0]), 0).T                    # (K, N)
        for (dy_j, W, n), dW, db in zip(self.segments(dy, weights), grads[0::2], grads[1::2]):
            dW += self.fp8.matmul(xq, self.q(dy_j, "dy", n, 0))                 # (K, M_j)
            if db is not None:
                db += dy_j.sum(axis=0)

    def qkv_forward(self, x, Wq, bq, Wk, bk, Wv, bv):
        (q, k, v), cache = self.fused_forward(x, (Wq, Wk, Wv), (bq, bk, bv))
        return q, k, v, cache

    def qkv_input_grad(self, dqkv, cache):
        return self.fused_input_grad(dqkv, cache)

    def qkv_weight_grad(self, dqkv, cache, *grads):
        self.fused_weight_grad(dqkv, cache, *grads)


def fp8_ops(ops, fp8, holders=None):
    """ops itself without FP8 (fp8 None), else Fp8Ops around it."""
    return ops if fp8 is None else Fp8Ops(ops, fp8, holders)

