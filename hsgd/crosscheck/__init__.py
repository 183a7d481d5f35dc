"""Check another system's distributed gradients against hsgd's serial float64 reference, and name the bug:

    python -m hsgd.crosscheck DIR          (DIR: a dump, hsgd/crosscheck/FORMAT.md)

hsgd.crosscheck.dump        the dump format: reading and checking it (DumpError), writing it
hsgd.crosscheck.hsgd_dump   hsgd.train --dump-step N DIR: hsgd's own runs as dumps
hsgd.crosscheck.classify    what kind of bug a wrong gradient shows: a constant factor, a permutation, padding,
                            a partial sum, or only rounding
hsgd.crosscheck.__main__    the command: reassemble, reference, the per-parameter table, exit 0 / 1 / 2
"""
