"""The points of a training step where something besides the training itself may act (hsgd.train's loop calls
them, in order, and knows nothing else of what they do):

    before_step(step, trainer, batch)      before the step's forward pass; batch: the global (idx, targets)
    after_gradients(trainer, step, loss)   after the gradients are averaged over dp_comm, before the update
    after_step(trainer, step)              after the update
    in_save(step)                          True: cut the checkpoint written after this step short (a SIGKILL)
    entering(phase, step)                  a phase watched by --step-timeout starts (hsgd.run.watchdog): load,
                                           validation, save, dump or sample, of or after `step`

StepWatcher does nothing at each; hsgd.run.faults.Faults (--inject-fault) is one.
"""


class StepWatcher:
    def before_step(self, step, trainer, batch):
        pass

    def after_gradients(self, trainer, step, loss):
        pass

    def after_step(self, trainer, step):
        pass

    def in_save(self, step):
        return False

    def entering(self, phase, step):
        pass
