"""hsgd.plan: which layout, will it fit, how fast. See hsgd/plan/__main__.py for the command line.

    layout.py     what one rank of a planned layout holds and sends in hsgd (sizes only, equal to the trainer's)
"""
