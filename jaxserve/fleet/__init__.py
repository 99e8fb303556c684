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
    front_watch.py  a replica exits when its front is gone (SIGKILLed)
    backends.py     the replicas as the front sees them: in-flight counts, polled load
    metrics.py      /metrics of every replica, labelled by replica, and their sums
    forwarding.py   one request to a backend, its answer streamed back, cut when the client goes
    proxy.py        the data-parallel front's FastAPI app (and the pieces the router shares)
    data_parallel.py  ``serve --data-parallel-size``: bind, start the replicas, serve, stop them
    serve_front.py  a front's app under uvicorn until SIGINT / SIGTERM
    disagg.py       ``jaxserve router``: prefill on a producer, decode on a consumer
"""
