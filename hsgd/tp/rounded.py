"""Where a bfloat16 or float16 run rounds: around the operations of the tensor-parallel model, never inside its
formulas. hsgd.tp.model writes a block as the math (x = residual_forward(x, o), dx = S.enter_backward(dx_in));
a TPSetup with a Numerics that rounds (hsgd.model.precision) hands it these three wrappers instead of the plain
layer functions, scheme and context layout, and each rounds what its operation hands back, at the point of
hsgd.model.precision.POINTS that names it:

    point       rounded                                            by
    matmul      q, k, v; the fc and the LM head's outputs           RoundedOps.qkv_forward, .linear_forward
                gate and up (SwiGLU); q and k after their rotation  RoundedOps.fused_forward, .rope_rows_forward
                the output projections' (after their collective)    RoundedScheme.proj_forward
    layernorm   LayerNorm's or RMSNorm's output                     RoundedOps.layernorm_forward, .rmsnorm_forward
    gelu        GELU's or SwiGLU's output                           RoundedOps.gelu_forward, .swiglu_forward
    attention   the core attention's output                         RoundedAttention.attention_forward
    residual    the residual stream after each addition             RoundedOps.residual_forward
    grad        every activation gradient an operation hands back   the backward functions of all three

The weights ("weights") are rounded by the exchange that holds them, the tensor-parallel collectives' partial sums
("payload") by the communicator (comm.payload_round), the gradient exchange ("reduce") by the exchange. What is
not rounded stays float32: LayerNorm's statistics, the softmaxes, the weight gradients (accumulated in float32, as
Megatron-LM's gradient-accumulation fusion does). Chapter 14 measures what the rounding does.
"""


def rounded(scheme, layer_functions, ctx, num):
    """(scheme, layer functions, context layout) as a run with numerics `num` computes with them: themselves in
    float32 and float64 (no array is touched), rounded where bfloat16 or float16 round."""
    if not num.rounds:
        return scheme, layer_functions, ctx
    return RoundedScheme(scheme, num), RoundedOps(layer_functions, num), RoundedAttention(ctx, num)


class RoundedOps:
    """The layer functions of hsgd.tp.ops (or another module with the same names), each output rounded where its
    point says (a rounded copy; Numerics.round). The weight gradients and the vocab-parallel lookup and loss pass
    through."""

    def __init__(self, layer_functions, num):
        self.f, self.num = layer_functions, num

    def layernorm_forward(self, x, w, b):
        y, cache = self.f.layernorm_forward(x, w, b)
        return self.num.round(y, "layernorm"), cache

    def layernorm_backward(self, dout, cache, dw, db):
        return self.num.round(self.f.layernorm_backward(dout, cache, dw, db), "grad")

    def qkv_forward(self, x, *weights):
        q, k, v, cache = self.f.qkv_forward(x, *weights)
        return self.num.round(q, "matmul"), self.num.round(k, "matmul"), self.num.round(v, "matmul"), cache

    def qkv_input_grad(self, dqkv, cache):
        return self.num.round(self.f.qkv_input_grad(dqkv, cache), "grad")

    def linear_forward(self, x, W, b=None):
        y, cache = self.f.linear_forward(x, W, b)
        return self.num.round(y, "matmul"), cache

    def linear_input_grad(self, dy, cache):
        return self.num.round(self.f.linear_input_grad(dy, cache), "grad")

    def gelu_forward(self, x):
        y, cache = self.f.gelu_forward(x)
        return self.num.round(y, "gelu"), cache

    def gelu_backward(self, dout, cache):
        return self.num.round(self.f.gelu_backward(dout, cache), "grad")

    def residual_forward(self, x, o):
        return self.num.round(self.f.residual_forward(x, o), "residual")

    def residual_backward(self, dout, dbranch):
        return self.num.round(self.f.residual_backward(dout, dbranch), "grad")

    def vocab_cross_entropy_backward(self, dloss, cache):
        return self.num.round(self.f.vocab_cross_entropy_backward(dloss, cache), "grad")

    def rmsnorm_forward(self, x, w):
        y, cache = self.f.rmsnorm_forward(x, w)
        return self.num.round(y, "layernorm"), cache

    def rmsnorm_backward(self, dout, cache, dw):
        return self.num.round(self.f.rmsnorm_backward(dout, cache, dw), "grad")

    def fused_forward(self, x, weights, biases):
        ys, cache = self.f.fused_forward(x, weights, biases)
        return [self.num.round(y, "matmul") for y in ys], cache

    def fused_input_grad(self, dy, cache):
        return self.num.round(self.f.fused_input_grad(dy, cache), "grad")

    def rope_rows_forward(self, x, n_heads, cos, sin):
        y, cache = self.f.rope_rows_forward(x, n_heads, cos, sin)
        return self.num.round(y, "matmul"), cache

    def rope_rows_backward(self, dy, cache):
        return self.num.round(self.f.rope_rows_backward(dy, cache), "grad")

    def swiglu_forward(self, gate_pre, up_pre):
        y, cache = self.f.swiglu_forward(gate_pre, up_pre)
        return self.num.round(y, "gelu"), cache

    def swiglu_backward(self, dh, cache):
        return tuple(self.num.round(d, "grad") for d in self.f.swiglu_backward(dh, cache))

    # as they are: the weight gradients accumulate in float32; the lookup's sum rounds as the residual stream; the
    # loss's softmax is float32; the kv heads' repeat and its sum move values (the sum of n_rep gradients is
    # rounded with the others, in rope_rows_backward or by the fused product that reads it)
    def repeat_kv_rows_forward(self, k, n_kv_heads, n_rep):
        return self.f.repeat_kv_rows_forward(k, n_kv_heads, n_rep)

    def repeat_kv_rows_backward(self, dout, cache):
        return self.f.repeat_kv_rows_backward(dout, cache)

    def fused_weight_grad(self, dy, cache, *grads):
        return self.f.fused_weight_grad(dy, cache, *grads)

    def linear_weight_grad(self, dy, cache, dW, db=None):
        return self.f.linear_weight_grad(dy, cache, dW, db)

    def qkv_weight_grad(self, dqkv, cache, *grads):
        return self.f.qkv_weight_grad(dqkv, cache, *grads)

    def vocab_lookup_forward(self, idx, wte_part, start):
        return self.f.vocab_lookup_forward(idx, wte_part, start)

    def vocab_lookup_backward(self, dx, cache, dwte_part):
        return self.f.vocab_lookup_backward(dx, cache, dwte_part)

    def vocab_cross_entropy_forward(self, logits, targets, start, V, comm):
        return self.f.vocab_cross_entropy_forward(logits, targets, start, V, comm)


class RoundedScheme:
    """A tensor-parallel scheme (hsgd.tp.schemes) whose output projections round their output ("matmul", after the
    collective and the bias) and whose backward operations round the gradients they hand back ("grad"); the rest
    passes through."""

    def __init__(self, scheme, num):
        self.S, self.num = scheme, num

    def enter_forward(self, x, comm):
        return self.S.enter_forward(x, comm)

    def enter_backward(self, dx, comm):
        return self.num.round(self.S.enter_backward(dx, comm), "grad")

    def leave_forward(self, y, comm):
        return self.S.leave_forward(y, comm)

    def leave_backward(self, dy, comm):
        return self.S.leave_backward(dy, comm)

    def proj_forward(self, y_part, W_part, b, comm):
        o, cache = self.S.proj_forward(y_part, W_part, b, comm)
        return self.num.round(o, "matmul"), cache

    def proj_backward(self, do, cache, grads, prefix, comm, wg):
        return self.num.round(self.S.proj_backward(do, cache, grads, prefix, comm, wg), "grad")

    def rows(self, T, comm):
        return self.S.rows(T, comm)

    def replicated_grads(self, grads, names):
        return self.S.replicated_grads(grads, names)

    def finish_replicated(self, part, grads, comm):
        return self.S.finish_replicated(part, grads, comm)


class RoundedAttention:
    """A context layout (hsgd.tp.attention) whose core attention rounds its output ("attention": the scores and
    the softmax stay float32 inside, as in a fused kernel) and its gradients dq, dk, dv ("grad", in place)."""

    def __init__(self, ctx, num):
        self.ctx, self.num = ctx, num
        self.keeps_probabilities = ctx.keeps_probabilities

    def rows(self, t0, t1):
        return self.ctx.rows(t0, t1)

    def attention_forward(self, q, k, v, nh):
        y, cache = self.ctx.attention_forward(q, k, v, nh)
        return self.num.round_(y, "attention"), cache             # in place: a cache that holds y keeps it rounded

    def attention_backward(self, dy, cache, out):
        self.ctx.attention_backward(dy, cache, out=out)
        return self.num.round_(out, "grad")
