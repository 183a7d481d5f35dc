"""A training run around the steps: its settings and command lines, the checks before any work, what it prints,
what it watches, and how it ends on a fault or a signal. Chapters 10 (a run end to end) and 19 (fault tolerance).

    flags         the command lines made from the settings (hsgd.step.settings), and --config FILE.toml read back
    config_file   one TOML loader for config and hardware files
    preflight     checks before any work: outputs writable, optional modules there, the memory the machine has
    progress      progress lines and the --log-json records
    report        what rank 0 prints at the end: bytes, the pipeline, memory, experts, staging, trace and plots
    experts       with experts: each step's routing (load, kept, dropped per expert), the end-of-run lines, load.png
    plots         PNG pictures of a run: losses, a timeline, memory
    watchers      the points of a step where something besides training acts (faults, --dump-step)
    faults        --inject-fault: one fault, on purpose
    signals       SIGTERM and SIGINT: stop cleanly, with a checkpoint
    diverged      replicas that differ, updates skipped for good: stop, with the last finite state saved
    watchdog      --step-timeout: end the job when a collective phase hangs (steps, checkpoints, validations, ...)
"""
