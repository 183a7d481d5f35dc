"""The layer functions the tensor-parallel model runs, in one place: hsgd.model.ops's (the tuned kernels, with the
plain residual pair of hsgd.model.layers) and the vocab-parallel embedding and cross-entropy of hsgd.tp.layers.
hsgd.tp.model takes them from a TPSetup, as this module or, in a bfloat16 or float16 run, as hsgd.tp.rounded's
RoundedOps around it."""
from hsgd.model.ops import (fused_forward, fused_input_grad, fused_weight_grad, gelu_backward,  # noqa: F401
                            gelu_forward, layernorm_backward, layernorm_forward, linear_forward, linear_input_grad,
                            linear_weight_grad, qkv_forward, qkv_input_grad, qkv_weight_grad, repeat_kv_rows_backward,
                            repeat_kv_rows_forward, residual_backward, residual_forward, rmsnorm_backward,
                            rmsnorm_forward, rope_rows_backward, rope_rows_forward, swiglu_backward, swiglu_forward)
from hsgd.tp.layers import (vocab_cross_entropy_backward, vocab_cross_entropy_forward,  # noqa: F401
                            vocab_lookup_backward, vocab_lookup_forward, vocab_range)
