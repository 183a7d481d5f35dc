"""The layer functions the models run, chosen in this one place.

hsgd.layers holds every layer as its plain formulas (the reference a learner reads); hsgd.kernels will hold the
tuned versions with the same signatures. The tensor-parallel model imports its layers from here.
"""
from .layers import (attention_backward, attention_forward, cross_entropy_backward,  # noqa: F401
                     cross_entropy_forward, embedding_backward, embedding_forward, gelu_backward, gelu_forward,
                     layernorm_backward, layernorm_forward, linear_backward, linear_forward, qkv_backward,
                     qkv_forward)
