"""Cache-aware placement of requests on workers, below both front ends that use it.

The router (:mod:`radixserve.router`, workers behind HTTP) and the data-parallel server
(:mod:`radixserve.server.dp_client`, engine cores behind ZeroMQ) make the same decision: per
worker, an exact mirror of its radix tree rebuilt from the worker's own cache events
(:mod:`.events`, :mod:`.mirror`), health and load (:mod:`.worker`), and a policy that turns
mirrors and loads into a choice (:mod:`.policies`). :mod:`.dispatch` is that decision with
no HTTP, for the engine cores of one server. Living here, neither front end imports the other.
"""
