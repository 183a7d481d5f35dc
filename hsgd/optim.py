"""Optimizers that update parameters in place from their gradients.

The seed paper's mini-batch SGD is  w <- w - lr * (1/B) * sum_j grad_j . hsgd's loss is already the mean
over the batch, so its gradient *is* (1/B) * sum_j grad_j, and the update is  w <- w - lr * g.
Options: momentum mu (heavy ball, v <- mu v + g, w <- w - lr v) and decoupled weight decay wd
(w <- w - lr * wd * w, applied to matrices only, not to biases or LayerNorm parameters).
"""
from .backend import array_module


def decays(name, p):
    """Weight decay applies to weight matrices and embeddings (2-D), not to biases and LayerNorm (1-D)."""
    return p.ndim >= 2


class SGD:
    def __init__(self, lr, momentum=0.0, weight_decay=0.0):
        self.lr = lr                      # learning rate (overridden per step by a schedule, if any)
        self.momentum = momentum          # heavy-ball coefficient mu; 0 = plain SGD
        self.weight_decay = weight_decay  # decoupled weight decay on 2-D parameters
        self.velocity = {}                # name -> v, created on first use

    def step(self, params, grads, lr=None):
        lr = self.lr if lr is None else lr
        for name, p in params.items():
            g = grads[name]
            if self.weight_decay and decays(name, p):
                p *= 1.0 - lr * self.weight_decay
            if self.momentum:
                v = self.velocity.get(name)
                if v is None:
                    v = self.velocity[name] = array_module(p).zeros_like(p)
                v *= self.momentum
                v += g
                g = v
            p -= lr * g

    def state(self):
        return {"velocity": self.velocity}
