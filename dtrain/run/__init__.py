"""The run: everything between a config and an adapter, above the engine and the all-reduce.

    trainer.py     setup and the loop (cadence only: eval, save, stop, log); train() is the entry
    step.py        one optimizer step (sampler -> objective totals -> engine -> all-reduce -> AdamW)
    evaluation.py  held-out eval/ metrics
    checkpoint.py  run state, checkpoints and resume, the output-folder lock
    optimizer.py   clip + AdamW + the non-finite skip as one function
    schedule.py    the learning rate of a step
    tracking.py    TensorBoard events and the progress bar
    guards.py      warnings about the run's own metrics

Nothing is imported here.
"""
