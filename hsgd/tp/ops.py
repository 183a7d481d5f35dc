"""The layer functions the tensor-parallel model runs, in one place: hsgd.model.ops's (the tuned kernels, with the
plain residual pair of hsgd.model.layers) and the vocab-parallel embedding and cross-entropy of hsgd.tp.layers.
hsgd.tp.model takes them from a TPSetup, as this module or, in a bfloat16 or float16 run, as hsgd.tp.rounded's
RoundedOps around it."""
from hsgd.model.ops import (gelu_backward, gelu_forward, layernorm_backward, layernorm_forward,  # noqa: F401
                            linear_forward, linear_input_grad, linear_weight_grad, qkv_forward, qkv_input_grad,
                            qkv_weight_grad, residual_backward, residual_forward)
from hsgd.tp.layers import (vocab_cross_entropy_backward, vocab_cross_entropy_forward,  # noqa: F401
                            vocab_lookup_backward, vocab_lookup_forward, vocab_range)
