"""One training step: the lecture's algorithm, steps 1 to 4 on every rank (slice, forward and backward, average,
update), and what decides on the host whether the step counts. Chapters 10 (the hybrid grid end to end, 3D) and
14 (loss scaling).

    settings     TrainConfig: grouped dataclasses whose fields are the flags; each factory takes its group
    experiments  the group of faults and stragglers made on purpose (--inject-fault, --straggler)
    trainer      HybridTrainer: gradients (steps 1-3) and update (step 4)
    health       the step's one host copy; stop or skip on a non-finite value
    loss_scale   dynamic loss scaling for float16 (GradScaler's rules)
"""
