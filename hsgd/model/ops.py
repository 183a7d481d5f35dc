"""The layer functions the models run, chosen in this one place: the tuned kernels.

hsgd.model.layers holds every layer as its plain formulas (the reference a learner reads, and the one
hsgd.model.serial runs by default); hsgd.model.kernels holds the tuned versions with the same signatures and the
same results (tests/test_kernels.py). The tensor-parallel model takes its layers from here (through hsgd.tp.ops), and
`serial.loss_and_grads(..., ops=hsgd.model.ops)` runs the serial model on them. To run everything on the plain
formulas instead (to read a profile, or to rule the kernels out), import the first fourteen names below from
hsgd.model.layers. The tensor-parallel block also uses the kernels' fused q/k/v projection (qkv_forward /
qkv_backward and its halves, with attention_backward's out= buffer), which has no plain counterpart: the plain model
calls linear_forward three times, and the kernels' qkv pair would stay in use. The residual connection is one
addition, as plain as it gets: it has no tuned version.
"""
from hsgd.model.kernels import (attention_backward, attention_forward, cross_entropy_backward,  # noqa: F401
                                cross_entropy_forward, embedding_backward, embedding_forward, gelu_backward,
                                gelu_forward, layernorm_backward, layernorm_forward, linear_backward, linear_forward,
                                linear_input_grad, linear_weight_grad)
from hsgd.model.kernels import (fused_forward, fused_input_grad, fused_weight_grad, qkv_backward,  # noqa: F401
                                qkv_forward, qkv_input_grad, qkv_weight_grad)
from hsgd.model.kernels import swiglu_backward, swiglu_forward  # noqa: F401
# the Llama block's other layers: their plain formulas (a small part of a step's time)
from hsgd.model.llama_layers import (repeat_kv_rows_backward, repeat_kv_rows_forward, rmsnorm_backward,  # noqa: F401
                                     rmsnorm_forward, rope_rows_backward, rope_rows_forward)
from hsgd.model.layers import residual_backward, residual_forward  # noqa: F401
