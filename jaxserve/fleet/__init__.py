"""Beyond one engine: N engine replicas behind one OpenAI endpoint (``jaxserve serve
--data-parallel-size N``) and the prefill / decode router of disaggregated serving
(``jaxserve router``).

Everything here runs in a front process that loads no jax and no engine: the replicas are
``jaxserve serve`` processes of their own, reached over HTTP on 127.0.0.1 (or any URL for the
router). Modules:

    prefix_keys.py  a request body -> the chained hashes of its prompt's first blocks
    routing.py      which replica serves a request: round-robin, least load, longest prefix
    placement.py    each replica's share of the machine (cores, GPUs) as environment and affinity
    replicas.py     start, watch and stop the replica processes
    backends.py     the replicas as the front sees them: in-flight counts, polled load
    metrics.py      /metrics of every replica, labelled by replica, and their sums
    proxy.py        the front's FastAPI app: forward, stream back, abort on disconnect
    disagg.py       ``jaxserve router``: prefill on a producer, decode on a consumer
"""
