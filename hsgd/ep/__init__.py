"""Expert parallelism: a mixture-of-experts block's experts split over ep ranks folded out of dp x cp, the tokens
sent to the ranks of their experts by all-to-all and back. Chapter 19.

    layout      where the experts live (ep_comm, edp_comm), and what a layout can compute (its checks)
"""
