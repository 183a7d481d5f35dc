"""An independent reference for hsgd's hand-written gradients: a tiny reverse-mode autograd on NumPy arrays,
and the GPT model spec written with it.

Part 1, the engine (micrograd, but for arrays). Every op builds a `Tensor` that remembers its inputs and a
closure `_backward` that pushes the output's gradient to the inputs (a vector-Jacobian product), with `+=`
so a tensor used twice collects both contributions. `Tensor.backward()` sorts the graph topologically and
runs the closures from the output back. NumPy broadcasting in the forward is undone in the backward by
summing the gradient over the broadcast axes (`_unbroadcast`).

Part 2, `gpt_loss(params, idx, targets, cfg)`: the GPT-2-style decoder written from the model spec with these
ops only. It deliberately imports nothing from hsgd (not layers, not serial): it is a second, independent
implementation, so agreement with `hsgd.model.serial.loss_and_grads` checks both the math and the code.

Legend: B batch, T sequence, C d_model, NH heads, hs = C/NH head size, F d_ff, V vocab, L layers.

Left out on purpose: speed (every intermediate is kept), in-place ops, higher-order gradients, and any op the
model does not need. Gradients are always float64-exact up to rounding, never approximated.
"""
import math

import numpy as np


def _unbroadcast(grad, shape):
    """Sum `grad` down to `shape`: the adjoint of NumPy broadcasting `shape` up to grad.shape."""
    while grad.ndim > len(shape):                                  # leading axes that broadcasting added
        grad = grad.sum(axis=0)
    for axis, n in enumerate(shape):                               # axes of size 1 that were stretched
        if n == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


class Tensor:
    """An array in the computation graph. `data` is the value, `grad` d(output)/d(data) after backward()."""

    def __init__(self, data, parents=()):
        self.data = np.asarray(data, dtype=np.float64)
        self.grad = np.zeros_like(self.data)
        self._parents = parents
        self._backward = lambda: None                              # leaves and constants: nothing to push

    @property
    def shape(self):
        return self.data.shape

    @property
    def ndim(self):
        return self.data.ndim

    def __repr__(self):
        return f"Tensor(shape={self.shape})"

    # Graph traversal

    def backward(self):
        """Seed d(self)/d(self) = 1 and run every op's local backward, outputs before inputs."""
        order, seen, stack = [], set(), [(self, False)]
        while stack:                                               # iterative post-order DFS
            node, children_done = stack.pop()
            if children_done:
                order.append(node)
            elif id(node) not in seen:
                seen.add(id(node))
                stack.append((node, True))
                stack.extend((p, False) for p in node._parents)
        self.grad = np.ones_like(self.data)
        for node in reversed(order):
            node._backward()

    # Elementwise binary ops with broadcasting: out = a (op) b

    def __add__(self, other):
        a, b = self, _tensor(other)
        out = Tensor(a.data + b.data, (a, b))

        def _backward():
            a.grad += _unbroadcast(out.grad, a.shape)
            b.grad += _unbroadcast(out.grad, b.shape)
        out._backward = _backward
        return out

    def __sub__(self, other):
        a, b = self, _tensor(other)
        out = Tensor(a.data - b.data, (a, b))

        def _backward():
            a.grad += _unbroadcast(out.grad, a.shape)
            b.grad -= _unbroadcast(out.grad, b.shape)
        out._backward = _backward
        return out

    def __mul__(self, other):
        a, b = self, _tensor(other)
        out = Tensor(a.data * b.data, (a, b))

        def _backward():
            a.grad += _unbroadcast(out.grad * b.data, a.shape)
            b.grad += _unbroadcast(out.grad * a.data, b.shape)
        out._backward = _backward
        return out

    def __truediv__(self, other):
        a, b = self, _tensor(other)
        out = Tensor(a.data / b.data, (a, b))

        def _backward():
            a.grad += _unbroadcast(out.grad / b.data, a.shape)
            b.grad -= _unbroadcast(out.grad * a.data / (b.data * b.data), b.shape)
        out._backward = _backward
        return out

    def __radd__(self, other):
        return _tensor(other) + self

    def __rsub__(self, other):
        return _tensor(other) - self

    def __rmul__(self, other):
        return _tensor(other) * self

    def __rtruediv__(self, other):
        return _tensor(other) / self

    def __neg__(self):
        out = Tensor(-self.data, (self,))

        def _backward():
            self.grad -= out.grad
        out._backward = _backward
        return out

    def __matmul__(self, other):
        """Batched matrix product over the last two axes; leading (batch) axes broadcast."""
        a, b = self, _tensor(other)
        out = Tensor(a.data @ b.data, (a, b))

        def _backward():                                           # dA = dY B^T,  dB = A^T dY
            a.grad += _unbroadcast(out.grad @ np.swapaxes(b.data, -1, -2), a.shape)
            b.grad += _unbroadcast(np.swapaxes(a.data, -1, -2) @ out.grad, b.shape)
        out._backward = _backward
        return out

    # Elementwise unary ops: out = f(x), dx = dout * f'(x)

    def __pow__(self, p):
        assert isinstance(p, (int, float)), "only constant exponents"
        out = Tensor(self.data ** p, (self,))

        def _backward():
            self.grad += out.grad * p * self.data ** (p - 1)
        out._backward = _backward
        return out

    def exp(self):
        out = Tensor(np.exp(self.data), (self,))

        def _backward():
            self.grad += out.grad * out.data
        out._backward = _backward
        return out

    def log(self):
        out = Tensor(np.log(self.data), (self,))

        def _backward():
            self.grad += out.grad / self.data
        out._backward = _backward
        return out

    def tanh(self):
        out = Tensor(np.tanh(self.data), (self,))

        def _backward():
            self.grad += out.grad * (1.0 - out.data * out.data)
        out._backward = _backward
        return out

    def sqrt(self):
        out = Tensor(np.sqrt(self.data), (self,))

        def _backward():
            self.grad += out.grad * 0.5 / out.data
        out._backward = _backward
        return out

    # Reductions

    def sum(self, axis=None, keepdims=False):
        out = Tensor(self.data.sum(axis=axis, keepdims=keepdims), (self,))

        def _backward():
            g = out.grad
            if axis is not None and not keepdims:                  # put the reduced axes back as size 1
                g = np.expand_dims(g, axis)
            self.grad += np.broadcast_to(g, self.shape)
        out._backward = _backward
        return out

    def mean(self, axis=None, keepdims=False):
        total = self.sum(axis=axis, keepdims=keepdims)
        return total / float(self.data.size // total.data.size)   # divide by the number of summed entries

    def max_detached(self, axis, keepdims=True):
        """The max as a constant (no gradient): only used to shift softmax / logsumexp for stability,
        which leaves their value, and so their gradient, unchanged."""
        return Tensor(self.data.max(axis=axis, keepdims=keepdims))

    # Shape ops: the backward applies the inverse permutation / reshape

    def reshape(self, *shape):
        out = Tensor(self.data.reshape(*shape), (self,))

        def _backward():
            self.grad += out.grad.reshape(self.shape)
        out._backward = _backward
        return out

    def transpose(self, *axes):
        out = Tensor(self.data.transpose(*axes), (self,))

        def _backward():
            self.grad += out.grad.transpose(np.argsort(axes))
        out._backward = _backward
        return out

    def swapaxes(self, a1, a2):
        axes = list(range(self.ndim))
        axes[a1], axes[a2] = axes[a2], axes[a1]
        return self.transpose(*axes)

    def __getitem__(self, index):
        """Slices and integer-array gathers (embedding rows, target logits). The backward scatters with
        np.add.at, so a row gathered twice (a repeated token) receives both gradients."""
        out = Tensor(self.data[index], (self,))

        def _backward():
            np.add.at(self.grad, index, out.grad)
        out._backward = _backward
        return out


def _tensor(x):
    return x if isinstance(x, Tensor) else Tensor(x)


def where(mask, a, b):
    """mask ? a : b for a constant boolean mask (broadcast against a and b)."""
    a, b = _tensor(a), _tensor(b)
    mask = np.asarray(mask, dtype=bool)
    out = Tensor(np.where(mask, a.data, b.data), (a, b))

    def _backward():
        a.grad += _unbroadcast(np.where(mask, out.grad, 0.0), a.shape)
        b.grad += _unbroadcast(np.where(mask, 0.0, out.grad), b.shape)
    out._backward = _backward
    return out


# Part 2: the GPT model spec, composed from the ops above


def layernorm(x, w, b, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, biased variance."""
    mu = x.mean(axis=-1, keepdims=True)                            # (B, T, 1)
    xc = x - mu                                                    # (B, T, C)
    var = (xc * xc).mean(axis=-1, keepdims=True)                   # (B, T, 1)
    return xc / (var + eps).sqrt() * w + b                         # (B, T, C)


def softmax(x, axis=-1):
    e = (x - x.max_detached(axis)).exp()
    return e / e.sum(axis=axis, keepdims=True)


def gelu(x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + (math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)).tanh())


def attention(x, p, h, n_heads):
    """Causal multi-head self-attention; head j is columns j*hs:(j+1)*hs of the q, k, v projections."""
    B, T, C = x.shape
    hs = C // n_heads

    def heads(m):                                                  # (B, T, C) -> (B, NH, T, hs)
        y = x @ p[h + f"attn.{m}.weight"] + p[h + f"attn.{m}.bias"]
        return y.reshape(B, T, n_heads, hs).transpose(0, 2, 1, 3)
    q, k, v = heads("q"), heads("k"), heads("v")
    scores = (q @ k.swapaxes(-1, -2)) / math.sqrt(hs)              # (B, NH, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))                  # key s visible from query t iff s <= t
    att = softmax(where(causal, scores, -np.inf), axis=-1)         # (B, NH, T, T)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)           # (B, T, C), heads side by side
    return y @ p[h + "attn.proj.weight"] + p[h + "attn.proj.bias"]


def mlp(x, p, h):
    u = x @ p[h + "mlp.fc.weight"] + p[h + "mlp.fc.bias"]          # (B, T, F)
    return gelu(u) @ p[h + "mlp.proj.weight"] + p[h + "mlp.proj.bias"]


def cross_entropy(logits, targets):
    """Mean over all B*T positions of logsumexp(logits) - logits[target]."""
    B, T, V = logits.shape
    m = logits.max_detached(-1)                                    # (B, T, 1)
    lse = (logits - m).exp().sum(axis=-1).log() + m.reshape(B, T)  # (B, T)
    picked = logits[np.arange(B)[:, None], np.arange(T)[None, :], targets]   # (B, T)
    return (lse - picked).mean()


def gpt_loss(params, idx, targets, cfg):
    """The scalar loss Tensor; params maps GPT-2 names to Tensors, idx and targets are int arrays (B, T)."""
    p = params
    idx, targets = np.asarray(idx), np.asarray(targets)
    T = idx.shape[1]
    x = p["wte"][idx] + p["wpe"][:T]                               # (B, T, C)
    for i in range(cfg.n_layers):
        h = f"h.{i}."
        x = x + attention(layernorm(x, p[h + "ln1.weight"], p[h + "ln1.bias"]), p, h, cfg.n_heads)
        x = x + mlp(layernorm(x, p[h + "ln2.weight"], p[h + "ln2.bias"]), p, h)
    logits = layernorm(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["lm_head.weight"]   # (B, T, V)
    return cross_entropy(logits, targets)


def loss_and_grads(arrays, idx, targets, cfg):
    """(loss, grads) like hsgd.model.serial.loss_and_grads, but from the autograd engine: float, dict of arrays."""
    params = {name: Tensor(a) for name, a in arrays.items()}
    loss = gpt_loss(params, idx, targets, cfg)
    loss.backward()
    return float(loss.data), {name: t.grad for name, t in params.items()}
