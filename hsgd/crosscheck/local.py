"""What a data-parallel rank holds when its gradient is never reduced: the gradient of its own rows alone.

Data parallelism cuts the global batch of B sequences into dp slices, dp rank d taking sequences [d B/dp, (d+1) B/dp)
(FORMAT.md). The loss is the mean over all B T tokens, so its gradient is the mean of the slices' own gradients,

    R = (1/dp) sum_d R_d,     R_d = the gradient of the mean loss over slice d's tokens alone,

and the All-Reduce (or Reduce-Scatter) over dp is what turns each rank's R_d into R. A rank whose buffer never
receives the reduced value holds R_d, or R_d / dp when it divides by the global token count before the reduction
(as Megatron-LM and FSDP do); so does every rank of a reduction over another group, one whose ranks hold the same
rows (tp: its ranks compute the same R_d). `Local(dump, params).of(name)` gives those candidates, classify's
"unreduced", computed the first time a gradient fails: dp runs of the reference on B/dp sequences each.

Left out: context parallelism's positions (a cp rank's R_d would be its chunks' alone), and micro-batches (a rank
that reduces some micro-batches and not others).
"""
from dataclasses import replace

from .experts import reference


class Local:
    """of(name) -> [(class, detail, array)]: each dp slice's own gradient of the parameter (and 1/dp of it);
    candidates() -> the same for every parameter, [(what, {name: array})] (hsgd.crosscheck.replicas)."""

    def __init__(self, dump, params):
        self.dump, self.params, self.grads, self.made = dump, params, None, None

    def slices(self):
        """[(d, first sequence, last sequence)] of the dp slices, or [] when there is one or B does not divide."""
        B, dp = self.dump.idx.shape[0], self.dump.parallel["dp"]
        if dp == 1 or B % dp:
            return []
        b = B // dp
        return [(d, d * b, (d + 1) * b - 1) for d in range(dp)]

    def run(self):
        """[grads of slice d] from the reference on that slice's sequences, the layout's other sizes kept (with
        experts, a slice is one dp rank's micro-batches)."""
        if self.grads is None:
            self.grads, dump, b = [], self.dump, self.dump.idx.shape[0] // max(1, len(self.slices()))
            for d, first, _ in self.slices():
                rows = slice(first, first + b)
                one = replace(dump, idx=dump.idx[rows], targets=dump.targets[rows],
                              parallel={**dump.parallel, "dp": 1})
                self.grads.append(reference(one, self.params)[1])
        return self.grads

    def candidates(self):
        """[(what it is, {name: array})]: R_d and R_d / dp of every slice d (made once)."""
        if self.made is None:
            dp, self.made = self.dump.parallel["dp"], []
            for (d, first, last), g in zip(self.slices(), self.run()):
                rows = f"dp rank {d}'s rows alone (sequences {first}..{last})"
                self.made += [(f"the gradient of {rows}", g),
                              (f"1/dp x the gradient of {rows}", {n: a / dp for n, a in g.items()})]
        return self.made

    def of(self, name):
        """classify's `others`: G is one slice's own gradient."""
        return [("unreduced", f"G is {what}: {MEANS}", g[name]) for what, g in self.candidates()]


MEANS = "the reduction over dp is missing, or ran over a group whose ranks hold the same rows (such as tp)"
