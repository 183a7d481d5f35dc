"""Where the bytes go: what every rank sends per step and holds per category, by formula and measured, each
formula checked equal to the measurement. Chapter 11 (memory), chapter 10 (bytes on each communicator).

    traffic       the bytes a rank sends per step on each communicator, added up from each part's closed form
    activations   activation bytes, counted and by formula; Korthikanti et al.'s and ZeRO's published formulas
    step_memory   this implementation's bytes per category at every moment the probe samples
    allocations   --memory: every array of a step attributed to a category by a real allocation tracker
"""
