"""The run: everything between a config and an adapter, above the engine and the all-reduce.

    trainer.py     setup and the loop (cadence only: eval, save, stop, log); train() is the entry
    step.py        one optimizer step (sampler -> totals -> engine -> all-reduce -> AdamW)
    evaluation.py  held-out eval/ metrics
    checkpoint.py  run state, checkpoints and resume, the output-folder lock
    optimizer.py   the learning rate of a step; clip + AdamW + the non-finite skip as one function
    tracking.py    TensorBoard events and the progress bar
    guards.py      warnings about the run's own metrics
    best.py        train.keep_best: the best evaluated step, its adapter copy, the early stop
    lambda_control.py  orpo.lambda_schedule: adaptive: the dynamic-λ controller and the λ it feeds the step

Nothing is imported here.
"""
