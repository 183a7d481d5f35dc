"""The weight-gradient half of a backward pass, done at once or kept for later (the "W" of zero-bubble pipelines).

A linear layer Y = X W + b has two gradients with different customers:
    dX = dY W^T        the layer below waits for it (and, across a pipeline, the previous stage): "B"
    dW += X^T dY       nothing waits for it until the optimizer step:                            "W"
(ops.linear_input_grad / ops.linear_weight_grad; ops.qkv_* for q, k, v as one product). Qi et al. 2024, "Zero
Bubble Pipeline Parallelism", run the two at different times: B as soon as possible, so that the previous stage
can go on, and W later, in the time the stage would otherwise wait (hsgd.pp.schedules). The backward pass of
hsgd.tp.model hands every weight-gradient product to a WeightGrads.
"""


class WeightGrads:
    """Where a backward pass's weight-gradient products go: dW += X^T dY of every linear layer, with the row sums
    of the biases split with it (everything else a backward computes, the LayerNorms', the replicated biases' and
    the embedding's gradients, is O(N C) and stays in the backward).

    WeightGrads(grads) does them at once (the fused backward of GPipe and 1F1B); WeightGrads() keeps each as
    (group, function, arrays, parameter names), and run(grads) does them later: the W action of a zero-bubble
    schedule (Qi et al. 2024, hsgd.pp.schedules), after the B action has sent dL/d(input) on. Either way the same
    functions on the same arrays: the same numbers. Kept, the products hold their X and dY until run."""

    def __init__(self, grads=None):
        self.grads, self.later = grads, []
        self.group = None                    # the gradient group the backward pass is in (set by stage_backward)

    @property
    def keeps(self):
        """True when the products wait for run() (a W action), False when they are done at once."""
        return self.grads is None

    def add(self, fn, args, *names):
        """fn(*args, *(the gradients of names)), now or later. The names are looked up in the stage's own grads
        dict, so only tensor-split parameters may come here: a replicated one (the sequence scheme accumulates
        those in a partial buffer, tp_schemes.Sequence.replicated_grads) stays in the backward pass. A name None
        (a bias the model's family has not) hands fn None."""
        if self.grads is not None:
            fn(*args, *(None if n is None else self.grads[n] for n in names))
        else:
            self.later.append((self.group, fn, args, names))

    def groups(self):
        """The groups whose products are kept, in the order the backward pass met them."""
        return list(dict.fromkeys(g for g, *_ in self.later))

    def run(self, grads, group):
        """Do the kept products of one group into grads, and drop them (and what they held)."""
        for g, fn, args, names in self.later:
            if g == group:
                fn(*args, *(None if n is None else grads[n] for n in names))
        self.later = [e for e in self.later if e[0] != group]
