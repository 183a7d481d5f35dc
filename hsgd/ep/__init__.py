"""Expert parallelism: a mixture-of-experts block's experts split over ep ranks folded out of dp x cp, the tokens
sent to the ranks of their experts by all-to-all and back. Chapter 19.

    layout      where the experts live (ep_comm, edp_comm), which parameters a rank holds, the rows each rank
                routes together, and what a layout can compute (its checks)
    dispatch    the all-to-all dispatch and combine (Alltoall of the counts, Alltoallv of the rows, the
                permutation by expert) and their adjoints; the bytes from a step's routing histogram
"""
