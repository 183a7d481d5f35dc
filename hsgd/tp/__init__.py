"""Tensor parallelism: the lecture's M workers of a group hold one copy of the model between them, every weight
matrix split by columns or rows, attention split by heads (sections 3.1 to 3.3). Chapters 5 (column and row
splits, f and g), 6 (attention heads, the vocabulary, sequence parallelism), 7 (the Llama family's block) and 16
(experts).

    layers      f/g, gather_T/scatter_T, column and row linears, the all-gather and its adjoint, vocab-parallel
                embedding and cross-entropy
    schemes     the schemes as objects: Megatron, Gather (the lecture's), Sequence
    shards      how each parameter splits over tp: its axis, a rank's shard, the whole again
    attention   the context layout the model asks (positions, core attention); the whole sequence's, materialized
                or flash
    kv          grouped-query attention's key/value heads over tp: split or replicated, and the replicas' sum
    experts     the MoE block on a tp group: experts split like the MLP, the gates' Allreduce, the router's
                gradient; its balance domain over the layout's ranks; the bytes it changes
    wgrad       the weight-gradient half of a backward pass, done at once or kept for a W action
    hooks       what runs around each gradient group's forward and backward (ZeRO 2 and 3, the memory probe)
    ops         the layer functions the model runs, in one place
    rounded     where a bfloat16 or float16 run rounds: the layer functions, scheme and attention, rounded
    model       the model (either family) on a tensor-parallel group, written once for the three schemes: a
                block, the embedding, the head, a pipeline stage; TPSetup, what all of them take
"""
