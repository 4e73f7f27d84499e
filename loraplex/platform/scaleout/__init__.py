"""Scale-out on Ray Serve (`loraplex serve --replicas N`): the gateway as a Ray Serve ingress, N engine
replicas as a deployment, requests routed to the replica that holds their adapter.

    HTTP ─► Serve proxy ─► Ingress x M (FastAPI gateway: keys, quotas in Redis, usage in the database)
                               │  DeploymentHandle, stream=True, multiplexed_model_id = engine adapter name
                               ▼  AdapterAffinityRouter (router.py) picks the replica
                           EngineReplica x N (replica.py: one AsyncLLM each, its own adapter slots)

`client.py` is the ingress's `EngineClient` over the handle; `app.py` builds the application and runs
it. Nothing here is imported unless `--replicas` is given: Ray is an optional extra (`loraplex[ray]`).
docs/scale-out.md says how to run it on a cluster and what was measured.
"""
