"""Where a step's plan runs: this process (one device), or one process per tensor-parallel rank.

    base.py         the executor interface and `create_executor`
    multiproc.py    rank 0 here, the other ranks in worker processes, each running every plan
    tp_worker.py    a worker process's loop (its own model shard, runner and KV)
"""
