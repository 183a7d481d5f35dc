"""Checking that a low-precision run is right: the tolerance oracle (rounding, or a bug?) and bugs on purpose to
show that the checks catch them. Chapter 14; hsgd.verify runs the oracle.

    oracle      the rounding-error model, a layout's runs, the oracle itself
    verdict     what the oracle saw: the Verdict, its tables and its picture
    mutations   known bugs of distributed training code, switched on for the length of a `with` block
"""
