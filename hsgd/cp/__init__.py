"""Context parallelism: the sequence itself split over cp ranks, T/cp positions each, with the load-balanced
split; every layer but the core attention works on its own positions. Chapter 15.

    split         the split (positions, ContextSplit), its checks, the work and the bytes of the schemes
    ring          ring attention: (k, v) blocks around cp_comm, merged by the online softmax (Liu et al. 2023)
    allgather     every key and value All-Gathered, dk and dv Reduce-Scattered (Dubey et al. 2024)
    ulysses       all-to-all from the sequence split to a head split and back, the attention whole (Jacobs et al.
                  2023)
    hierarchical  a2a+p2p: Ulysses inside groups of a ranks, the ring across the cp/a groups (Megatron-LM's)
    layouts       the one place a rank's context layout is made: the whole sequence, ring, all-gather, Ulysses or
                  a2a+p2p
"""
