"""``./launch``: start, watch, stop and restart the ranks of a training job.

    main.py       command line, preflight checks, the restart loop
    plan.py       what will run: command, each rank's environment and shard (``--dry-run``)
    hosts.py      hostfiles in mlx.launch's JSON format, validated before anything starts
    rank.py       the wrapper every rank runs in: relays output and signals, reports its exit
    supervise.py  one attempt of a job: start, relay, stop on signals or a failed rank, summarize
    restart.py    what a restart resumes from and its record in TensorBoard

Nothing is imported here. The contract with the ranks (backends, environment, exit
statuses) is ``dtrain.contract``, below both the launcher and ``dtrain.distributed``.
"""
